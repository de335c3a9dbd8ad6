"""An OpenAI-compatible HTTP server on the TP engine (FastAPI + uvicorn):

    python -m serve.api --model DIR --tensor-parallel-size 2 --host 127.0.0.1 --port 8000

    POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with stream=true),
    GET /v1/models, GET /health, GET /metrics (Prometheus text)

One process holds the HTTP side and drives the engine's rank 0 over a pipe, as `LLM` does; the other ranks run as in
the library. Requests from every client are batched continuously: each joins the running batch at the next step.

    __main__.py        the command line: flags, ranks, uvicorn, SIGTERM/SIGINT, exit codes
    app.py             the routes: requests in, responses and server-sent events out, disconnects noticed
    async_engine.py    the one thread that steps the engine; queue timeouts, aborts, failure and shutdown
    protocol.py        OpenAI's request and response shapes, its error object, the chat template
    metrics.py         /metrics: queues, KV blocks, prefix-cache hit rate, preemptions, TTFT/TPOT, tokens/s, bytes
"""
