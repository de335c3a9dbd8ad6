"""Activation memory per layer and rank: what autograd saves for backward in one block.

The bytes of every tensor a block's forward keeps for its backward (launch/memory.py measures them, each storage
once, parameters excluded), from the shapes alone, for one sequence of T rows on p ranks, e bytes per element
(e_s: the attention's log-sum-exp, kept in float32 at least), h heads, k = h·d_head, f = d_ffn:

    v2    e·(4·T·d + 4·T + 4·T·k/p + 2·T·f/p) + e_s·T·h/p
    v2sp  e·(2·T'·d/p + 2·T'·d + 4·T'/p + 4·T·k/p + 2·T·f/p + 6·d) + e_s·T·h/p        T' = p·⌈T/p⌉

term by term (v2 | v2sp):
    LayerNorm inputs, 2 of [T, d]          replicated: 2·T·d         this rank's rows: 2·T'·d/p
    their mean and 1/std, 2 + 2 of [T]     4·T                       4·T'/p       (in x's dtype on the CPU)
    LayerNorm outputs, inputs of qkv and   2·T·d                     2·T'·d (the gathered rows the column-parallel
      mlp_up (column-parallel)                                         matmuls read)
    q|k|v [T, 3k/p], attention out [T, k/p] (the out-projection's input is a view of it): 4·T·k/p
    log-sum-exp of the fused attention [h/p, T]: T·h/p, in float32 at least
    GeLU input and output [T, f/p]         2·T·f/p
    v2sp: the replicated parameters, concatenated for their gradient all-reduce: 2 of [3d]

Llama blocks: the same idea, their own terms (_llama_bytes).

So sequence parallelism removes the replicated LayerNorm inputs and statistics: 2·T·d·(1 − 1/p) + 4·T·(1 − 1/p)
elements per layer (Korthikanti et al.'s point). Megatron goes further: it keeps the LayerNorm outputs as row
shards too and all-gathers them again in backward (one more all-gather per column-parallel matmul), so that
only T·d/p of each is held; here the gathered rows are kept and backward issues no extra collective. Without
dropout this block has no masks (the paper's 2·T·d·(1/p)-byte and attention-mask terms).

The tensors saved are those of PyTorch's CPU kernels (native_layer_norm keeps its statistics in x's dtype, the
fused CPU attention its output and log-sum-exp); CUDA's kernels keep others, so run_block compares on the CPU only.
"""

from __future__ import annotations

import torch

from tp.partition import ModelShape, llama_block, padded


def activation_bytes_per_layer(cfg: ModelShape, p: int, n: int, dtype: torch.dtype, variant: str) -> int:
    """Bytes autograd saves in one block's forward on one rank (v2 or v2sp), one sequence of n rows."""
    if variant not in ("v2", "v2sp"):
        raise ValueError(f"no activation-memory formula for {variant!r} (v2 and v2sp only)")
    d, k, f, h = cfg.d_model, cfg.k, cfg.d_ffn, cfg.n_heads
    e, e_s = dtype.itemsize, torch.promote_types(dtype, torch.float32).itemsize
    if getattr(cfg, "qk_norm", False):
        raise ValueError("no activation-memory formula for blocks with per-head q, k norms (Qwen3)")
    if llama_block(cfg):
        return _llama_bytes(cfg, p, n, e, e_s, variant)
    shared = 4 * n * k // p + 2 * n * f // p  # attention and MLP activations: split by heads and columns alike
    if variant == "v2":
        return e * (4 * n * d + 4 * n + shared) + e_s * n * h // p
    rows = padded(n, p)
    return e * (2 * rows * d // p + 2 * rows * d + 4 * rows // p + shared + 6 * d) + e_s * n * h // p


def _llama_bytes(cfg, p: int, n: int, e: int, e_s: int, variant: str) -> int:
    """A Llama block (layers/models/llama.py). Per RMSNorm: its input in float32 at least (the squares' operand), 1/rms
    [T] in float32 at least, the normalized rows rounded to x's dtype, and the weighted rows (the matmul's input;
    v2sp: the gathered rows instead). Attention: the rotary tables cos, sin [T, d_head]; q and the K,V expanded to
    this rank's h/p query heads (grouped-query attention repeats them), the output [T, k/p], the log-sum-exp
    [h/p, T]. SwiGLU: gate|up [T, 2f/p], silu(gate) and the product [T, f/p] each."""
    d, dh, h, f = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.d_ffn
    if variant == "v2":
        norms = 2 * (e_s * n * d + e_s * n + 2 * e * n * d)
    else:
        rows = padded(n, p)
        norms = 2 * (e_s * rows * d // p + e_s * rows // p + e * rows * d // p + e * rows * d)
    return norms + 2 * e * n * dh + 4 * e * n * (h // p) * dh + e_s * n * h // p + 4 * e * n * f // p
