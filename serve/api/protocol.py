"""The OpenAI API's request and response shapes, with OpenAI's names and meanings (and vLLM's extras top_k, min_p,
ignore_eos, stop_token_ids, priority), and the error every refusal answers with:

    400  {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Requests are checked strictly (an int where an int is meant, not "5"), unknown fields are ignored (clients send
fields this server has no use for, e.g. `user`), and fields that would change the output in ways not built here
(n > 1, echo with stream, penalties, logit_bias, tools, ...) are refused by name rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from itertools import accumulate
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from serve.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's chat limit; its completions API stops at 5)


class APIError(Exception):
    """An answer other than 200: the status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 404: "not_found_error",
                              503: "service_unavailable_error"}.get(status, "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict | None = None
    # vLLM's extras
    top_k: StrictInt = -1
    min_p: Number = 0.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    return_token_ids: StrictBool = False  # each choice (and stream chunk) also carries its new token ids
    priority: StrictInt = 0  # scheduling_policy "priority": lower first, ties by arrival (serve/scheduler.py)

    def refusals(self) -> list[tuple[bool, str, str]]:
        """(refused, why, the field) for every field this server reads but does not build, in the order checked."""
        return [(self.n != 1, f"n={self.n}: this server returns one choice per prompt (n=1)", "n"),
                *((bool(getattr(self, name)), f"{name} is not supported (leave it at 0)", name)
                  for name in ("presence_penalty", "frequency_penalty")),
                (bool(self.logit_bias), "logit_bias is not supported", "logit_bias"),
                (self.stream_options is not None and not self.stream, "stream_options is only allowed with stream=true",
                 "stream_options")]

    def refuse_unsupported(self) -> None:
        """APIError(400) naming the first refused field (refusals)."""
        for refused, why, field in self.refusals():
            if refused:
                raise APIError(400, why, field)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=float(self.temperature), top_k=self.top_k,
                                  top_p=float(self.top_p), min_p=float(self.min_p), seed=self.seed,
                                  stop_token_ids=tuple(self.stop_token_ids or ()), stop=self.stop or (),
                                  ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:  # "name=value must ...": the field it names
            message = str(exc)
            raise APIError(400, message, message.split("=", 1)[0] if "=" in message else None) from None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0 with echo: the prompt scored, nothing generated
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False  # the prompt before the completion, and with logprobs its tokens' logprobs too
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def refusals(self) -> list[tuple[bool, str, str]]:
        return super().refusals() + [
            (self.echo and self.stream, "echo is not supported with stream=true", "echo"),
            (self.max_tokens == 0 and not self.echo, "max_tokens=0 needs echo=true (the prompt scored, nothing "
             "generated); otherwise at least 1", "max_tokens"),
            (self.best_of not in (None, 1), f"best_of={self.best_of}: not supported (1 or unset)", "best_of"),
            (bool(self.suffix), "suffix is not supported", "suffix")]

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) or a batch of them; each is a choice of the answer, in order."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None  # a list holds text parts ({"type": "text", "text": ...})


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    response_format: dict | None = None

    def refusals(self) -> list[tuple[bool, str, str]]:
        return super().refusals() + [
            (bool(self.tools), "tools (tool calling) is not supported", "tools"),
            (bool(self.response_format) and self.response_format.get("type") not in (None, "text"),
             "response_format other than text is not supported", "response_format"),
            (self.top_logprobs is not None and not self.logprobs, "top_logprobs needs logprobs=true", "top_logprobs"),
            (self.max_tokens is not None and self.max_completion_tokens is not None,
             "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")]


def parse(model: type[BaseModel], data) -> BaseModel:
    """The request, or APIError(400) naming the first bad field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else None  # the top-level field (a union adds its branches' names)
        raise APIError(400, f"{field or 'body'}: {err['msg']}", field) from None


# ---- the chat template ----------------------------------------------------------------------------------------

def render_chat(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation (serve/detokenizer.render_chat: the tokenizer's chat template, or the plain
    one: "role: content" lines, then "assistant:"); APIError(400) naming `messages` for content other than text."""
    from serve.detokenizer import render_chat as render

    try:
        return render(tokenizer, [{"role": m.role, "content": m.content} for m in messages])
    except ValueError as exc:  # its one-line refusal of a part that is not text
        raise APIError(400, str(exc), "messages") from None


# ---- answers --------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Logprobs:
    """Each generated token's logprob and its top alternatives (a CompletionOutput's per-step dicts) in the shape
    each endpoint answers with; token strings are each id decoded alone."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top

    def _token(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def _top(self, step: dict[int, float]) -> list[tuple[int, float]]:
        """The step's top alternatives, best first (the chosen token is among them only if it ranks there)."""
        return sorted(step.items(), key=lambda kv: -kv[1])[:self.top]

    def completion(self, ids: list[int], steps: list[dict[int, float]], offset: int) -> dict:
        tokens = [self._token(t) for t in ids]
        offsets = list(accumulate((len(s) for s in tokens), initial=offset))[:-1]  # where each token's text starts
        return {"tokens": tokens, "token_logprobs": [step[t] for t, step in zip(ids, steps)],
                "top_logprobs": [{self._token(a): lp for a, lp in self._top(step)} for t, step in zip(ids, steps)],
                "text_offset": offsets}

    def echoed(self, prompt: list[int], scored: list[dict[int, float] | None], ids: list[int],
               steps: list[dict[int, float]]) -> dict:
        """A completion's logprobs with its prompt before it (echo): the prompt's tokens from the engine's
        prompt_logprobs (the first has none: null, as OpenAI and vLLM answer), then the generated ones."""
        head = self.completion(prompt[1:], scored[1:], len(self._token(prompt[0]))) if len(prompt) > 1 else \
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        tail = self.completion(ids, steps, sum(len(self._token(t)) for t in prompt))
        return {"tokens": [self._token(prompt[0])] + head["tokens"] + tail["tokens"],
                "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
                "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
                "text_offset": [0] + head["text_offset"] + tail["text_offset"]}

    def chat(self, ids: list[int], steps: list[dict[int, float]]) -> dict:
        def entry(t: int, lp: float) -> dict:
            s = self._token(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [dict(entry(t, step[t]), top_logprobs=[entry(a, lp) for a, lp in self._top(step)])
                            for t, step in zip(ids, steps)]}


def created() -> int:
    return int(time.time())
