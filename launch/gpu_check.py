"""One prepared check for a GPU node: `make gpu-check` (or python launch/gpu_check.py).

It adapts to the GPUs it finds (steps(); docs/gpus.md says what each shows): run_block and serve on NCCL at every
valid p (GPT-2, Llama in float32 and bfloat16, Mixtral, DeepSeek-V3, a sharded checkpoint, P/D with 2 GPUs or more),
ranks sharing one GPU over gloo with CUDA tensors, the serving steps' host waits (launch/sync_check.py), the tests
marked nccl, and bench_tp. Each step has a time limit; a failing step is recorded with the end of its output and the
others still run. One summary: outputs/gpu_check/summary.md. Without a GPU it says so, writes the summary as
skipped, and exits 0. Exit code 1 when any step failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "outputs" / "gpu_check"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def steps(n_gpus: int) -> list[tuple[str, list[str], dict, float]]:
    """(name, argv, extra environment, time limit in seconds)."""
    py = sys.executable
    valid = [p for p in (1, 2, 4, 8) if p <= n_gpus]
    p = valid[-1]
    q = max(k for k in (1, 2, 4) if k <= p)  # deepseek_tiny has 4 query heads
    ckpt = OUT / "llama_sharded_bf16"

    def launcher(name: str, ranks: int, script: str, *settings: str, run_dir: str | None = None) -> tuple:
        """launch/<script> under torchrun on `ranks` ranks, its Hydra run directory under OUT."""
        argv = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", f"launch/{script}",
                *settings] + ([f"hydra.run.dir={OUT}/{run_dir}"] if run_dir else [])
        return name, argv, {}, 300

    out = [launcher(f"run_block nccl p={k} {dtype}", k, "run_block.py", "backend=nccl", f"dtype={dtype}",
                    "profile=true", "repeats=3", run_dir=f"run_block_nccl_p{k}_{dtype}")
           for k in valid for dtype in ("float32", "bfloat16")]
    if n_gpus == 1:
        out += [launcher(f"run_block gloo+cuda p={k} bfloat16 (ranks share one GPU)", k, "run_block.py",
                         "backend=gloo", "device=cuda", "dtype=bfloat16", "profile=true", "repeats=3",
                         run_dir=f"run_block_gloo_cuda_p{k}") for k in (2, 4, 8)]
    out.append(launcher(f"serve nccl p={p}", p, "serve.py", "backend=nccl", run_dir=f"serve_nccl_p{p}"))
    if n_gpus == 1:  # Llama blocks (GQA, RoPE) on CUDA tensors: 4 ranks sharing the GPU, K,V heads replicated
        out.append(launcher("run_block llama_tiny p=4 bfloat16, ranks sharing one GPU (gloo, CUDA tensors)", 4,
                            "run_block.py", "model=llama_tiny", "backend=gloo", "device=cuda", "dtype=bfloat16",
                            "repeats=3", run_dir="llama_gloo_cuda"))
    out += [
        launcher(f"run_block llama_tiny nccl p={p}", p, "run_block.py", "model=llama_tiny", "backend=nccl",
                 "repeats=3", run_dir=f"llama_nccl_p{p}"),
        launcher(f"serve llama_tiny nccl p={p}", p, "serve.py", "model=llama_tiny", "backend=nccl",
                 run_dir=f"serve_llama_nccl_p{p}"),
        launcher(f"serve llama_tiny nccl p={p} bfloat16", p, "serve.py", "model=llama_tiny", "backend=nccl",
                 "dtype=bfloat16", run_dir=f"serve_llama_nccl_bf16_p{p}"),
        launcher(f"run_block mixtral_tiny nccl p={p}", p, "run_block.py", "model=mixtral_tiny", "backend=nccl",
                 "repeats=3", run_dir=f"moe_nccl_p{p}"),
        launcher(f"serve mixtral_tiny nccl p={p} moe_parallel=ep", p, "serve.py", "model=mixtral_tiny",
                 "moe_parallel=ep", "backend=nccl", run_dir=f"serve_moe_nccl_p{p}"),
        launcher(f"serve deepseek_tiny nccl p={q} moe_parallel=ep bfloat16", q, "serve.py", "model=deepseek_tiny",
                 "moe_parallel=ep", "backend=nccl", "dtype=bfloat16", run_dir=f"serve_deepseek_nccl_p{q}"),
        ("save a sharded bfloat16 Llama checkpoint",
         [py, "-c", "import sys, torch, transformers; torch.manual_seed(0); transformers.LlamaForCausalLM("
          "transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8, "
          "num_key_value_heads=2, num_hidden_layers=4, vocab_size=32000)).to(torch.bfloat16)"
          ".save_pretrained(sys.argv[1], max_shard_size='4MB')", str(ckpt)], {}, 300),
        launcher(f"serve hf_checkpoint (sharded, per-rank slices) nccl p={p} bfloat16", p, "serve.py",
                 f"hf_checkpoint={ckpt}", "backend=nccl", "dtype=bfloat16", run_dir=f"serve_ckpt_nccl_p{p}"),
    ]
    if n_gpus >= 2:  # prefill/decode disaggregation: two NCCL groups, point-to-point K,V between them
        half = min(n_gpus, 8) // 2
        out.append(launcher(f"serve pd nccl {half}+{half}", 2 * half, "serve.py", "backend=nccl",
                            f"pd.prefill_ranks={half}", f"pd.decode_ranks={half}", run_dir=f"serve_pd_nccl_{half}x2"))
    return out + [
        launcher(f"sync_check nccl p={p}: each serving step's waits under torch.cuda.set_sync_debug_mode", p,
                 "sync_check.py"),
        ("pytest -m nccl", [py, "-m", "pytest", "-q", "-m", "nccl", "-p", "no:cacheprovider"],
         {"TPREF_TEST_BACKEND": "nccl"}, 600),
        ("bench_tp", [py, "benchmarks/bench_tp.py", "--p", *map(str, valid), "--repeats", "3",
                      "--out", str(OUT / "bench_tp.json")], {}, 600),
    ]


def skipped(n_gpus: int) -> list[tuple[str, str]]:
    """(step, why it does not run on this node)."""
    if 0 < n_gpus < 2:
        return [("serve pd nccl", f"prefill/decode needs at least 2 GPUs (one per rank under NCCL); {n_gpus} visible")]
    return []


def bounded(argv: list[str], limit: float, env: dict | None = None,
            stderr=subprocess.STDOUT) -> tuple[int | None, str, str]:
    """argv from the repository root in a session of its own, so that past `limit` seconds it is stopped with every
    process it started (torchrun tears its workers down on SIGTERM; whatever is left gets SIGKILL). Returns the exit
    code (None past the limit), stdout and stderr ("" when merged into stdout)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
        return proc.returncode, out, err or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        return None, out or "", err or ""


def run_step(name: str, argv: list[str], env: dict, limit: float) -> dict:
    start = time.monotonic()
    rc, output, _ = bounded(argv, limit, env)
    keep = [line for line in output.splitlines()
            if line.startswith(("PASS", "FAIL", "all ", "check", "traffic", "v2/v1", "generated", "[rank"))
            or " passed" in line or " failed" in line or "Error" in line]
    return {"name": name, "ok": rc == 0, "rc": "timeout" if rc is None else rc, "seconds": time.monotonic() - start,
            "lines": keep[-12:] if rc == 0 else output.splitlines()[-25:]}


def summary(n_gpus: int, results: list[dict]) -> str:
    import torch

    head = [f"# gpu-check: {n_gpus} CUDA device(s)", "",
            f"torch {torch.__version__}, CUDA {torch.version.cuda}",
            *(f"- cuda:{i}: {torch.cuda.get_device_name(i)}" for i in range(n_gpus)), ""]
    if not results:
        return "\n".join(head + ["skipped: no CUDA device visible; run `make gpu-check` on a GPU node", ""])
    body = []
    for r in results:
        body += [f"## {'PASS' if r['ok'] else 'FAIL'}: {r['name']} (rc {r['rc']}, {r['seconds']:.0f} s)", "", "```",
                 *r["lines"], "```", ""]
    for name, why in skipped(n_gpus):
        body += [f"## SKIP: {name}", "", why, ""]
    verdict = f"{sum(r['ok'] for r in results)}/{len(results)} steps passed"
    return "\n".join(head + [verdict, ""] + body)


def main() -> int:
    n = gpu_count()
    OUT.mkdir(parents=True, exist_ok=True)
    if n == 0 and (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
        import torch

        print(f"gpu-check: this machine has an NVIDIA driver but torch {torch.__version__} sees no CUDA device "
              f"(a CPU build?); install a CUDA build of torch (make clean && make setup) and run again",
              file=sys.stderr)
        return 1
    results = []
    if n == 0:
        print("gpu-check: no CUDA device visible, nothing to check here; skipping (run it on a GPU node)")
    for name, argv, env, limit in steps(n) if n else []:
        print(f"gpu-check: {name} ...", flush=True)
        results.append(run_step(name, argv, env, limit))
        print(f"gpu-check: {name}: {'PASS' if results[-1]['ok'] else 'FAIL'} ({results[-1]['seconds']:.0f} s)",
              flush=True)
    (OUT / "summary.md").write_text(summary(n, results))
    print(f"summary: {OUT / 'summary.md'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
