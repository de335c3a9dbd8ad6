"""What the engine hands back, in vLLM's shapes: a RequestOutput per request, its CompletionOutput, its metrics.

    RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput(index=0, text, token_ids,
                  finish_reason)], finished, metrics=RequestMetrics(arrival_time, first_token_time, finished_time))

token_ids are every token generated so far (cumulative, as vLLM's default); text is their detokenized text
("" where the model has no tokenizer), cut before a stop string when one matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layers.sampling.prompt_logprobs import host_prompt_logprobs
from layers.sampling.sampler import row_logprobs


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


def record_logprobs(outputs: dict, by_id: dict, sampled: list[int], rows: list[list[float]], result,
                    scored: list[list[float]]) -> None:
    """Rank 0 (LLMEngine): each sampled row's chosen logprob and its top-N into its request's output (the rows of
    SampleResult.table), and each scored prompt row's entry into its prompt_logprobs (a recomputed row writes again:
    its last admission's). outputs: request id -> RequestOutput; by_id: the scheduler's requests."""
    for (rid, pos), row in zip(result.prompt_where or [], scored):
        if (o := outputs.get(rid)) is not None:
            r = by_id[rid]
            o.prompt_logprobs[pos] = host_prompt_logprobs(row, r.prompt[pos], r.params.prompt_logprobs)
    if result.logprob is None:
        return
    for rid, row in zip(sampled, rows):
        o = outputs.get(rid)
        if o is None or (n := by_id[rid].params.logprobs) is None:
            continue
        chosen, step = row_logprobs(row, n)
        c = o.outputs[0]
        c.logprobs = (c.logprobs or []) + [step]
        c.cumulative_logprob = (c.cumulative_logprob or 0.0) + chosen
