"""How one request is decoded: vLLM's `SamplingParams`, with vLLM's names, defaults and meanings (docs/library.md;
the sampler: docs/sampling.md).

    SamplingParams(max_tokens=16)                      # sampled at temperature 1 (vLLM's default), 16 tokens at most
    SamplingParams(temperature=0.0, max_tokens=16)     # greedy
    SamplingParams(max_tokens=64, stop_token_ids=[13]) # ... or until token 13 is sampled
    SamplingParams(ignore_eos=True)                    # the checkpoint's EOS does not end it

    SamplingParams(temperature=0.8, top_p=0.95, seed=1)  # sampled; the same tokens at any TP size, in any batch

Every value is checked when the object is made (a one-line ValueError); vLLM's settings that are not built here are
refused by name when they would change the output, and accepted at their defaults (NOT_BUILT_BY_REASON).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (as vLLM)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class FieldError(ValueError):
    """A request refused because of one of its fields: `field` names it (a SamplingParams name, or "prompt"), so that a
    server's error can name it too (OpenAI's `param`)."""

    def __init__(self, message: str, field: str | None = None):  # message first: a pickled copy is rebuilt from it
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens at most: finish_reason "length" when reached
    temperature: float = 1.0  # vLLM's default (the distribution as the model gives it); 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # finish_reason "stop" when one is sampled
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings: the text is cut before the first one
    ignore_eos: bool = False  # the checkpoint's EOS does not finish the request
    logprobs: int | None = None
    # each prompt token's logprob after the tokens before it, and the top N there (RequestOutput.prompt_logprobs)
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer of at least 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0: greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= -1 (0 or -1: off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1: off)")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0: off)")
        if self.seed is not None and (not _is_int(self.seed) or not -2 ** 53 < self.seed < 2 ** 53):
            raise ValueError(f"seed={self.seed!r} must be None or an integer of magnitude below 2**53")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name}={value!r} must be None or an integer >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        ids = self.stop_token_ids
        ids = () if ids is None else (ids,) if _is_int(ids) else ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of token ids")
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be a string or a list of non-empty strings")
        if 0 < self.temperature < GREEDY_BELOW:  # vLLM's rule: z / T would overflow; this close to 0 is greedy
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# vLLM's SamplingParams fields not built here, by what is built instead: each with its default (accepted, and ignored).
NOT_BUILT_BY_REASON = {
    "one completion per request": {"n": 1, "best_of": None},
    "no penalties": {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0},
    "no minimum: a request may end at its first token": {"min_tokens": 0},
    "no logit bias": {"logit_bias": None},
    "no restriction of the vocabulary": {"allowed_token_ids": None},
    "no banned words": {"bad_words": None},
    "the text is cut before a stop string": {"include_stop_str_in_output": False},
    "no logits processors": {"logits_processors": None},
    "prompts are never truncated": {"truncate_prompt_tokens": None},
    "no structured output": {"guided_decoding": None, "structured_outputs": None},
    "text is always decoded where there is a tokenizer": {"detokenize": True},
    "special tokens are skipped in the text": {"skip_special_tokens": True},
    "the tokenizer's own decoding": {"spaces_between_special_tokens": True},
}
NOT_BUILT = {name: (default, built) for built, fields in NOT_BUILT_BY_REASON.items() for name, default in fields.items()}


def _refusing_init(init):
    known = [f.name for f in fields(SamplingParams)]

    def __init__(self, *args, **kwargs):
        for name in list(kwargs):
            if name in known:
                continue
            if name not in NOT_BUILT:
                raise ValueError(f"SamplingParams has no setting {name!r}; known: {', '.join(known)}")
            default, built = NOT_BUILT[name]
            value = kwargs.pop(name)
            if value != default and not (default is None and value in ([], {}, ())) \
                    and not (name == "best_of" and value == 1):
                raise ValueError(f"{name}={value!r} is not built here: {built}; leave it at its default {default!r}")
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    return __init__


SamplingParams.__init__ = _refusing_init(SamplingParams.__init__)
GREEDY = SamplingParams(temperature=0.0)  # how a request without sampling parameters (a launcher's) is decoded
