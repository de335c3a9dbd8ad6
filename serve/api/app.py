"""The HTTP routes: OpenAI's completions, chat completions and models, plus /health and /metrics.

Each request becomes one engine request per prompt (ids `cmpl-<hex>-<i>`), whose events arrive in one asyncio
queue. A stream's response starts once every prompt has its first token (so a request refused or timed out in the
queue still gets a proper status), then sends one server-sent event per new piece of text. A client that goes
away, streaming or not, is noticed within a poll (POLL_S) or at the next send, and its requests are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.api.async_engine import run_sinks
from serve.api.metrics import CONTENT_TYPE
from serve.request import context_error
from serve.api.protocol import (APIError, ChatCompletionRequest, CompletionRequest, Logprobs, created, new_id, parse,
                                render_chat, usage)

POLL_S = 0.25  # while waiting for the engine: how often a handler asks whether its client is still there


def lifespan(engine):
    """At start-up: the engine thread hands each turn's events to this loop in one call."""
    @contextlib.asynccontextmanager
    async def run(app):
        loop = asyncio.get_running_loop()

        def deliver(batch) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(run_sinks, batch)
            except RuntimeError:  # the loop has closed (the server is stopping): nobody is listening
                pass
        engine.deliver = deliver
        yield
    return run


class Submission:
    """One HTTP request's engine requests and their events, (index, event), in arrival order."""

    def __init__(self, engine, base: str, prompts: list[tuple[str | None, list[int]]], params: list, priority: int = 0):
        self.engine, self.loop, self.queue = engine, asyncio.get_running_loop(), asyncio.Queue()
        self.ids = [f"{base}-{i}" for i in range(len(prompts))]
        self.open = set(range(len(prompts)))  # not yet finished: aborted if the client goes away
        self.asked = time.monotonic()  # when the client was last checked for
        for i, ((text, ids), q) in enumerate(zip(prompts, params)):
            engine.submit(self.ids[i], ids, text, q, self._sink(i), priority)

    def _sink(self, i: int):
        return lambda event: self.queue.put_nowait((i, event))  # run on the loop (engine.deliver)

    async def next(self, request: Request | None):
        """The next event, or None when the client has gone away (asked at least every POLL_S, also while events
        keep coming). request None: no polling (a streaming response notices a disconnect itself, and cancels the
        task that waits here)."""
        get = asyncio.ensure_future(self.queue.get())
        while request is not None and not get.done():
            if time.monotonic() - self.asked >= POLL_S:
                self.asked = time.monotonic()
                if await request.is_disconnected():
                    get.cancel()
                    return None
            await asyncio.wait({get}, timeout=POLL_S)
        i, event = await get
        if event[0] != "output" or event[1].finished:
            self.open.discard(i)
        return i, event

    def abort_open(self) -> None:
        for i in self.open:
            self.engine.abort(self.ids[i])
        self.open.clear()


def build_app(engine, *, model_name: str, tokenizer, max_model_len: int, max_positions: int, metrics) -> FastAPI:
    """max_positions: the most positions one request can hold (the context, or less where the KV pool is smaller)."""
    app = FastAPI(title="tpref OpenAI-compatible server", lifespan=lifespan(engine))

    def error(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def body_of(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(400, f"the model `{name}` does not exist; this server serves `{model_name}`", "model",
                           "model_not_found")
        if (refused := engine.refusal()) is not None:
            raise refused

    def encode(text: str, special: bool = True) -> list[int]:
        return tokenizer(text, add_special_tokens=special)["input_ids"]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: OpenAI's shape too
        return error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                              type_="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):  # a defect here, not the request's: still OpenAI's shape
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    @app.get("/health")
    async def health():
        refused = engine.refusal(look_at_ranks=True)  # a rank that died is seen here at once
        return {"status": "ok"} if refused is None else error(refused)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created(),
                                            "owned_by": "tpref", "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await body_of(request))
        req.refuse_unsupported()
        check_model(req.model)
        prompts = [(p, encode(p)) if isinstance(p, str) else (None, list(p)) for p in req.prompts()]
        most = 16 if req.max_tokens is None else max(req.max_tokens, 1)  # max_tokens 0 (echo): its token dropped
        scored = req.logprobs if req.echo else None  # echo with logprobs: the prompt's tokens scored too
        params = [req.sampling_params(most, req.logprobs, scored) for _ in prompts]
        echo = [(text if text is not None else tokenizer.decode(ids), ids) for text, ids in prompts] \
            if req.echo else None
        return await answer(request, "completion", req, prompts, params, req.logprobs, echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatCompletionRequest, await body_of(request))
        req.refuse_unsupported()
        check_model(req.model)
        text = render_chat(tokenizer, req.messages)
        ids = encode(text, special=False)  # a template writes its own special tokens
        most = req.max_completion_tokens or req.max_tokens or max(1, max_positions - len(ids) + 1)  # the rest
        top = (req.top_logprobs or 0) if req.logprobs else None
        return await answer(request, "chat", req, [(text, ids)], [req.sampling_params(most, top)], top)

    async def answer(request: Request, kind: str, req, prompts, params, top: int | None, echo=None):
        for (_, ids), q in zip(prompts, params):  # vLLM's server rule: prompt + max_tokens <= max_model_len
            if (error := context_error(len(ids), q.max_tokens, max_model_len)) is not None:
                raise as_asked(APIError(400, str(error), error.field), req)
        sub = Submission(engine, new_id("cmpl" if kind == "completion" else "chatcmpl"), prompts, params, req.priority)
        shape = Shape(kind, sub.ids[0].rsplit("-", 1)[0], model_name, tokenizer, top, params[0].stop,
                      req.return_token_ids, echo, getattr(req, "max_tokens", None) == 0)
        prompt_tokens = [len(ids) for _, ids in prompts]
        events: list = []  # until every prompt has ended (a whole answer) or has its first token (a stream)
        waiting = set(range(len(prompts)))
        try:
            while waiting:
                event = await sub.next(request)
                if event is None:
                    sub.abort_open()
                    return Response(status_code=499)  # the client is gone; nobody reads this
                i, (what, value) = event
                if what == "error":
                    raise as_asked(value, req)
                events.append(event)
                if req.stream or what == "abort" or value.finished:
                    waiting.discard(i)
        except BaseException:
            sub.abort_open()
            raise
        if not req.stream:
            finals = {i: value for i, (_, value) in events}  # each prompt's last event: its end
            return shape.full([finals[i] for i in range(len(prompts))], prompt_tokens)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(stream(sub, shape, events, prompt_tokens, include_usage),
                                 media_type="text/event-stream")

    async def stream(sub: Submission, shape: "Shape", started: list, prompt_tokens: list[int], include_usage: bool):
        sent = [Sent() for _ in prompt_tokens]
        try:
            if shape.kind == "chat":
                for i in range(len(prompt_tokens)):
                    yield shape.sse(shape.chunk(i, None, role=True))
            pending = list(started)
            while sub.open or pending:
                event = pending.pop(0) if pending else await sub.next(None)
                if event is None:
                    return
                i, (what, value) = event
                if what == "error":
                    yield shape.sse(value.body())
                    return
                piece = shape.piece(i, value, sent[i])
                if piece is not None:
                    yield shape.sse(piece)
            if include_usage:
                done = sum(s.tokens for s in sent)
                yield shape.sse(dict(shape.head(), choices=[], usage=usage(sum(prompt_tokens), done)))
            yield "data: [DONE]\n\n"
        finally:
            sub.abort_open()

    return app


def as_asked(error: APIError, req) -> APIError:
    """An engine error names SamplingParams' field: a chat request's max_tokens may be its max_completion_tokens."""
    if error.param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        error.param = "max_completion_tokens"
    return error


class Sent:
    """What a stream has sent of one choice: characters of text, tokens."""

    def __init__(self):
        self.chars = self.tokens = 0


class Shape:
    """The response objects of one endpoint (OpenAI's text_completion or chat.completion, full or as chunks)."""

    def __init__(self, kind: str, rid: str, model: str, tokenizer, top: int | None, stop: tuple[str, ...] = (),
                 token_ids: bool = False, echo: list[tuple[str, list[int]]] | None = None, drop: bool = False):
        """echo: each prompt's text and ids, put before its completion (a whole answer only); drop: max_tokens 0,
        the one token the engine generated is not answered."""
        self.kind, self.rid, self.model = kind, rid, model
        self.echo, self.drop = echo, drop
        self.logprobs = None if top is None else Logprobs(tokenizer, top)
        self.created = created()
        # a stream holds back the text's last characters that could still begin a stop string (a match cuts the
        # text before it, and what was sent cannot be taken back)
        self.hold = max((len(x) for x in stop), default=1) - 1
        self.token_ids = token_ids  # vLLM's return_token_ids: each choice and chunk also carries its token ids

    def head(self, chunk: bool = True) -> dict:
        obj = ("text_completion" if self.kind == "completion" else
               "chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def _logprobs(self, c, start: int, offset: int):
        if self.logprobs is None or c is None or c.logprobs is None:
            return None
        ids, steps = c.token_ids[start:], c.logprobs[start:len(c.token_ids)]
        return (self.logprobs.completion(ids, steps, offset) if self.kind == "completion" else
                self.logprobs.chat(ids, steps))

    def _echoed(self, i: int, value, c) -> tuple[str, dict | None, str]:
        """A completion with its prompt before it: (text, logprobs, finish reason); max_tokens 0 drops what the
        engine generated (finish reason "length")."""
        prompt_text, ids = self.echo[i]
        gen_ids, gen_text = ([], "") if self.drop else (c.token_ids, c.text)
        logprobs = None if self.logprobs is None else self.logprobs.echoed(
            ids, value.prompt_logprobs, gen_ids, (c.logprobs or [])[:len(gen_ids)])
        return prompt_text + gen_text, logprobs, "length" if self.drop else c.finish_reason

    def choice(self, i: int, text: str, reason, logprobs, chat: dict) -> dict:
        """One choice: a completion's text, or a chat's `chat` (a chunk's delta, a whole answer's message)."""
        return {"index": i, **({"text": text} if self.kind == "completion" else chat), "logprobs": logprobs,
                "finish_reason": reason}

    def chunk(self, i: int, c, *, role: bool = False, text: str = "", reason=None, logprobs=None) -> dict:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return dict(self.head(), choices=[self.choice(i, text, reason, logprobs, {"delta": delta})])

    def piece(self, i: int, value, sent: Sent) -> dict | None:
        """The chunk for what is new in a choice since the last one sent (None: nothing new to say)."""
        if value is None:  # aborted by the server's shutdown
            return self.chunk(i, None, reason="abort")
        c = value.outputs[0]
        end = len(c.text) if value.finished else max(sent.chars, len(c.text) - self.hold)
        text, ids = c.text[sent.chars:end], c.token_ids[sent.tokens:]
        if not text and not value.finished and not (self.token_ids and ids):
            return None  # tokens whose text is held back (half a character, or maybe a stop string)
        logprobs = self._logprobs(c, sent.tokens, sent.chars)
        sent.chars, sent.tokens = end, len(c.token_ids)
        out = self.chunk(i, c, text=text, reason=c.finish_reason if value.finished else None, logprobs=logprobs)
        if self.token_ids:
            out["choices"][0]["token_ids"] = ids
        return out

    def full(self, finals: list, prompt_tokens: list[int]) -> dict:
        choices, done = [], 0
        for i, value in enumerate(finals):
            c = None if value is None else value.outputs[0]
            text, reason = ("", "abort") if c is None else (c.text, c.finish_reason)
            logprobs = self._logprobs(c, 0, 0)
            if c is not None and self.echo is not None:
                text, logprobs, reason = self._echoed(i, value, c)
            done += 0 if c is None else 0 if self.drop else len(c.token_ids)
            choices.append(self.choice(i, text, reason, logprobs,
                                       {"message": {"role": "assistant", "content": text}}))
            if self.token_ids:
                choices[-1]["token_ids"] = [] if c is None else list(c.token_ids)
        return dict(self.head(chunk=False), choices=choices, usage=usage(sum(prompt_tokens), done))
