"""One prepared check for a GPU node: `make gpu-check` (or python launch/gpu_check.py).

It adapts to the GPUs it finds and writes one summary, outputs/gpu_check/summary.md:

    every valid p <= GPUs    run_block on NCCL, float32 and bfloat16, profiler traces on (CUDA activity), every
                             default variant: v1, v2, intra_head and v2sp (NCCL's reduce-scatter and row gathers)
    one GPU only             p = 2, 4, 8 ranks sharing it over gloo with CUDA tensors (device=cuda), bfloat16:
                             device placement, CUDA sync in the ledger, CUDA traces, bf16 kernels
    the largest p            serve on NCCL (v2, float32, checked against the dense oracle)
    Llama (llama_tiny)       run_block (v2, v2sp) and serve on NCCL at the largest p; one GPU: 4 ranks sharing it (gloo+cuda);
                             serve in bfloat16 on NCCL (tokens against the dense oracle, near-ties allowed)
    MoE (mixtral_tiny)       run_block with tp, ep and ep_a2a (NCCL's all_to_all_single with split sizes) and serve
                             with moe_parallel=ep, on NCCL at the largest p
    MLA (deepseek_tiny)      serve with ep in bfloat16: the latent pool, absorbed decode, decompressed prefill on CUDA
    a sharded checkpoint     a bfloat16 Llama saved by save_pretrained(max_shard_size=...), served on NCCL at the
                             largest p with each rank reading only its slices straight onto its GPU
    P/D (at least 2 GPUs)    serve with prefill and decode groups of half the GPUs each, on NCCL (pair
                             communicators warmed up, K,V streamed layer by layer); skipped with the reason on one
    host waits               launch/sync_check.py at the largest p: GPT-2, Llama, Mixtral (tp, ep) serving steps
                             under CUDA's sync debugger after a warm-up: one wait per step, plus one per MoE layer
    tests marked nccl        pytest -m nccl with the rank pools on NCCL (TPREF_TEST_BACKEND=nccl)
    bench_tp                 v2 vs DTensor at the valid p, 40 and 1024 tokens, 3 repeats

Without a GPU it says so, writes the summary as skipped, and exits 0. Each step has a time limit;
a failing step is recorded with the end of its output and the others still run. Exit code 1
when any step failed.
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
    torchrun = [py, "-m", "torch.distributed.run", "--standalone"]
    valid = [p for p in (1, 2, 4, 8) if p <= n_gpus]
    out = []
    for p in valid:
        for dtype in ("float32", "bfloat16"):
            out.append((f"run_block nccl p={p} {dtype}",
                        torchrun + [f"--nproc_per_node={p}", "launch/run_block.py", "backend=nccl", f"dtype={dtype}",
                                    "profile=true", "repeats=3", f"hydra.run.dir={OUT}/run_block_nccl_p{p}_{dtype}"],
                        {}, 300))
    if n_gpus == 1:
        for p in (2, 4, 8):
            out.append((f"run_block gloo+cuda p={p} bfloat16 (ranks share one GPU)",
                        torchrun + [f"--nproc_per_node={p}", "launch/run_block.py", "backend=gloo", "device=cuda",
                                    "dtype=bfloat16", "profile=true", "repeats=3",
                                    f"hydra.run.dir={OUT}/run_block_gloo_cuda_p{p}"], {}, 300))
    out.append((f"serve nccl p={valid[-1]}",
                torchrun + [f"--nproc_per_node={valid[-1]}", "launch/serve.py", "backend=nccl",
                            f"hydra.run.dir={OUT}/serve_nccl_p{valid[-1]}"], {}, 300))
    if n_gpus == 1:  # Llama blocks (GQA, RoPE) on CUDA tensors: 4 ranks sharing the GPU, K,V heads replicated
        out.append(("run_block llama_tiny p=4 bfloat16, ranks sharing one GPU (gloo, CUDA tensors)",
                    torchrun + ["--nproc_per_node=4", "launch/run_block.py", "model=llama_tiny", "backend=gloo",
                                "device=cuda", "dtype=bfloat16", "repeats=3", f"hydra.run.dir={OUT}/llama_gloo_cuda"],
                    {}, 300))
    out.append((f"run_block llama_tiny nccl p={valid[-1]}",
                torchrun + [f"--nproc_per_node={valid[-1]}", "launch/run_block.py", "model=llama_tiny", "backend=nccl",
                            "repeats=3", f"hydra.run.dir={OUT}/llama_nccl_p{valid[-1]}"], {}, 300))
    out.append((f"serve llama_tiny nccl p={valid[-1]}",
                torchrun + [f"--nproc_per_node={valid[-1]}", "launch/serve.py", "model=llama_tiny", "backend=nccl",
                            f"hydra.run.dir={OUT}/serve_llama_nccl_p{valid[-1]}"], {}, 300))
    out.append((f"serve llama_tiny nccl p={valid[-1]} bfloat16",
                torchrun + [f"--nproc_per_node={valid[-1]}", "launch/serve.py", "model=llama_tiny", "backend=nccl",
                            "dtype=bfloat16", f"hydra.run.dir={OUT}/serve_llama_nccl_bf16_p{valid[-1]}"], {}, 300))
    p = valid[-1]
    out.append((f"run_block mixtral_tiny nccl p={p}",
                torchrun + [f"--nproc_per_node={p}", "launch/run_block.py", "model=mixtral_tiny", "backend=nccl",
                            "repeats=3", f"hydra.run.dir={OUT}/moe_nccl_p{p}"], {}, 300))
    out.append((f"serve mixtral_tiny nccl p={p} moe_parallel=ep",
                torchrun + [f"--nproc_per_node={p}", "launch/serve.py", "model=mixtral_tiny", "moe_parallel=ep",
                            "backend=nccl", f"hydra.run.dir={OUT}/serve_moe_nccl_p{p}"], {}, 300))
    q = max(k for k in (1, 2, 4) if k <= p)  # deepseek_tiny has 4 query heads
    out.append((f"serve deepseek_tiny nccl p={q} moe_parallel=ep bfloat16",
                torchrun + [f"--nproc_per_node={q}", "launch/serve.py", "model=deepseek_tiny", "moe_parallel=ep",
                            "backend=nccl", "dtype=bfloat16", f"hydra.run.dir={OUT}/serve_deepseek_nccl_p{q}"], {}, 300))
    ckpt = OUT / "llama_sharded_bf16"
    out.append(("save a sharded bfloat16 Llama checkpoint",
                [py, "-c", "import sys, torch, transformers; torch.manual_seed(0); transformers.LlamaForCausalLM("
                 "transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8, "
                 "num_key_value_heads=2, num_hidden_layers=4, vocab_size=32000)).to(torch.bfloat16)"
                 ".save_pretrained(sys.argv[1], max_shard_size='4MB')", str(ckpt)], {}, 300))
    out.append((f"serve hf_checkpoint (sharded, per-rank slices) nccl p={p} bfloat16",
                torchrun + [f"--nproc_per_node={p}", "launch/serve.py", f"hf_checkpoint={ckpt}", "backend=nccl",
                            "dtype=bfloat16", f"hydra.run.dir={OUT}/serve_ckpt_nccl_p{p}"], {}, 300))
    if n_gpus >= 2:  # prefill/decode disaggregation: two NCCL groups, point-to-point K,V between them
        half = min(n_gpus, 8) // 2
        out.append((f"serve pd nccl {half}+{half}",
                    torchrun + [f"--nproc_per_node={2 * half}", "launch/serve.py", "backend=nccl",
                                f"pd.prefill_ranks={half}", f"pd.decode_ranks={half}",
                                f"hydra.run.dir={OUT}/serve_pd_nccl_{half}x2"], {}, 300))
    out.append((f"sync_check nccl p={p}: each serving step's waits under torch.cuda.set_sync_debug_mode",
                torchrun + [f"--nproc_per_node={p}", "launch/sync_check.py"], {}, 300))
    out.append(("pytest -m nccl", [py, "-m", "pytest", "-q", "-m", "nccl", "-p", "no:cacheprovider"],
                {"TPREF_TEST_BACKEND": "nccl"}, 600))
    out.append(("bench_tp", [py, "benchmarks/bench_tp.py", "--p", *map(str, valid), "--repeats", "3",
                             "--out", str(OUT / "bench_tp.json")], {}, 600))
    return out


def skipped(n_gpus: int) -> list[tuple[str, str]]:
    """(step, why it does not run on this node)."""
    if 0 < n_gpus < 2:
        return [("serve pd nccl", f"prefill/decode needs at least 2 GPUs (one per rank under NCCL); {n_gpus} visible")]
    return []


def run_step(name: str, argv: list[str], env: dict, limit: float) -> dict:
    start = time.monotonic()
    # A session of its own, so that a step past its limit is stopped with every rank it started
    # (torchrun tears its workers down on SIGTERM; whatever is left gets SIGKILL).
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        rc = "timeout"
    output = output or ""
    keep = [line for line in output.splitlines()
            if line.startswith(("PASS", "FAIL", "all ", "check", "traffic", "v2/v1", "generated", "[rank"))
            or " passed" in line or " failed" in line or "Error" in line]
    return {"name": name, "ok": rc == 0, "rc": rc, "seconds": time.monotonic() - start,
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
              f"(a CPU build?); install a CUDA build of torch (make clean && make setup) and run again", file=sys.stderr)
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
