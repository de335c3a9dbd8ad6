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

from serve.config import fits_alone
from serve.sampling_params import FieldError, SamplingParams


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


FINISHED = frozenset(s for s in RequestStatus if s.finish_reason is not None)


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0  # the iteration at which it arrives
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K,V are cached (a request built mid-stream may start above 0)
    prefix_hit: int = 0  # prompt tokens whose K,V came from the prefix cache (summed over its admissions)
    num_cached_tokens: int | None = None  # the same on its first admission (vLLM's RequestOutput.num_cached_tokens)
    preemptions: int = 0
    stop_ids: frozenset[int] = frozenset()  # sampling one of these finishes it: the model's eos ids, stop_token_ids
    params: SamplingParams | None = None
    sampling_seed: int | None = None  # the seed of its noise: params.seed, or one drawn from the engine's seed and id
    status: RequestStatus = RequestStatus.WAITING
    spec_token_ids: list[int] = field(default_factory=list)  # proposals for its next step (serve/spec_decode.py)
    draft_computed: int | None = None  # positions whose K,V a draft model holds (serve/draft.py); None: none yet
    priority: int = 0  # scheduling_policy "priority" (serve/scheduler.py): lower is admitted first, preempted last
    # kv_eviction h2o (serve/eviction.py): each logical block's attention so far, summed over queries, heads and layers
    kv_scores: list[float] = field(default_factory=list)
    # kv_eviction: per admission (a preemption leads to another), (outputs it had, the first position it computed
    # (after a prefix hit), [(block, computed when it went)]): what a dense reference masks (tests/test_eviction.py)
    evictions: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def decoding(self) -> bool:
        """One token left to compute, and it is a generated one: the next row is a decode."""
        return bool(self.output) and len(self.prompt) + len(self.output) - self.num_computed_tokens == 1

    @property
    def capacity(self) -> int:
        """Cache positions it can ever need: the last sampled token's K,V are never computed."""
        return len(self.prompt) + self.max_new_tokens - 1

    def append_output_token(self, token: int) -> bool:
        """Add a sampled token; True (and the finished status) if it ends the request."""
        self.output.append(token)
        if token in self.stop_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output) >= self.max_new_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def abort(self) -> None:
        self.status = RequestStatus.FINISHED_ABORTED


def output_budget(prompt_len: int, max_tokens: int, limit: int) -> int:
    """The new tokens a request may get: max_tokens, cut where prompt + output reaches the limit (max_model_len, or
    the model's context), at least one. vLLM's engine rule: such a request finishes with "length" there."""
    return min(max_tokens, max(1, limit - prompt_len))


def context_error(prompt_len: int, max_tokens: int, limit: int) -> FieldError | None:
    """vLLM's server rule, the one formula for the context limit: prompt + max_tokens <= max_model_len (limit: it, or
    the model's context). The error, in vLLM's words, names max_tokens where the prompt alone fits (with a token to
    spare), else the prompt; None within the limit."""
    if prompt_len + max_tokens <= limit:
        return None
    return FieldError(f"This model's maximum context length is {limit} tokens. However, you requested "
                      f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
                      f"completion). Please reduce the length of the messages or completion.",
                      "max_tokens" if prompt_len < limit else "prompt")


def validate_prompt(ids: list[int], max_tokens: int, vocab_size: int, max_seq_len: int, num_blocks: int,
                    block_size: int, max_model_len: int | None, block_bytes: int | None = None,
                    peak: int | None = None) -> None:
    """ValueError (one line) unless the prompt can be served: token ids of the vocabulary, a prompt no longer than
    max_model_len (unset: the model's context; a longer max_tokens is cut there, output_budget, as vLLM's engine
    does), and a pool that can hold the request alone (serve/config.fits_alone; block_bytes where
    kv_cache_memory_bytes sized it; peak: the most blocks a request holds under kv_eviction)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise FieldError("empty prompt: a request needs at least one token", "prompt")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise FieldError(f"prompt holds {bad!r}, not a token id of the vocabulary [0, {vocab_size})", "prompt")
    limit = max_model_len or max_seq_len
    if len(ids) > limit:
        what = f"max_model_len={max_model_len}" if max_model_len else f"the model's context of {max_seq_len}"
        raise FieldError(f"the prompt of {len(ids)} tokens is longer than {what}; shorten it", "prompt")
    max_tokens = output_budget(len(ids), max_tokens, limit)
    need = len(ids) + max_tokens - 1  # cached positions: the last token is sampled, never fed back
    reason = fits_alone(need, num_blocks, block_size, block_bytes, peak)
    if reason is not None:
        alone = fits_alone(len(ids), num_blocks, block_size, block_bytes, peak) is None  # with one new token
        raise FieldError(f"prompt of {len(ids)} tokens + max_tokens={max_tokens}: {reason}",
                         "max_tokens" if alone else "prompt")

