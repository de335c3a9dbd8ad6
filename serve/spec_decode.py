"""Speculative decoding (docs/spec_decode.md): a proposer offers K tokens, the target verifies them in one chunk of
K + 1 rows.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4})

Per decoding request and step, host only and identically on every rank: the proposer's `prepare` gives it proposals
x_1..x_k (Request.spec_token_ids; n-gram prompt lookup over its own tokens), the scheduler gives it rows
[t, t + 1 + k) for its last token and its proposals, every row sampled (row j with the noise of output position
len(output) + j), and after the step's one read `accept` keeps x_j while t_{j-1} = x_j, then the target's own token.
For a point-mass proposal the sampler's exponential race is itself the rejection step, so the tokens are those of
decoding without speculation (docs/spec_decode.md, "Why the tokens do not change"). Counters: vLLM's spec_decode_*.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from serve.sampling_params import FieldError

METHODS = ("ngram", "draft_model")
# how a draft model's proposals are verified (vLLM v0's key, draft_token_acceptance_method): the draft races with the
# target's own noise and a proposal stands while it equals the target's token (every token is plain sampling's), or
# Leviathan et al.'s rejection rule with the draft's q (another coupling: the tokens depend on where windows fall)
ACCEPTANCE_METHODS = ("shared_noise", "rejection_sampler")
NGRAM_WINDOW = 5  # vLLM's prompt_lookup_min = prompt_lookup_max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, resolved by vLLM's rules: a `model` without a `method` is a draft model; the number
    of proposals is required; n-gram's window is prompt_lookup_min..prompt_lookup_max tokens, 5..5 when neither is
    given and the one given for both when only one is."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: a checkpoint with the target's vocabulary
    draft_token_acceptance_method: str | None = None  # draft_model: ACCEPTANCE_METHODS, shared_noise by default
    # proposals per step chosen from 0 to num_speculative_tokens by the measured acceptance and step times (Tuner);
    # False: always num_speculative_tokens (vLLM's behaviour)
    adaptive: bool = True

    def __post_init__(self):
        method = self.method
        if method is None:
            if not self.model:
                raise ValueError("speculative_config needs a method ('ngram') or a draft model "
                                 "({'model': DIR, 'num_speculative_tokens': K})")
            method = "draft_model"  # vLLM's inference for a plain draft checkpoint
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r}: choose {' or '.join(METHODS)}")
        if method == "draft_model" and not self.model:
            raise ValueError("speculative_config method='draft_model' needs a model: a checkpoint directory or a "
                             "preset with the target's vocabulary")
        acceptance = self.draft_token_acceptance_method
        if method == "draft_model":
            acceptance = acceptance or ACCEPTANCE_METHODS[0]
            if acceptance not in ACCEPTANCE_METHODS:
                raise ValueError(f"speculative_config draft_token_acceptance_method={acceptance!r}: choose "
                                 f"{' or '.join(ACCEPTANCE_METHODS)}")
        elif acceptance is not None:
            raise ValueError("speculative_config draft_token_acceptance_method applies to a draft model; n-gram "
                             "proposals are verified by the sampler itself")
        object.__setattr__(self, "draft_token_acceptance_method", acceptance)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive={self.adaptive!r} must be true or false")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if method == "ngram":  # vLLM's defaults
            low, high = (NGRAM_WINDOW, NGRAM_WINDOW) if low is None and high is None else \
                (high if low is None else low, low if high is None else high)
        for name, v in (("prompt_lookup_min", low), ("prompt_lookup_max", high),
                        ("num_speculative_tokens", self.num_speculative_tokens)):
            if v is None and name == "num_speculative_tokens":
                raise ValueError("speculative_config num_speculative_tokens is required (as in vLLM): the proposals "
                                 "per step, e.g. 3")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config {name}={v!r} must be an integer of at least 1")
            if name == "prompt_lookup_max" and low is not None and low > high:
                raise ValueError(f"speculative_config prompt_lookup_min={low} is larger than prompt_lookup_max={high}")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or vLLM's dict ({"method": ..., "num_speculative_tokens": ..., ...})."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, not {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**value)


def check_request(config: "SpeculativeConfig | None", logprobs: int | None) -> None:
    """The rule between speculation and a request (the driver checks it before sending, rank 0 again on arrival)."""
    if config is not None and config.draft_token_acceptance_method == "rejection_sampler" and logprobs is not None:
        raise FieldError("logprobs with speculative_config draft_token_acceptance_method='rejection_sampler' are not "
                         "built: drop logprobs, or use 'shared_noise' (the default)", "logprobs")


def check_draft(draft_cfg, target_cfg, name: str) -> None:
    """A draft model the target can verify: the same vocabulary, and room for the target's context."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative_config model={name!r} has a vocabulary of {draft_cfg.vocab_size} ids, the "
                         f"target {target_cfg.vocab_size}: a draft must share the target's vocabulary")
    if draft_cfg.max_seq_len < target_cfg.max_seq_len:
        raise ValueError(f"speculative_config model={name!r} has a context of {draft_cfg.max_seq_len} positions, "
                         f"shorter than the target's {target_cfg.max_seq_len}")


def propose_ngram(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the k tokens after an earlier occurrence of the longest suffix of `tokens` of n_max down to n_min
    tokens: the latest with k tokens after it, else the earliest ([] if none occurs earlier, or k = 0). A run of one
    repeated token proposes k more of it, not the one token after the run's latest position."""
    if k <= 0:
        return []
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        starts = [s for s in range(size - n - 1, -1, -1) if tokens[s:s + n] == suffix]  # latest first, not itself
        if starts:  # the latest with k tokens after it; else the earliest, which has the most
            start = next((s for s in starts if s + n + k <= size), starts[-1])
            return tokens[start + n:start + n + k]
    return []


def accept(sampled: list[int], proposals: tuple[int, ...]) -> list[int]:
    """The tokens a verified request gets: the rows' tokens t_0..t_k, proposals x_1..x_k; t_0..t_n where x_1..x_n
    equal t_0..t_{n-1} (accepted) and t_n is the target's own (a correction, or the bonus when all k are accepted)."""
    n = 0
    while n < len(proposals) and sampled[n] == proposals[n]:
        n += 1
    return sampled[:n + 1]


class Proposer:
    """Speculative decoding's seam (vLLM v1's proposers), one per engine, called by the step in this order:

        prepare(running, k)   before planning: each decoding request's proposals (Request.spec_token_ids), at most k,
                              what its max_tokens leaves after the target's own; the scheduler gives them rows and
                              carries them in its SchedulerOutput (ScheduledRequest.spec)
        fill(plan, requests)  after planning: the plan's proposals made now where they need the plan (a draft
                              model's forwards fill its placeholders); `verify` then holds the verifier's inputs
        accept(rows, spec)    after the step's one read: a verified chunk's tokens from its rows of the table

    NgramProposer (prompt lookup, host only) and serve/draft.py's DraftRunner (a draft model) are its two kinds."""

    verify: list | None = None  # this step's inputs of the rejection sampler (a draft's proposals and q), or None

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def prepare(self, running, k: int) -> dict[int, int]:
        """Up to k proposals for each decoding request (at most what its max_tokens leaves after the target's own);
        returns how many slots each was offered (request id -> k' <= k): what the Tuner's acceptance counts."""
        offered = {}
        for r in running:
            if r.decoding:
                offered[r.id] = max(min(k, r.max_new_tokens - len(r.output) - 1), 0)
                r.spec_token_ids = self.proposals(r, offered[r.id])
        return offered

    def proposals(self, r, k: int) -> list[int]:
        raise NotImplementedError

    def fill(self, plan, requests):
        return plan

    def accept(self, rows: list[list[float]], spec: tuple[int, ...]) -> list[int]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """n-gram prompt lookup over a request's own tokens (host only, the same on every rank); its verifier is the
    plain sampler's race, so a row's token is read off the table and accept() compares it with the proposal."""

    def proposals(self, r, k: int) -> list[int]:
        return propose_ngram(r.tokens, self.config.prompt_lookup_min, self.config.prompt_lookup_max, k)

    def accept(self, rows: list[list[float]], spec: tuple[int, ...]) -> list[int]:
        return accept([int(row[0]) for row in rows], spec)


@dataclass
class SpecDecodeStats:
    """Running totals, vLLM's names (its spec_decode_* counters)."""
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    def as_dict(self) -> dict:
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "spec_decode_acceptance_rate": self.num_accepted_tokens / tokens if tokens else None,
                "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else None}


class Tuner:
    """Rank 0's choice of how many tokens to propose in a step (SpeculativeConfig.adaptive): the k in 0..K that
    maximises the tokens a step yields per second of step time, both measured.

        tokens    E(k) = 1 + sum_{i=1..k} prod_{j<i} a_j, a_j the acceptance of proposal j + 1 given the ones before
                  accepted, counted over every offered slot as the step time is measured per offered k (a slot
                  n-gram leaves empty, or the scheduler drops, fails: it yields no token, and costs no row), decaying
                  counts (DECAY per step), each slot's prior worth one trial: the slot before's estimate
                  (1/2 for the first), so a slot not yet tried is expected to do as the one before it
        time      a decode-only step's wall time per decoding request, by batch-size bucket (powers of two) and k:
                  an EMA per k; T(0) as measured, T(k >= 1) the least-squares line through the measured k >= 1
        probes    a bucket's first decode steps run k = 0, then K, until each has a measurement past its first
                  (a first step pays for what warms up); afterwards the best k, except that every `interval` steps
                  one step runs another k (best + 1, best - 1, 0 in turn, where they differ from the best) to keep
                  the measurements fresh; the interval starts at PROBE and doubles (to PROBE_MAX) while the probes
                  leave the best k as it was, so a stable workload pays for probing less and less

    k = 0 turns speculation off for the step. The choice is rank 0's, broadcast in the control header, so every rank
    schedules the same rows."""

    PROBE, PROBE_MAX = 8, 256
    DECAY = 0.98
    EMA = 0.25

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.hits = [0.0] * k_max
        self.trials = [0.0] * k_max
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, k) -> seconds per decoding request
        self.seen: dict[tuple[int, int], int] = {}  # (bucket, k) -> steps measured (the first is not kept)
        self.chosen = [0] * (k_max + 1)  # steps run at each k
        self.interval, self.until, self.turn = self.PROBE, self.PROBE, 0  # probing: every `interval` steps
        self.best: int | None = None

    @staticmethod
    def bucket(decoding: int) -> int:
        return max(decoding - 1, 0).bit_length()  # 1 | 2 | 3-4 | 5-8 | ...

    def acceptance(self) -> list[float]:
        out, prior = [], 0.5
        for h, t in zip(self.hits, self.trials):
            prior = (h + prior) / (t + 1)
            out.append(prior)
        return out

    def expected_tokens(self, k: int) -> float:
        total, reach = 1.0, 1.0
        for a in self.acceptance()[:k]:
            reach *= a
            total += reach
        return total

    def step_time(self, b: int, k: int) -> float | None:
        """T(k) for bucket b: T(0) as measured; for k >= 1 the least-squares line through the measured k >= 1 (a
        draft's first forward is a cost k = 0 does not pay at all), or the line from T(0) to the one measured; None
        until T(0) and some k >= 1 are measured. Never below T(0), never falling with k."""
        base = self.cost.get((b, 0))
        points = [(j, t) for (bb, j), t in self.cost.items() if bb == b and j > 0]
        if base is None or not points:
            return None
        if k == 0:
            return base
        if len(points) == 1:
            (j, t), = points
            return base + max(t - base, 0.0) * k / j
        mk, mt = sum(j for j, _ in points) / len(points), sum(t for _, t in points) / len(points)
        slope = max(sum((j - mk) * (t - mt) for j, t in points) / sum((j - mk) ** 2 for j, _ in points), 0.0)
        return max(mt + slope * (k - mk), base)

    def choose(self, decoding: int) -> int:
        """The proposals per request for the next step, given how many requests are decoding."""
        if decoding == 0 or self.k_max == 0:
            return 0
        b = self.bucket(decoding)
        if (b, 0) not in self.cost:
            k = 0
        elif self.step_time(b, 0) is None:
            k = self.k_max
        else:
            best = max(range(self.k_max + 1), key=lambda j: self.expected_tokens(j) / self.step_time(b, j))
            if best != self.best:  # the choice moved: probe often again
                self.best, self.interval, self.until = best, self.PROBE, self.PROBE
            k, self.until = best, self.until - 1
            if self.until <= 0:  # another k: up, down, off in turn (those that differ from the best and exist)
                self.until, self.interval = self.interval, min(2 * self.interval, self.PROBE_MAX)
                others = list(dict.fromkeys(j for j in (best + 1, best - 1, 0) if 0 <= j <= self.k_max and j != best))
                k, self.turn = others[self.turn % len(others)], self.turn + 1
        self.chosen[k] += 1
        return k

    def observe_step(self, decoding: int, k: int, seconds: float) -> None:
        """A decode-only step's wall time (a step with prompt rows says nothing about k)."""
        key = (self.bucket(decoding), k)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1:
            return  # a first step at this size and k pays for what warms up
        per = seconds / decoding
        old = self.cost.get(key)
        self.cost[key] = per if old is None else old + self.EMA * (per - old)
        self.hits = [h * self.DECAY for h in self.hits]
        self.trials = [t * self.DECAY for t in self.trials]

    def observe(self, offered: int, accepted: int) -> None:
        """A request was offered `offered` slots and `accepted` proposals stood: slots 0..accepted were tried (all
        before accepted), the first `accepted` of them hit."""
        for j in range(min(offered, accepted + 1)):
            self.trials[j] += 1
            self.hits[j] += j < accepted
