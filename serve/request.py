"""One request's state on every rank: its tokens, how many have K,V in the cache, and where it is in its life.

    WAITING --admit--> RUNNING --sample a stop id--> FINISHED_STOPPED
       ^                  |  \\--max_new_tokens-----> FINISHED_LENGTH
       |                  |
       +--- PREEMPTED <---+   (its blocks given back; it recomputes prompt + output when admitted again)

    any state --abort--> FINISHED_ABORTED   (its blocks given back at once)

Plain Python, no torch: the scheduler (serve/scheduler.py) moves requests between states, identically on
every rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from serve.sampling_params import SamplingParams


def eos_ids(eos_id) -> frozenset[int]:
    """An end-of-sequence setting as the set of ids that finish a request: None (none), an id, or several ids."""
    return frozenset() if eos_id is None else frozenset((eos_id,) if isinstance(eos_id, int) else eos_id)


def eos_key(eos_id) -> int:
    """One number for an eos setting, for the ranks' settings fingerprints (-1: none)."""
    return sum((i + 1) * (t + 1) for i, t in enumerate(sorted(eos_ids(eos_id)))) or -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finish_reason(self) -> str | None:
        """vLLM's words: "stop" (a stop id), "length" (max_tokens), "abort"; None while it runs."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the iteration at which it arrives
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K,V are cached (a request built mid-stream may start above 0)
    finished: bool = False
    prefix_hit: int = 0  # prompt tokens whose K,V came from the prefix cache (summed over its admissions)
    num_cached_tokens: int | None = None  # the same on its first admission (vLLM's RequestOutput.num_cached_tokens)
    preemptions: int = 0
    stop_ids: frozenset[int] = frozenset()  # sampling one of these finishes it (eos, stop_token_ids), as eos_id does
    params: SamplingParams | None = None
    sampling_seed: int | None = None  # the seed of its noise: params.seed, or one drawn from the engine's seed and id
    status: RequestStatus = RequestStatus.WAITING

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def decoding(self) -> bool:
        """One token left to compute, and it is a generated one: the next row is a decode."""
        return bool(self.output) and len(self.prompt) + len(self.output) - self.computed == 1

    @property
    def capacity(self) -> int:
        """Cache positions it can ever need: the last sampled token's K,V are never computed."""
        return len(self.prompt) + self.max_new_tokens - 1

    def append(self, token: int, eos_id: int | None = None) -> bool:
        """Add a sampled token; True (and the finished status) if it ends the request."""
        self.output.append(token)
        if token in self.stop_ids or (eos_id is not None and token == eos_id):
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output) >= self.max_new_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        self.finished = True
        return True

    def abort(self) -> None:
        self.status, self.finished = RequestStatus.FINISHED_ABORTED, True
