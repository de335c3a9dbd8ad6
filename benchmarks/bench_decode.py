"""Batch-1 decode on a CPU: the weights in the layout their matmul reads fastest, weight-only int8 with decode's kernel
compiled, and llama.cpp beside LLM on the same weights.

    python benchmarks/bench_decode.py [--parts layout,peer,steps,perplexity] [--repeats 3]

The model: a random Llama (transformers' initialisation, seed 0), hidden 512, 8 layers, 8 heads and 8 K,V heads,
SwiGLU 1536, vocab 32000, float32, written once to outputs/bench_decode/llama in save_pretrained's layout and beside
it as GGUF, f32 and q8_0 (benchmarks/to_gguf.py). One thread everywhere: threads_per_rank=1, llama.cpp's n_threads=1.

  layout      the model's 33 matmul weights, each once (what a decode step reads), at 1, 2, 5, 8, 16, 64 and 256
              rows: PyTorch's matmul on out_in (nn.Linear's layout) and in_out (the same tensors stored
              column-major); the engine's float path (layers/parallel/weight_format.linear: the compiled fused
              kernel up to FUSED_ROWS rows, else out_in); int8 (the fused kernel up to its rows, chunks above) and
              int8 eager (chunks at every row count); min of --repeats x 3 passes each, the ratio to out_in, and
              the bytes read per second
  peer        greedy decode, 8 prompts of 32 random ids, 64 new tokens each: decode tokens/s one request at a time
              (the first token's step excluded) and the throughput of all 8 (LLM: at once; llama.cpp: one after
              another, its high-level API runs one sequence), for LLM float32 and int8 (the defaults: decode's fused
              kernels; enforce_eager: none; and enforce_eager with weight_layout out_in, the engine before this
              benchmark) and llama.cpp f32 and q8_0 (llama-cpp-python, the
              optional extra `pip install -e .[llamacpp]`; skipped when it is not installed); the ids of LLM float32
              against llama.cpp f32. Medians of --repeats rounds, the systems alternated within each.
  steps       one in-process engine (world of 1), decode steps of 5 requests against 1 (the rows of a speculative
              verify with k = 4 against a decode row), per weight format
  perplexity  models/stdlib's held-out perplexity (64 sequences of 256) with int8 weights against float32, at tp 1
              and 2 (a row-parallel weight's groups follow p); `make model` first
Writes outputs/bench_decode.json; report.py writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OUT, parse_args, print_table, refuse, table, write_json

MODEL = OUT / "bench_decode" / "llama"
SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
ROWS = (1, 2, 5, 8, 16, 64, 256)
PROMPTS, PROMPT_LEN, NEW = 8, 32, 64
PARTS = ("layout", "peer", "steps", "perplexity")
SYSTEMS = {  # name -> LLM settings, or ("llama.cpp", GGUF type)
    "LLM float32": dict(),
    "LLM float32, enforce_eager": dict(enforce_eager=True),
    "LLM float32, enforce_eager, out_in": dict(enforce_eager=True, weight_layout="out_in"),
    "LLM int8": dict(quantization="int8"),
    "LLM int8, enforce_eager": dict(quantization="int8", enforce_eager=True),
    "llama.cpp f32": ("llama.cpp", "f32"),
    "llama.cpp q8_0": ("llama.cpp", "q8_0"),
}

def make_model() -> Path:
    """The benchmark's Llama and its GGUF files, made once."""
    if not (MODEL / "model.safetensors").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, torch_dtype="float32"))
        model.save_pretrained(MODEL)
    try:
        from benchmarks.to_gguf import write

        for kind in ("f32", "q8_0"):
            if not (MODEL / f"{kind}.gguf").exists():
                write(MODEL, MODEL / f"{kind}.gguf", kind)
    except ImportError:  # no gguf package: the peer is skipped
        pass
    return MODEL


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, SHAPE["vocab_size"], (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]


# ---- layout: the matmuls alone -----------------------------------------------------------------------------------


def part_layout(args, out) -> None:
    import torch
    import torch.nn.functional as F

    from layers.parallel import weight_format as wf

    torch.set_num_threads(1)
    d, f, v, L = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"], SHAPE["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    shapes = [(3 * d, d), (d, d), (2 * f, d), (d, f)] * L + [(v, d)]  # qkv, o, gate|up, down per layer; the head
    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]
    formats = {"out_in": [(w, None) for w in weights], "in_out": [(w.t().contiguous().t(), None) for w in weights]}
    formats["fused"] = formats["out_in"]  # the engine's float path: the fused kernel up to its rows, else out_in
    formats["int8"] = [wf.quantize_rows(w) for w in weights]
    formats["int8 eager"] = formats["int8"]
    nbytes = {name: sum(w.numel() * w.element_size() + (0 if s is None else s.numel() * 4) for w, s in ws)
              for name, ws in formats.items()}
    rows_out = []
    for rows in ROWS:
        xs = {width: torch.randn(rows, width, generator=gen) for width in (d, f)}
        times = {}
        for name, ws in formats.items():
            fused = name in ("fused", "int8")
            engine_path = name in ("fused", "int8", "int8 eager")

            def one_pass():
                with torch.no_grad():
                    for w, s in ws:
                        wf.linear(xs[w.shape[1]], w, s, fused=fused) if engine_path else F.linear(xs[w.shape[1]], w)

            one_pass()
            samples = []
            for _ in range(3 * args.repeats):
                start = time.perf_counter()
                one_pass()
                samples.append(time.perf_counter() - start)
            times[name] = min(samples)
        row = {"rows": rows} | {f"{n} ms": t * 1e3 for n, t in times.items()} | \
            {f"{n} x": times["out_in"] / t for n, t in times.items()} | \
            {f"{n} GB/s": nbytes[n] / t / 1e9 for n, t in times.items()}
        rows_out.append(row)
        print(f"rows {rows}: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items()), file=sys.stderr)
    out["layout"] = {"rows": rows_out, "bytes": nbytes, "pytorch kernels, 1 row": pytorch_kernels(args, weights)}
    print_table(["rows"] + [f"{n}: ms (x out_in, GB/s)" for n in formats],
                [[r["rows"]] + [f"{r[f'{n} ms']:.2f} ({r[f'{n} x']:.2f}x, {r[f'{n} GB/s']:.1f})" for n in formats]
                 for r in rows_out])


def pytorch_kernels(args, weights) -> dict:
    """PyTorch's own CPU kernels for quantized weights at one row, over the same weights (ms per pass): int8 per
    output channel (aten._weight_int8pack_mm) and int4 in groups of 32 (aten._weight_int4pack_mm_for_cpu), beside
    float32 in_out. Why the engine does not use them."""
    import torch
    import torch.nn.functional as F

    from layers.parallel import weight_format as wf

    group = 32
    int8 = [wf.quantize_rows(w) for w in weights]
    int4 = []
    for w in weights:
        g = w.reshape(w.shape[0], -1, group)
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        codes = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(w.shape)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        int4.append((packed, torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()))
    in_out = [w.t().contiguous().t() for w in weights]
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    passes = {
        "float32 in_out": lambda: [F.linear(xs[w.shape[1]], w) for w in in_out],
        "aten._weight_int8pack_mm": lambda: [torch.ops.aten._weight_int8pack_mm(xs[c.shape[1]], c, s) for c, s in int8],
        "aten._weight_int4pack_mm_for_cpu": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(
            xs[w.shape[1]], p, group, sz) for w, (p, sz) in zip(weights, int4)]}
    times = {}
    for name, one_pass in passes.items():
        one_pass()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            one_pass()
            samples.append(time.perf_counter() - start)
        times[name] = min(samples) * 1e3
    print("PyTorch's own kernels at one row: " + ", ".join(f"{n} {t:.2f} ms" for n, t in times.items()) + "\n")
    return times


# ---- peer: whole decodes, LLM beside llama.cpp ---------------------------------------------------------------------


class LLMRun:
    def __init__(self, settings: dict):
        from serve import LLM

        self.llm = LLM(str(MODEL), threads_per_rank=1, **settings)

    def one(self, ids: list[list[int]]) -> tuple[list[list[int]], float, float]:
        """(ids, seconds of decode after each first token summed, wall seconds of the whole call)."""
        from serve.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params)
        wall = time.perf_counter() - start
        decode = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
        return [o.outputs[0].token_ids for o in outs], decode, wall

    def close(self):
        self.llm.shutdown()


class LlamaCppRun:
    def __init__(self, kind: str):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(str(MODEL / f"{kind}.gguf"), n_ctx=PROMPT_LEN + NEW + 8, n_threads=1,
                                   n_threads_batch=1, n_batch=PROMPT_LEN, verbose=False)

    def _argmax(self) -> int:
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def one(self, ids: list[list[int]]) -> tuple[list[list[int]], float, float]:
        got, decode, start = [], 0.0, time.perf_counter()
        for prompt in ids:  # one sequence at a time
            self.llm.reset()
            self.llm.eval(prompt)
            tokens = [self._argmax()]
            first = time.perf_counter()
            while len(tokens) < NEW:
                self.llm.eval([tokens[-1]])
                tokens.append(self._argmax())
            decode += time.perf_counter() - first
            got.append(tokens)
        return got, decode, time.perf_counter() - start

    def close(self):
        self.llm.close()


def part_peer(args, out) -> None:
    ids = prompts()
    runs = {}
    for name, settings in SYSTEMS.items():
        if isinstance(settings, tuple):
            try:
                runs[name] = LlamaCppRun(settings[1])
            except (ImportError, ValueError, OSError) as exc:
                print(f"{name}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        else:
            runs[name] = LLMRun(settings)
    samples = {name: {"batch1": [], "batch8": []} for name in runs}
    answers = {}
    try:
        for name, run in runs.items():  # warm-up: compiles, first-touch of the weights
            run.one(ids[:1])
        for rep in range(args.repeats):
            order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
            for name in order:
                run = runs[name]
                decode = 0.0
                for prompt in ids:  # one request at a time
                    got, seconds, _ = run.one([prompt])
                    decode += seconds
                    answers.setdefault(name, []).append(got[0])
                samples[name]["batch1"].append(PROMPTS * (NEW - 1) / decode)
                if isinstance(run, LLMRun):
                    _, _, wall = run.one(ids)
                    samples[name]["batch8"].append(PROMPTS * NEW / wall)
                else:  # one after another: its throughput is its one-at-a-time rate, prefill included
                    _, _, wall = run.one(ids)
                    samples[name]["batch8"].append(PROMPTS * NEW / wall)
                print(f"round {rep}: {name} {samples[name]['batch1'][-1]:.1f} tokens/s at batch 1, "
                      f"{samples[name]['batch8'][-1]:.1f} with 8", file=sys.stderr)
    finally:
        for run in runs.values():
            run.close()
    result = {name: {"batch1 tokens/s": statistics.median(s["batch1"]), "8 requests tokens/s":
                     statistics.median(s["batch8"]), "rounds": s} for name, s in samples.items()}
    same = None
    if "llama.cpp f32" in answers:
        ours, theirs = answers["LLM float32"][:PROMPTS], answers["llama.cpp f32"][:PROMPTS]
        same = sum(a == b for a, b in zip(ours, theirs))
        result["ids equal, LLM float32 vs llama.cpp f32"] = f"{same} of {PROMPTS}"
        result["where they differ"] = arbiter(ids, ours, theirs)
    if "llama.cpp q8_0" in answers:
        int8, q8 = answers["LLM int8"][:PROMPTS], answers["llama.cpp q8_0"][:PROMPTS]
        result["ids equal, LLM int8 vs llama.cpp q8_0"] = f"{sum(a == b for a, b in zip(int8, q8))} of {PROMPTS}"
    out["peer"] = result
    base = {"float32": result.get("llama.cpp f32"), "int8": result.get("llama.cpp q8_0")}
    rows = []
    for name, r in result.items():
        if not isinstance(r, dict):
            continue
        peer = base["int8" if "int8" in name or "q8" in name else "float32"]
        ratio = f"{r['batch1 tokens/s'] / peer['batch1 tokens/s']:.2f}x" if peer else ""
        rows.append([name, f"{r['batch1 tokens/s']:.1f}", ratio, f"{r['8 requests tokens/s']:.1f}"])
    print_table(["system", "batch-1 decode tokens/s", "vs llama.cpp (same precision)", "8 requests: tokens/s"],
                rows)
    if same is not None:
        print(f"greedy ids, LLM float32 = llama.cpp f32: {same} of {PROMPTS} requests\n")


def arbiter(ids, ours, theirs) -> list[dict]:
    """For each request whose ids differ: the first position they part, and the float64 dense model's (recomputed
    with no cache, from the same checkpoint) top-2 margin there, relative to the top logit: a near-tie, or not."""
    import torch

    from layers.models.hf import load_lm
    from layers.models.lm import dense_lm
    from serve.llm import resolve_model

    parted = [(i, next(k for k, (a, b) in enumerate(zip(x, y)) if a != b)) for i, (x, y) in enumerate(zip(ours, theirs))
              if x != y]
    if not parted:
        return []
    cfg, checkpoint = resolve_model(str(MODEL), 1, "tp")
    from layers.models.checkpoint import Checkpoint

    dense = load_lm(dense_lm(cfg, torch.float64), Checkpoint(checkpoint))
    rows = []
    with torch.no_grad():
        for i, k in parted:
            z = dense.logits(torch.tensor(ids[i] + ours[i][:k]))[-1]
            top = z.topk(2)
            rows.append({"request": i, "position": k, "float64 picks": int(top.indices[0]), "LLM": ours[i][k],
                         "llama.cpp": theirs[i][k], "margin / top logit": float((top.values[0] - top.values[1])
                                                                                / top.values[0].abs())})
    return rows


# ---- steps: the engine's decode step at 5 rows against 1 -----------------------------------------------------------


class matmuls_timed:
    """While open, the wall time of every matmul of the model (weight_format.linear, as the linears and the head
    call it) is appended to the list it yields."""

    def __enter__(self) -> list:
        import layers.parallel.linear as linear_module
        import layers.parallel.vocab as vocab_module

        self.modules, self.inner, spent = (linear_module, vocab_module), linear_module.linear, []

        def timed(*args, **kwargs):
            start = time.perf_counter()
            y = self.inner(*args, **kwargs)
            spent.append(time.perf_counter() - start)
            return y

        for module in self.modules:
            module.linear = timed
        return spent

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            module.linear = self.inner


def stepped(engine, spent: list | None = None) -> list:
    """Step engine through the one step loop (serve/offline.drive) until its requests are done; the time each step
    began and the loop ended (with `spent`: how many matmuls had been timed by then, instead)."""
    from serve.offline import drive

    marks = []

    def feed(engine) -> bool:
        marks.append(time.perf_counter() if spent is None else len(spent))
        return engine.has_unfinished_requests()

    drive(engine, feed, None)
    return marks


def part_steps(args, out) -> None:
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29581"))
    torch.set_num_threads(1)
    from serve.build import build_lm, prepare_weights, rank_weights
    from serve.config import EngineConfig
    from serve.engine import LLMEngine
    from serve.llm import resolve_model
    from serve.sampling_params import SamplingParams
    from tp.dist import init_from_env, shutdown

    ctx = init_from_env("gloo")
    cfg, checkpoint = resolve_model(str(MODEL), 1, "tp")
    rows = []
    try:
        for name, settings in {"float32": {}, "float32, enforce_eager": {"enforce_eager": True},
                               "float32, enforce_eager, out_in": {"enforce_eager": True, "weight_layout": "out_in"},
                               "int8": {"quantization": "int8"},
                               "int8, enforce_eager": {"quantization": "int8", "enforce_eager": True}}.items():
            config = EngineConfig(check_ledger=False, **settings)
            weights, _ = rank_weights(cfg, checkpoint, torch.float32, ctx.device, 0)
            engine = LLMEngine(prepare_weights(build_lm(weights, ctx), config), ctx, config)
            times = {}
            for batch in (1, 5, 1, 5):
                for i, prompt in enumerate(prompts()[:batch]):
                    engine.add_request(f"{batch}-{i}-{len(times)}", prompt,
                                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                marks = stepped(engine)  # the first step: the prefills
                times.setdefault(batch, []).extend(b - a for a, b in list(zip(marks, marks[1:]))[1:-1])
            with matmuls_timed() as spent:  # once more at one row: the time inside the matmuls (and the head's)
                engine.add_request("timed", prompts()[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                counts = stepped(engine, spent)
            decode_matmuls = sum(spent[counts[1]:]) / (len(counts) - 2)  # after the prefill's step
            t1, t5 = statistics.median(times[1]), statistics.median(times[5])
            rows.append({"weights": name, "1 row ms": t1 * 1e3, "5 rows ms": t5 * 1e3, "5 rows / 1": t5 / t1,
                         "1 row: matmuls ms": decode_matmuls * 1e3})
            engine.shutdown()
            del engine
    finally:
        shutdown()
    out["steps"] = rows
    print_table(["weights", "decode step, 1 row (ms)", "of which matmuls (ms)", "5 rows (ms)", "5 rows / 1 row"],
                [[r["weights"], f"{r['1 row ms']:.2f}", f"{r['1 row: matmuls ms']:.2f}", f"{r['5 rows ms']:.2f}",
                  f"{r['5 rows / 1']:.2f}"] for r in rows])


# ---- perplexity: what int8 costs on the trained model ---------------------------------------------------------------


def part_perplexity(args, out) -> None:
    from benchmarks.bench_eviction import held_out_sequences
    from serve import LLM
    from serve.sampling_params import SamplingParams

    model = "models/stdlib"
    seqs = held_out_sequences(model, 64)
    rows = []
    for p in (1, 2):
        for quantization in (None, "int8"):
            with LLM(model, p, quantization=quantization, max_num_seqs=32) as llm:
                outs = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                                         ignore_eos=True))
            nll = statistics.fmean(-o.prompt_logprobs[i][ids[i]] for ids, o in zip(seqs, outs)
                                   for i in range(1, len(ids)))
            rows.append({"tp": p, "weights": quantization or "float32", "perplexity": math.exp(nll)})
            print(f"tp {p} {quantization}: {math.exp(nll):.3f}", file=sys.stderr)
    out["perplexity"] = rows
    print_table(["tp", "weights", "held-out perplexity"],
                [[r["tp"], r["weights"], f"{r['perplexity']:.3f}"] for r in rows])


def section(data: dict | None) -> list[str]:
    """Its section of docs/benchmarks.md."""
    if not data:
        return []
    lines = ["## Batch-1 decode", "",
             "`.venv/bin/python benchmarks/bench_decode.py`: a random Llama (hidden 512, 8 layers, 8 heads, SwiGLU "
             "1536, vocab 32000, float32), one thread everywhere, greedy; llama.cpp (llama-cpp-python, `pip install "
             "-e .[llamacpp]`) on the same weights written as GGUF (benchmarks/to_gguf.py). The write-up: "
             "[decode.md](decode.md).", ""]
    if "layout" in data:
        names = ("out_in", "in_out", "fused", "int8", "int8 eager")
        lines += ["The model's matmuls alone (every weight once), ms per pass (x: against out_in):", ""]
        lines += table(["rows"] + list(names), [[r["rows"]] + [f"{r[f'{n} ms']:.2f} ({r[f'{n} x']:.2f}x)"
                                                              for n in names] for r in data["layout"]["rows"]])
        own = data["layout"].get("pytorch kernels, 1 row")
        if own:
            lines += ["", "PyTorch's own CPU kernels for quantized weights at one row, ms per pass: "
                      + ", ".join(f"{n} {t:.2f}" for n, t in own.items()) + "."]
        lines.append("")
    if "peer" in data:
        peer = data["peer"]
        rows = []
        for name, r in peer.items():
            if isinstance(r, dict):
                base = peer.get("llama.cpp q8_0" if ("int8" in name or "q8" in name) else "llama.cpp f32")
                ratio = f"{r['batch1 tokens/s'] / base['batch1 tokens/s']:.2f}x" if base else ""
                rows.append([name, f"{r['batch1 tokens/s']:.1f}", ratio, f"{r['8 requests tokens/s']:.1f}"])
        lines += ["Decode tokens/s one request at a time (8 requests x 64 tokens, the first token's step excluded); "
                  "the throughput of 8 requests (LLM: at once; llama.cpp: one after another, prefill included):", ""]
        lines += table(["system", "batch-1 decode tokens/s", "vs llama.cpp, same precision", "8 requests: tokens/s"],
                       rows)
        lines.append("")
        if "ids equal, LLM float32 vs llama.cpp f32" in peer:
            text = f"Greedy ids, LLM float32 = llama.cpp f32: {peer['ids equal, LLM float32 vs llama.cpp f32']}."
            for d in peer.get("where they differ", []):
                text += (f" Request {d['request']} parts at token {d['position']}: LLM picks {d['LLM']}, llama.cpp "
                         f"{d['llama.cpp']}, the float64 model {d['float64 picks']}, its top two logits "
                         f"{d['margin / top logit']:.1e} apart (relative to the top one).")
            q8 = peer.get("ids equal, LLM int8 vs llama.cpp q8_0")
            lines += [text + ("" if q8 is None else f" LLM int8 = llama.cpp q8_0: {q8} (two quantizations: ours per "
                                                    f"output channel, weights only; q8_0 per block of 32 values, the "
                                                    f"activations too)."), ""]
    if "steps" in data:
        lines += ["One engine in-process, a decode step at 1 row and at 5 (5 requests: the rows of a speculative "
                  "verify with k = 4), medians:", ""]
        lines += table(["weights", "decode step, 1 row (ms)", "of which matmuls (ms)", "5 rows (ms)",
                        "5 rows / 1 row"],
                       [[r["weights"], f"{r['1 row ms']:.2f}", f"{r['1 row: matmuls ms']:.2f}",
                         f"{r['5 rows ms']:.2f}", f"{r['5 rows / 1']:.2f}"] for r in data["steps"]])
        lines.append("")
    if "perplexity" in data:
        lines += ["models/stdlib's held-out perplexity (64 sequences of 256):", ""]
        lines += table(["tp", "weights", "perplexity"], [[r["tp"], r["weights"], f"{r['perplexity']:.3f}"]
                                                         for r in data["perplexity"]])
        lines.append("")
    return lines


def main(argv=None) -> int:
    args = parse_args(__doc__, {"--parts": ",".join(PARTS), "--repeats": 3, "--out": str(OUT / "bench_decode.json")},
                      argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        return refuse(f"--parts {args.parts!r}: name parts among {', '.join(PARTS)}")
    if "perplexity" in parts and not Path("models/stdlib/model.safetensors").exists():
        return refuse("--parts perplexity measures models/stdlib: run `make model` first")
    make_model()
    out = {"model": SHAPE, "prompts": PROMPTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW, "repeats": args.repeats}
    for part in PARTS:
        if part in parts:
            globals()[f"part_{part}"](args, out)
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
