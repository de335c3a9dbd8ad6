"""The HTTP server under load, in the style of vLLM's benchmark_serving: Poisson arrivals at several request rates,
streamed completions, TTFT / TPOT percentiles; and the server's tokens/s against `LLM.generate` on the same workload.

    python benchmarks/bench_http.py [--p 1 2] [--rates 2 4 8 16 inf] [--requests 64] [--repeats 5]

A random GPT-2 (SHAPE, float32) saved with the BPE tokenizer the tests train; the workload (workload(), seed 0) is
sent as token ids, so lengths are exact, and every request makes its full length (ignore_eos).

  overhead   the --requests requests all at once through the server (rate inf) against LLM.generate in this
             process: both up at once (the idle one sleeps), their runs alternating, the ratio taken per pair
  per rate   the first 32 requests at Poisson arrivals (rate inf: all at once), each streamed by a client as light
             as benchmark_serving's (stream_completion); chunks carry their token ids (return_token_ids), so a
             token whose text is held back (half a character, common with random weights) still counts

Writes outputs/bench_http.json and docs/http_bench.png (TTFT and TPOT p50/p99 against the rate), and prints its
section of docs/benchmarks.md, which says how TTFT, TPOT and throughput are taken.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, parse_args, table, timed_generate, write_json

SHAPE = dict(n_embd=256, n_head=8, n_layer=4, n_positions=512)
TTFT_BOUND_S = 1.0  # the rate at which TTFT p99 first exceeds this is reported
RATE_REQUESTS = 32  # requests per rate (the overhead runs all --requests)


def make_checkpoint(path: Path) -> None:
    import torch
    import transformers

    from tests.common import train_tokenizer

    torch.manual_seed(0)
    tok = train_tokenizer(path)
    cfg = transformers.GPT2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                  **SHAPE)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(64)]
    out = []
    for i in range(n):
        length = rng.randint(16, 128)
        body = [rng.randrange(1, vocab) for _ in range(length)]
        prompt = (prefix + body)[:max(length, 65)] if i % 2 == 0 else body
        out.append((prompt, rng.randint(8, 48)))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


async def stream_completion(url: str, body: dict) -> tuple[list[float], int]:
    """POST a streamed completion over a plain HTTP/1.0 connection (the server closes it at the end, so the events
    are lines); the times of the events that carried new tokens (vLLM's return_token_ids: a chunk per step even
    while the text of a partial character is held back), and the tokens. A client this light (as vLLM's
    benchmark_serving is) leaves the cores to the server on a small machine."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (host.encode(), len(data)) + data)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{status!r}: {(await reader.read()).decode()}")
    times, tokens = [], 0
    async for line in reader:
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter()
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("token_ids"):
            times.append(now)
            tokens += len(event["choices"][0]["token_ids"])
    writer.close()
    return times, tokens


async def run_rate(url: str, model: str, work, rate: float, seed: int = 1) -> dict:
    rng = random.Random(seed)
    results = []

    async def one(prompt, new, delay):
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        times, tokens = await stream_completion(url, {
            "model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True})
        results.append({"sent": sent, "first": times[0], "last": times[-1], "tokens": tokens})

    delays, at = [], 0.0
    for _ in work:
        delays.append(at)
        if rate != math.inf:
            at += rng.expovariate(rate)
    start = time.perf_counter()
    await asyncio.gather(*(one(p, n, d) for (p, n), d in zip(work, delays)))
    end = max(r["last"] for r in results)
    ttft = [r["first"] - r["sent"] for r in results]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)
    row = {"rate": rate, "requests": len(results), "tokens": tokens, "time_s": end - start,
           "tokens_per_s": tokens / (end - start), "requests_per_s": len(results) / (end - start)}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_s"] = pct(xs, q)
    return row


class Server:
    def __init__(self, checkpoint: Path, p: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "serve.api", "--model", str(checkpoint),
                                      "--tensor-parallel-size", str(p), "--port", "0", "--served-model-name", "bench"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for line in self.proc.stdout:
            if line.startswith("serving "):
                self.url = line.split(" on ", 1)[1].split()[0]
                return
        raise RuntimeError(f"the server exited with {self.proc.wait()}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def bench(p: int, checkpoint: Path, rates: list[float], n: int, repeats: int, vocab: int) -> dict:
    """The overhead first: LLM and the server both up (each idle while the other runs), their runs alternated, the
    ratio taken per pair; then the rates, with the LLM shut down."""
    from serve import LLM, SamplingParams

    work = workload(n, vocab)
    rows, ratios = [], []
    server = Server(checkpoint, p)
    try:
        with LLM(str(checkpoint), tensor_parallel_size=p) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))  # warm
            asyncio.run(run_rate(server.url, "bench", work[:4], math.inf))  # warm
            for rep in range(repeats):
                ids, took = timed_generate(llm, [{"prompt_token_ids": pr} for pr, _ in work],
                                           [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
                                            for _, k in work])
                direct = sum(map(len, ids)) / took
                http = asyncio.run(run_rate(server.url, "bench", work, math.inf))["tokens_per_s"]
                ratios.append({"http_tokens_per_s": http, "generate_tokens_per_s": direct, "ratio": http / direct})
                print(f"p={p} pair {rep}: server {http:.1f} tok/s, LLM.generate {direct:.1f} tok/s, "
                      f"ratio {http / direct:.3f}", flush=True)
        for rate in rates:
            rows.append(asyncio.run(run_rate(server.url, "bench", work[:RATE_REQUESTS], rate)))
            r = rows[-1]
            print(f"p={p} rate {rate}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} "
                  f"p99 {r['ttft_p99_s']:.3f} s, TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms", flush=True)
    finally:
        server.close()
    over = [r["rate"] for r in rows if r["ttft_p99_s"] > TTFT_BOUND_S]
    return {"p": p, "rates": rows, "overhead": ratios, "ratio_median": statistics.median(r["ratio"] for r in ratios),
            "ttft_p99_exceeds_bound_at": min(over) if over else None}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in data["runs"]:
        rows = [r for r in run["rates"] if r["rate"] != math.inf]
        x = [r["rate"] for r in rows]
        for q, style in ((50, "-o"), (99, "--s")):
            a.plot(x, [r[f"ttft_p{q}_s"] for r in rows], style, label=f"p={run['p']} p{q}")
            b.plot(x, [r[f"tpot_p{q}_s"] * 1e3 for r in rows], style, label=f"p={run['p']} p{q}")
    a.axhline(TTFT_BOUND_S, color="grey", lw=0.8)
    a.set(xlabel="request rate (req/s, Poisson)", ylabel="TTFT (s)", yscale="log",
          title="time to first token")
    b.set(xlabel="request rate (req/s, Poisson)", ylabel="TPOT (ms)", title="time per output token")
    rates = sorted({r["rate"] for run in data["runs"] for r in run["rates"] if r["rate"] != math.inf})
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{v:g}" for v in rates])
        ax.minorticks_off()
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def exceeds(rate) -> str:
    if rate is None:
        return "at no rate measured"
    return "only with every request sent at once" if rate == math.inf else f"from {rate:g} req/s"


def section(data: dict | None) -> list[str]:
    """Its section of docs/benchmarks.md."""
    if not data:
        return []
    s = data["shape"]
    lines = ["## HTTP serving: request rate, TTFT and TPOT, the server's overhead", "",
             "`.venv/bin/python benchmarks/bench_http.py`: `.venv/bin/python -m serve.api` on a random GPT-2 "
             f"(d {s['n_embd']}, "
             f"{s['n_head']} heads, {s['n_layer']} layers, vocab {data['vocab']}, float32, engine defaults), "
             f"{data['rate_requests']} streamed completions per rate from a raw HTTP client (as light as vLLM's "
             f"benchmark_serving): prompts of 16-128 tokens (half share a 64-token prefix), 8-48 new tokens each, "
             f"greedy, Poisson arrivals. TTFT = send to the first token's chunk; "
             "TPOT = (last token's chunk - first's) / "
             f"(tokens - 1), chunks carrying their token ids (vLLM's `return_token_ids`). "
             f"Client, server and ranks share the machine's cores.", ""]
    lines += table(["p", "rate (req/s)", "tokens/s", "TTFT p50 / p90 / p99 (s)", "TPOT p50 / p90 / p99 (ms)"],
                   [[run["p"], f"{r['rate']:g}", f"{r['tokens_per_s']:.1f}",
                     " / ".join(f"{r[f'ttft_p{q}_s']:.3f}" for q in (50, 90, 99)),
                     " / ".join(f"{r[f'tpot_p{q}_s'] * 1e3:.1f}" for q in (50, 90, 99))]
                    for run in data["runs"] for r in run["rates"]])
    lines += ["", "![TTFT and TPOT against the request rate](http_bench.png)", "",
              f"TTFT p99 above {TTFT_BOUND_S:g} s: " + "; ".join(
                  f"p={run['p']} {exceeds(run['ttft_p99_exceeds_bound_at'])}" for run in data["runs"]) + ".", "",
              f"The server's overhead: {data['requests']} requests all at once through HTTP (streamed) against "
              f"`LLM.generate` in one process, both up at once and run in turn, the ratio per pair (target ≥ 0.9×):",
              ""]
    lines += table(["p", "server tokens/s", "LLM.generate tokens/s", "ratio (median of repeats)"],
                   [[run["p"], " / ".join(f"{r['http_tokens_per_s']:.1f}" for r in run["overhead"]),
                     " / ".join(f"{r['generate_tokens_per_s']:.1f}" for r in run["overhead"]),
                     f"{run['ratio_median']:.3f}"] for run in data["runs"]])
    lines += ["", "Per pair: server tokens/s, then LLM.generate's, in the order run."]
    return lines + [""]


def main() -> int:
    args = parse_args(__doc__, {"--p": [1, 2], "--rates": dict(type=float, nargs="+", default=[2, 4, 8, 16, math.inf]),
                                "--requests": 64, "--repeats": 5, "--out": str(ROOT / "outputs/bench_http.json"),
                                "--plot": str(ROOT / "docs/http_bench.png")})
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "gpt2"
        make_checkpoint(checkpoint)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        runs = [bench(p, checkpoint, args.rates, args.requests, args.repeats, vocab) for p in args.p]
    data = {"shape": SHAPE, "vocab": vocab, "requests": args.requests, "rate_requests": RATE_REQUESTS,
            "ttft_bound_s": TTFT_BOUND_S, "runs": runs}
    write_json(args.out, data)
    try:
        plot(data, Path(args.plot))
    except ImportError:
        print("matplotlib is not installed (pip install -e .[plot]): no figure", file=sys.stderr)
    print("\n".join(section(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
