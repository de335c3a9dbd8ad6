"""What the engine hands back, in vLLM's shapes: a RequestOutput per request, its CompletionOutput, its metrics.

    RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput(index=0, text, token_ids,
                  finish_reason)], finished, metrics=RequestMetrics(arrival_time, first_token_time, finished_time))

token_ids are every token generated so far (cumulative, as vLLM's default); text is their detokenized text
("" where the model has no tokenizer), cut before a stop string when one matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while it runs
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # with SamplingParams.logprobs=N: per token, its id and top N
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.time() when the request was added
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    num_cached_tokens: int = 0  # prompt tokens whose K,V came from the prefix cache on its first admission
    oracle: dict | None = None  # LLM(check=True): the dense oracle's verdict ("match", "near-tie", "MISMATCH")
    # SamplingParams.prompt_logprobs: None for the first prompt token, then {id: logprob} for each prompt token (the
    # token itself and the top N after the tokens before it), vLLM's layout
    prompt_logprobs: list[dict[int, float] | None] | None = None
