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

import math
import statistics
from dataclasses import dataclass, field

from serve.nested_config import nested_config
from serve.sampling_params import FieldError

METHODS = ("ngram", "draft_model")
# how a draft model's proposals are verified (draft_acceptance; vLLM v0's draft_token_acceptance_method defaulted to
# the rejection sampler, so the key is ours, not its name with another default): the draft races with the
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
    draft_acceptance: str | None = None  # draft_model: ACCEPTANCE_METHODS, shared_noise by default
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
        acceptance = self.draft_acceptance
        if method == "draft_model":
            acceptance = acceptance or ACCEPTANCE_METHODS[0]
            if acceptance not in ACCEPTANCE_METHODS:
                raise ValueError(f"speculative_config draft_acceptance={acceptance!r}: choose "
                                 f"{' or '.join(ACCEPTANCE_METHODS)}")
        elif acceptance is not None:
            raise ValueError("speculative_config draft_acceptance applies to a draft model; n-gram "
                             "proposals are verified by the sampler itself")
        object.__setattr__(self, "draft_acceptance", acceptance)
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
        return nested_config(cls, value, "speculative_config", "{'method': 'ngram', 'num_speculative_tokens': 3}")


def check_request(config: "SpeculativeConfig | None", logprobs: int | None, prompt_logprobs: int | None = None
                  ) -> None:
    """The rule between speculation and a request (the driver checks it before sending, rank 0 again on arrival)."""
    if config is not None and config.method == "draft_model" and prompt_logprobs is not None:
        raise FieldError("prompt_logprobs with speculative_config method='draft_model' is not built: drop "
                         "prompt_logprobs, or use method='ngram'", "prompt_logprobs")
    if config is not None and config.draft_acceptance == "rejection_sampler" and logprobs is not None:
        raise FieldError("logprobs with speculative_config draft_acceptance='rejection_sampler' are not "
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


@dataclass
class Regime:
    """The Tuner's measurements for one kind of step: a batch-size bucket, all greedy or not (sampling's rows cost
    more, and its proposals are accepted less). Acceptance is kept per kind of sampling, the times per regime."""
    times: dict[int, list[float]] = field(default_factory=dict)  # k -> its last WINDOW step times per request
    seen: dict[int, int] = field(default_factory=dict)  # k -> steps measured (the first is not kept)

    @property
    def cost(self) -> dict[int, float]:
        """k -> seconds per decoding request: the median of its last measurements (one slow step moves nothing)."""
        return {k: statistics.median(ts) for k, ts in self.times.items() if len(ts) >= Tuner.MIN_TIMES}
    best: int | None = None
    interval: int = 0  # probing: PROBE_RUN steps every `interval`, the next in `until` steps, `turn` picks which
    until: int = 0
    turn: int = 0
    probe: tuple[int, int] | None = None  # the probe under way: (its k, steps left)
    probe_s: float = 0.0  # what the last probe took (seconds per request), its steps and its k
    probe_steps: int = 0
    probe_k: int = 0


class Tuner:
    """Rank 0's choice of how many tokens to propose in a step (SpeculativeConfig.adaptive): the k in 0..K that
    maximises the tokens a step yields per second of step time, both measured, per regime (a batch-size bucket,
    powers of two, and whether every decoding request is greedy).

        tokens    E(k) = 1 + sum_{i=1..k} prod_{j<i} a_j, a_j the acceptance of proposal j + 1 given the ones before
                  accepted, counted over every offered slot as the step time is measured per offered k (a slot
                  n-gram leaves empty, or the scheduler drops, fails: it yields no token, and costs no row), decaying
                  counts (DECAY per step that offered slots), each slot's prior worth one trial: the slot before's
                  estimate (1/2 for the first), so a slot not yet tried is expected to do as the one before it
        time      a decode-only step's wall time per decoding request and k: the median of its last WINDOW
                  measurements (at least MIN_TIMES); T(0) as measured,
                  T(k >= 1) the least-squares line through the measured k >= 1 (a draft's first forward is a cost
                  of proposing at all), never below T(0) nor falling with k
        probes    a regime's first decode steps run k = 0, then 1, until each has MIN_TIMES measurements; afterwards
                  the best k, except that every `interval` steps PROBE_RUN steps run another k (best + 1, best - 1,
                  0 in turn, where they differ from the best) to keep the measurements fresh; the interval starts at
                  PROBE and doubles (to PROBE_MAX) while the probes leave the best k as it was, so a stable workload
                  pays for probing less and less; and after each probe, the next waits until what this one cost
                  beyond the best k (its time less the time the best k takes for the tokens it is expected to give)
                  is at most PROBE_BUDGET of the steps between (a draft's probe after steps off first catches up on
                  every token it skipped: at B = 16 a prefill of its own)
        kept      a step is measured only if the step before it ran the same k and it is not the regime's first
                  at that k: a step after a switch pays for the switch (a draft catching up on what it skipped, the
                  caches refilled with the other model's weights), which the steady state does not

    k = 0 turns speculation off for the step, and any k >= 1 must promise MARGIN more tokens per second than off to
    be chosen: what the steady-state times leave out (a draft catching up on a new prompt or after steps off, caches
    refilled) falls on speculation, so a near tie goes to off. The choice is rank 0's, broadcast in the control
    header, so every rank schedules the same rows."""

    PROBE, PROBE_MAX, PROBE_RUN, PROBE_BUDGET = 8, 256, 3, 0.02
    MARGIN = 0.1
    DECAY = 0.98
    WINDOW, MIN_TIMES = 5, 2

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.hits = {True: [0.0] * k_max, False: [0.0] * k_max}  # greedy or not -> per slot
        self.trials = {True: [0.0] * k_max, False: [0.0] * k_max}
        self.regimes: dict[tuple[int, bool], Regime] = {}
        self.chosen = [0] * (k_max + 1)  # steps run at each k
        self.greedy = True  # the regime of the step being run (its acceptance goes there)
        self.previous = self.current = -1  # the k of the step before, and of this one
        self.probing = False  # this step is part of a probe

    @staticmethod
    def key(decoding: int, greedy: bool) -> tuple[int, bool]:
        return max(decoding - 1, 0).bit_length(), greedy  # 1 | 2 | 3-4 | 5-8 | ...

    def acceptance(self, greedy: bool = True) -> list[float]:
        out, prior = [], 0.5
        for h, t in zip(self.hits[greedy], self.trials[greedy]):
            prior = (h + prior) / (t + 1)
            out.append(prior)
        return out

    def expected_tokens(self, k: int, greedy: bool = True) -> float:
        total, reach = 1.0, 1.0
        for a in self.acceptance(greedy)[:k]:
            reach *= a
            total += reach
        return total

    def step_time(self, regime: Regime, k: int) -> float | None:
        """T(k): T(0) as measured; for k >= 1 the least-squares line through the measured k >= 1, or the line from
        T(0) to the one measured; None until T(0) and some k >= 1 are measured."""
        base = regime.cost.get(0)
        points = [(j, t) for j, t in regime.cost.items() if j > 0]
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

    def choose(self, decoding: int, greedy: bool = True) -> int:
        """The proposals per request for the next step, given how many requests are decoding and whether all of
        them are greedy."""
        if decoding == 0 or self.k_max == 0:
            return 0
        self.greedy = greedy
        g = self.regimes.setdefault(self.key(decoding, greedy), Regime())
        self.probing = g.probe is not None
        if g.probe is None and g.probe_steps and g.best is not None:  # a probe ended: what it cost sets the next
            best_s = self.step_time(g, g.best)
            spent = g.probe_s - g.probe_steps * best_s * self.expected_tokens(g.probe_k, greedy) / \
                self.expected_tokens(g.best, greedy)
            g.until = max(g.until, math.ceil(spent / (self.PROBE_BUDGET * best_s)))
            g.probe_s, g.probe_steps = 0.0, 0
        if 0 not in g.cost:
            k = 0
        elif self.step_time(g, 0) is None:
            k = 1  # the cheapest k to learn from (a draft's first step catches up on everything): the others follow
        elif g.probe is not None:  # a probe under way
            k, left = g.probe
            g.probe = (k, left - 1) if left > 1 else None
        else:
            rate = [self.expected_tokens(j, greedy) / self.step_time(g, j) * (1 if j == 0 else 1 / (1 + self.MARGIN))
                    for j in range(self.k_max + 1)]
            best = max(range(self.k_max + 1), key=rate.__getitem__)
            if best != g.best:  # the choice moved: probe often again (once the last probe's cost is paid for)
                g.best, g.interval, g.until = best, self.PROBE, max(g.until, self.PROBE)
            k, g.until = best, g.until - 1
            if g.until <= 0:  # another k: up, down, off in turn (those that differ from the best and exist)
                g.until, g.interval = g.interval, min(2 * g.interval, self.PROBE_MAX)
                others = list(dict.fromkeys(j for j in (best + 1, best - 1, 0) if 0 <= j <= self.k_max and j != best))
                k, g.turn = others[g.turn % len(others)], g.turn + 1
                g.probe, g.probe_k, self.probing = (k, self.PROBE_RUN - 1), k, True
        self.chosen[k] += 1
        self.previous, self.current = self.current, k
        return k

    def as_dict(self) -> dict:
        """What the choice rests on (LLM.stats()): the steps run at each k, the acceptance estimate per slot (greedy
        and sampled), and per regime ("B<=n greedy" or "sampled") the modelled step time in ms per request per k."""
        return {"spec_decode_steps_by_num_proposals": list(self.chosen),
                "spec_decode_acceptance_estimate": {"greedy" if g else "sampled": [round(a, 4) for a in
                                                                                   self.acceptance(g)]
                                                    for g in (True, False)},
                "spec_decode_step_ms_per_request": {
                    f"B<={2 ** b} {'greedy' if g else 'sampled'}":
                        [None if (t := self.step_time(r, k)) is None else round(1e3 * t, 4)
                         for k in range(self.k_max + 1)] for (b, g), r in sorted(self.regimes.items())}}

    def observe_step(self, decoding: int, k: int, seconds: float) -> None:
        """A decode-only step's wall time (a step with prompt rows says nothing about k), in the regime chosen."""
        g = self.regimes.setdefault(self.key(decoding, self.greedy), Regime())
        g.seen[k] = g.seen.get(k, 0) + 1
        if self.probing:
            g.probe_s, g.probe_steps = g.probe_s + seconds / decoding, g.probe_steps + 1
        if k:  # the counts forget per step that tried slots: while off, the estimate stands (the probes explore)
            for slots in (self.hits[self.greedy], self.trials[self.greedy]):
                slots[:] = [x * self.DECAY for x in slots]
        if g.seen[k] == 1 or self.previous != k:
            return  # the regime's first step at this k pays for what warms up, a step after a switch for the switch
        g.times[k] = (g.times.get(k, []) + [seconds / decoding])[-self.WINDOW:]

    def observe(self, offered: int, accepted: int) -> None:
        """A request was offered `offered` slots and `accepted` proposals stood: slots 0..accepted were tried (all
        before accepted), the first `accepted` of them hit."""
        hits, trials = self.hits[self.greedy], self.trials[self.greedy]
        for j in range(min(offered, accepted + 1)):
            trials[j] += 1
            hits[j] += j < accepted
