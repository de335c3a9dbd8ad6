"""python -m serve.api --model DIR --tensor-parallel-size N --host 127.0.0.1 --port 8000 [engine flags]

Starts the ranks (as `LLM` does), then serves OpenAI's API on host:port until SIGTERM or SIGINT: taking no new
requests, it lets those in flight finish for --shutdown-timeout seconds, aborts the rest, stops the ranks and exits 0.
A second signal aborts what runs at the engine's next step and exits as soon as the ranks are stopped. Each signal,
and the exit, prints a line on stderr.
If a rank fails, in-flight requests get an error, new ones a 503, and the process exits 1 with no rank left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from serve.config import FlagParser, add_engine_flags, add_llm_flags, engine_from_flags, llm_settings

IMPORTED = time.perf_counter()
FAILED_LINGER_S = 1.0  # after a rank failed: how long new requests still get their 503 before the server exits
STOP_WAIT_S = 2.0  # after a second signal: how long the engine's step in flight may delay the cut of connections
STOP_LINGER_S = 0.25  # ... and how long after the ranks stopped an answer may take to end before it is cut


def parser() -> argparse.ArgumentParser:
    ap = FlagParser(prog="python -m serve.api", description="An OpenAI-compatible server on the TP engine.")
    add_llm_flags(ap, "a save_pretrained directory with tokenizer files")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port (printed when ready)")
    ap.add_argument("--served-model-name", help="the name requests give as `model` (default: --model as given)")
    ap.add_argument("--seed", type=int, default=0, help="seeds requests that give none (reproducible per server run)")
    ap.add_argument("--queue-timeout", type=float, default=300.0,
                    help="seconds a request may wait for its first token before it is answered 503")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they are aborted")
    ap.add_argument("--iteration-log", help="write one JSON line per engine step here (who got tokens, who joined)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's: info shows every request")
    add_engine_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sock = None
    try:
        config = engine_from_flags(args)
        for name in ("queue_timeout", "shutdown_timeout"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive number of seconds")
        sock = bind(args.host, args.port)  # before the ranks start: a port in use fails fast
        from layers.models.hf import resolve_dtype
        from serve.llm import has_tokenizer

        if args.tokenizer is None and not os.path.isdir(args.model):
            raise ValueError(f"--model {args.model}: not a directory (the server takes and returns text: it needs "
                             f"a save_pretrained directory with tokenizer files, or --tokenizer DIR)")
        if not has_tokenizer(args.model, args.tokenizer):
            raise ValueError(f"{args.tokenizer or args.model} has no tokenizer files; the server takes and returns "
                             f"text: pass --tokenizer DIR")
        dtype = str(resolve_dtype(args.dtype, args.model)[0]).removeprefix("torch.")  # a ConfigError is a ValueError
        import uvicorn

        from serve import LLM
        from serve.api.app import build_app
        from serve.api.async_engine import AsyncEngine
        from serve.api.metrics import ServerMetrics

        start = time.perf_counter()
        llm = LLM(args.model, seed=args.seed, **(llm_settings(args, config) | {"dtype": dtype}))
    except ValueError as exc:
        if sock is not None:
            sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ranks_ready = time.perf_counter()
    name = args.served_model_name or args.model
    metrics = ServerMetrics()
    server: uvicorn.Server | None = None

    def failed() -> None:  # new requests get 503 for a moment (the engine refuses them), then the server exits
        if server is not None:
            threading.Timer(FAILED_LINGER_S, lambda: setattr(server, "should_exit", True)).start()

    engine = AsyncEngine(llm, queue_timeout_s=args.queue_timeout, iteration_log=args.iteration_log, metrics=metrics,
                         on_failure=failed)
    metrics.engine = engine
    context = llm.model_config.max_seq_len  # positions one request may cache: prompt + output - 1 at most
    limit = (config.max_model_len or context) - 1  # vLLM's rule: prompt + output <= max_model_len (or the context)
    app = build_app(engine, model_name=name, tokenizer=llm.tokenizer, max_model_len=llm.max_model_len,
                    max_positions=min(limit, llm.num_blocks * llm.config.block_size), metrics=metrics)
    grace = args.shutdown_timeout

    class Server(uvicorn.Server):
        """The first SIGTERM / SIGINT drains (503 to new requests, the grace period for those in flight), a second
        stops now (what runs is aborted at the engine's next step), a third is uvicorn's own exit (docs/server.md)."""

        first: float | None = None  # when the first signal came
        last: tuple[str, float] | None = None  # the last signal handled here, and when

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit or engine.failed is not None:  # stopping already (a third signal, or a failure)
                super().handle_exit(sig, frame)
                return
            self.last = (signal.Signals(sig).name, time.monotonic())
            n = engine.live
            if self.first is None:
                self.first = self.last[1]
                say(f"shutting down: draining {requests(n)} for up to {grace:g} s (Ctrl-C again to stop now)" if n
                    else "shutting down: no request in flight")
                engine.drain(grace)
                threading.Thread(target=self._exit_when_drained, daemon=True).start()
                return
            say(f"stopping now: aborting {requests(n)}" if n else "stopping now")
            engine.drain(0)
            super().handle_exit(sig, frame)  # should_exit: stop listening, close each connection as its answer ends
            threading.Thread(target=self._cut_when_stopped, daemon=True).start()

        def _exit_when_drained(self) -> None:
            engine.done.wait(grace + 15)
            self.should_exit = True

        def _cut_when_stopped(self) -> None:
            engine.done.wait(STOP_WAIT_S)
            time.sleep(STOP_LINGER_S)
            self.force_exit = True  # uvicorn stops waiting for the connections still open

    server = Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=grace + 2,
                                   timeout_keep_alive=5))
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn restores these and re-sends the signal it caught when it
        signal.signal(sig, lambda *_: None)      # returns: ignored then, so the ranks are stopped below and we exit 0
    engine.start()
    host, port = sock.getsockname()[:2]
    print(f"serving {name} on http://{host}:{port}/v1 ({llm.settings_summary()}; ready in {since_start():.1f} s, "
          f"the ranks' start {ranks_ready - start:.1f} s of it)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.drain(0)
        engine.done.wait(grace + 15)  # the ranks stop within LLM.shutdown's own 10 s
    if engine.failed is not None:
        print(f"error: the engine failed: {engine.detail}", file=sys.stderr)
        return 1
    if server.first is not None:
        signame, last = server.last
        now = time.monotonic()
        line = f"stopped {now - server.first:.2f} s after {signame}"
        if last > server.first:
            line += f", {now - last:.2f} s after the second"
        counts = [f"{n} {what}" for n, what in ((engine.drained, "finished"), (engine.cut, "aborted")) if n]
        print(line + (f" (requests: {', '.join(counts)})" if counts else ""), file=sys.stderr, flush=True)
    return 0


def say(line: str) -> None:
    """A line on stderr from a signal handler (os.write: no buffered stream to re-enter)."""
    os.write(2, (line + "\n").encode())


def requests(n: int) -> str:
    return f"{n} request{'s' * (n != 1)}"


def since_start() -> float:
    """Seconds since this process started (Linux's /proc: the interpreter's own start-up and every import count),
    else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections made once "serving" is printed wait here until uvicorn accepts them
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


if __name__ == "__main__":
    code = main()
    # The ranks are stopped and the socket closed: leave without the interpreter's teardown of torch and
    # transformers (about a second on a laptop), so an idle server exits within a fraction of one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
