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

        prepare(running)      before planning: each decoding request's proposals (Request.spec_token_ids), at most
                              what its max_tokens leaves after the target's own; the scheduler gives them rows and
                              carries them in its SchedulerOutput (ScheduledRequest.spec)
        fill(plan, requests)  after planning: the plan's proposals made now where they need the plan (a draft
                              model's forwards fill its placeholders); `verify` then holds the verifier's inputs
        accept(rows, spec)    after the step's one read: a verified chunk's tokens from its rows of the table

    NgramProposer (prompt lookup, host only) and serve/draft.py's DraftRunner (a draft model) are its two kinds."""

    verify: list | None = None  # this step's inputs of the rejection sampler (a draft's proposals and q), or None

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def prepare(self, running) -> None:
        for r in running:
            if r.decoding:
                k = min(self.config.num_speculative_tokens, r.max_new_tokens - len(r.output) - 1)
                r.spec_token_ids = self.proposals(r, max(k, 0))

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
