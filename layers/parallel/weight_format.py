"""How a rank stores the weights its matmuls read: their layout, and weight-only int8. Chosen once, at load, after the
shard is cut; every weight keeps nn.Linear's meaning, [out, in], so sharding, checkpoint reading, the ledger and the
dense oracle do not change.

Layout: `weight` is shaped [out, in] either way; only its strides differ.

    out_in   row-major, nn.Linear's own: F.linear(x, W) multiplies by Wᵀ, a transposed operand
    in_out   column-major: W.t() is a contiguous [in, out] and F.linear(x, W) is x @ A with A read as stored
    auto     per weight: out_in where decode's fused kernel reads it (below), else in_out on a CPU; out_in on any
             other device (cuBLAS reads either operand order at full speed)

On this machine's CPUs PyTorch's matmul reads an [in, out] operand faster at every row count we serve, most at one
row (batch-1 decode): `benchmarks/bench_decode.py --parts layout` measures it per row count (docs/decode.md).

Decode's fused kernels. At 2 to 8 rows PyTorch's matmul reads the weights again for the extra rows. On a CPU, with
compiling on (EngineConfig.enforce_eager off) and gradients off, a matmul of at most FUSED_ROWS rows over a weight
that streams from memory (FUSED_MIN values or more) runs as one reduction compiled by torch.compile instead: each
weight row is read from memory once, and int8 codes are converted in registers.

Weight-only int8 (the setting is vLLM's `quantization`, the value "int8" ours; gpt-fast's int8 mode). Each rank quantizes its own shard, per output
channel: scale[o] = max_i |W[o, i]| / 127 (in the model's dtype), code[o, i] = round(W[o, i] / scale[o]) in
[-127, 127], and y = (x · codeᵀ) · scale. Under tensor parallelism:

    column-parallel  rank r holds whole output channels, so its scales are the dense channels' (they split with them)
    row-parallel     rank r holds an [out, in/p] slice and a whole scale vector [out] of its own, applied to its
                     partial sum before the all-reduce: the dense weight quantized in groups of in/p along `in`
    the LM head      per vocabulary row; a tied token embedding looks its rows up the same way (code · scale)

Activations, norms, the KV cache and every collective keep the model's dtype: only the bytes the matmuls read
shrink (tp/cost_model.decode_weight_bytes counts them). PyTorch's own int8-weight kernel does not pay on a CPU (its
aten._weight_int8pack_mm reads at a third of float32's speed here), so decode's rows run the fused kernel; more
rows, other devices and float64 (the exactness tests) convert a chunk of codes at a time in cache and multiply it,
the dequantized reference's arithmetic.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

QUANTIZATIONS = ("int8",)  # None: the weights as loaded
LAYOUTS = ("auto", "out_in", "in_out")
INT8_MAX = 127  # symmetric: -127 .. 127 (the code -128 is never used)


def check_quantization(quantization) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose None (null in the launcher: the weights as loaded) or "
                         f"{', '.join(map(repr, QUANTIZATIONS))}")


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout={layout!r}: choose {', '.join(LAYOUTS)}")


def resolve_layout(layout: str, device: torch.device | str, fused: bool = False) -> str:
    """auto -> out_in for a weight the fused kernel reads (it reduces along contiguous rows), in_out for any other
    on a CPU (PyTorch's matmul reads it faster there), out_in on any other device."""
    check_layout(layout)
    if layout != "auto":
        return layout
    return "in_out" if torch.device(device).type == "cpu" and not fused else "out_in"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes int8 [out, in], scales [out] in w's dtype): symmetric, one scale per row (output channel).
    A row of zeros (or too small for the dtype's scale) gets scale 1 and zero codes."""
    scales = (w.abs().amax(dim=1).to(torch.promote_types(w.dtype, torch.float32)) / INT8_MAX).to(w.dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero rows, or a scale float16 cannot hold
    codes = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.contiguous(), scales


FUSED_ROWS = {"float": 8, "int8": 4}  # at most this many rows (decode's, a verify's): the fused kernel
FUSED_MIN = 1 << 18  # weights (1 MiB in float32) from which a matmul streams them from memory; smaller ones are read
#                      from cache, where PyTorch's matmul costs less per call than a compiled kernel
CHUNK = 1 << 20  # int8 weights dequantized at a time (4 MiB of float32: they stay in cache while the matmul reads them)
_kernels = {"float": None, "int8": None, "ran": set(), "failed": False}  # this process's compiled kernels; which ran;
#                                                                         whether compiling failed here (no compiler)


def _fused_float(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[n, o] = Σ_i x[n, i] · w[o, i] as one reduction, output channel outermost: each row of w is read from memory
    once and again from cache for each of the n rows (PyTorch's matmul at 2-8 rows reads the weights again)."""
    return (x[None, :, :] * w[:, None, :]).sum(-1).t().contiguous()


def _fused_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y[n, o] = scale[o] · Σ_i x[n, i] · code[o, i] as one reduction: each code read once, converted in registers
    and never written back as a float."""
    return (x[:, None, :] * codes[None].to(x.dtype)).sum(-1) * scales


def fused_kernel(kind: str, x: torch.Tensor, weight: torch.Tensor, fused: bool):
    """The compiled kernel of `kind` (float, int8) for this product, or None: the module's `fused` is off
    (enforce_eager, another device, TPREF_COMPILE=0), compiling failed here before, gradients are on (serving runs
    without), x is not float32/bfloat16/float16, more rows than FUSED_ROWS, a weight small enough for cache, or a
    float weight not stored row-major."""
    rows = x.numel() // x.shape[-1]
    if not fused or _kernels["failed"] or torch.is_grad_enabled() or x.device.type != "cpu" or \
            rows > FUSED_ROWS[kind] or weight.numel() < FUSED_MIN or weight.stride(-1) != 1 or \
            x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if _kernels[kind] is None:
        _kernels[kind] = torch.compile(_fused_float if kind == "float" else _fused_int8, dynamic=True)
    return _kernels[kind]


def _run_fused(kernel, kind: str, x: torch.Tensor, *weights) -> torch.Tensor | None:
    """kernel over x's rows. None where its first call fails (compiling: no C++ compiler, say): then eager from now
    on, said once on stderr. A kernel that ran before raises what it raises."""
    from torch._dynamo.decorators import mark_unbacked  # here: importing dynamo costs a second

    flat = x.reshape(-1, x.shape[-1]).clone(memory_format=torch.contiguous_format)  # rows contiguous, never a view
    mark_unbacked(flat, 0)  # any number of rows, 1 included, in one compiled kernel (else 1 gets its own)
    try:  # .data: a parameter's shape would be compiled in (dynamo keeps parameters static), one kernel per shape
        y = kernel(flat, *(w.data for w in weights))
    except Exception as exc:  # noqa: BLE001 - a kernel that never ran failed to compile: the eager kernels run
        if kind in _kernels["ran"]:
            raise
        import sys

        first = (str(exc).splitlines() or [""])[0][:200]
        print(f"weight_format: the fused kernels did not compile ({type(exc).__name__}: {first}); the eager kernels "
              f"run instead", file=sys.stderr)
        _kernels["failed"] = True
        return None
    _kernels["ran"].add(kind)
    return y.reshape(*x.shape[:-1], weights[0].shape[0])


def _chunked(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x · (codes · scales)ᵀ a chunk of output channels at a time: each chunk's codes converted (in cache),
    multiplied, scaled. The dequantized reference's arithmetic; any device, any dtype (float64 for the exactness
    tests)."""
    out, width = codes.shape
    step = max(1, CHUNK // width)
    if step >= out or x.device.type != "cpu":  # a GPU converts the whole weight in one call
        return F.linear(x, codes.to(x.dtype)) * scales
    y = x.new_empty(*x.shape[:-1], out)
    for a in range(0, out, step):
        torch.mul(F.linear(x, codes[a:a + step].to(x.dtype)), scales[a:a + step], out=y[..., a:a + step])
    return y


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x [..., in] · (codes [out, in] · scales [out, 1])ᵀ -> [..., out]: decode's rows through the fused kernel,
    else in chunks (benchmarks/bench_decode.py --parts layout measures both per row count)."""
    kernel = fused_kernel("int8", x, codes, fused)
    y = None if kernel is None else _run_fused(kernel, "int8", x, codes, scales)
    return _chunked(x, codes, scales) if y is None else y


TILE_ROWS = 8  # batch_invariant: every product in tiles of exactly this many rows


def linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, fused: bool = False, tile: int | None = None) -> torch.Tensor:
    """x · weightᵀ + bias, weight as stored: a float tensor in either layout, or int8 codes with their scales. fused:
    the module's (prepare's) permission to run decode's compiled kernels. tile (batch_invariant): the rows in tiles
    of exactly `tile`, the last padded with zeros, so a row's result does not depend on how many rows share the call
    (a BLAS picks its kernel, and so its order of summation, by the matrix's shape)."""
    if tile is not None and scales is None and x.shape[0]:
        pad = -x.shape[0] % tile
        rows = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
        out = torch.cat([F.linear(rows[i:i + tile], weight, bias) for i in range(0, rows.shape[0], tile)])
        return out[:x.shape[0]]
    if scales is not None:
        y = int8_matmul(x, weight, scales, fused)
    else:
        kernel = fused_kernel("float", x, weight, fused)
        y = None if kernel is None else _run_fused(kernel, "float", x, weight)
        if y is None:
            return F.linear(x, weight, bias)
    return y if bias is None else y + bias


def embedding(ids: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The rows of a token embedding, dequantized when it holds int8 codes (a head tied to it was quantized; the
    scales are in the model's dtype)."""
    rows = F.embedding(ids, weight)
    return rows if scales is None else rows.to(scales.dtype) * scales[ids][..., None]


def model_dtype(lm: nn.Module) -> torch.dtype:
    """The dtype lm computes in (its activations, its KV cache): its first float parameter's, int8 codes aside."""
    return next(p.dtype for p in lm.parameters() if p.is_floating_point())


def matmul_modules(lm: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module whose weight a matmul reads: the column- and row-parallel linears of the blocks
    and the LM head (a tied embedding included), each holding `weight` [out', in'] and a `scales` buffer. A token
    embedding that is only looked up (a Llama's own, beside its head) is not one."""
    head = getattr(lm, "output_embedding", None)  # a pipeline stage's model has none (its linears are found)
    return [(name, m) for name, m in lm.named_modules()
            if "scales" in m._buffers and (not hasattr(m, "local_logits") or m is head)]


def quantized(lm: nn.Module) -> bool:
    return any(m.scales is not None for _, m in matmul_modules(lm))


@torch.no_grad()
def dequantized(dense: nn.Module, served: nn.Module) -> nn.Module:
    """The dense model whose weights are what `served`'s int8 shards stand for (the oracle of a quantized model): each
    dense weight that a quantized module of `served` holds a slice of is quantized and dequantized in groups of
    that module's own input width along `in` (in/p for a row-parallel slice, the whole row otherwise), by the same
    rule as quantize_rows. In place; returns dense."""
    widths = {f"{name}.weight": m.weight.shape[1] for name, m in matmul_modules(served) if m.scales is not None}
    for part in served.plan():
        if part.param in widths and part.source is not None:
            w = dense.get_parameter(part.source)
            out, width = w.shape[0], widths[part.param]
            if width != w.shape[1] and not (part.cut.dim == 1 and len(part.cut.ranges) == 1):
                raise ValueError(f"{part.source}: int8's oracle groups whole rows or one contiguous slice of columns "
                                 f"per rank, not the cut {part.cut}")
            codes, scales = quantize_rows(w.data.reshape(-1, width))
            w.data.copy_((codes.to(w.dtype) * scales[:, None]).reshape(out, -1))
    return dense


@torch.no_grad()
def prepare(lm: nn.Module, quantization: str | None, layout: str, compile: bool = True,
            tile_rows: int | None = None) -> nn.Module:
    """Store lm's matmul weights for the device they run on: int8 codes and scales (quantization="int8"), or the
    float weights in `layout` (auto: resolved per weight for lm's device and whether the fused kernel reads it).
    compile: decode's matmuls of large weights run compiled fused kernels on a CPU (enforce_eager turns it off).
    tile_rows (batch_invariant: TILE_ROWS): every product in tiles of this many rows, nothing compiled, and `auto`
    is out_in, nn.Linear's own layout, so a trainer's forward in tiles (`tiled`) multiplies the same operands. In
    place; returns lm."""
    check_quantization(quantization)
    modules = matmul_modules(lm)
    if not modules:
        return lm
    device = modules[0][1].weight.device
    fused = compile and tile_rows is None and torch.device(device).type == "cpu" and \
        os.environ.get("TPREF_COMPILE", "1") != "0"
    for _, module in modules:
        module.fused = fused
        module.tile_rows = tile_rows
        w = module.weight
        if quantization == "int8":
            codes, scales = quantize_rows(w.data)
            module.weight = nn.Parameter(codes, requires_grad=False)
            module.scales = scales
        elif tile_rows is not None and layout == "auto":  # the trainer's layout: its forward reads the same operand
            relayout(w, "out_in")
        else:
            relayout(w, resolve_layout(layout, device, fused and w.numel() >= FUSED_MIN))
    warm_up([m for _, m in modules], model_dtype(lm))
    if fused and _kernels["failed"]:  # no compiler here: eager, in the layout eager reads fastest
        for _, module in modules:
            module.fused = False
            if module.scales is None:
                relayout(module.weight, resolve_layout(layout, device))
    return lm


@contextmanager
def tiled(lm: nn.Module, rows: int | None = TILE_ROWS):
    """lm's products in tiles of `rows` rows while the block runs (None: untiled), each module's own setting back
    after it; `prepare` tiles a served model's so for batch_invariant, and a trainer's forward in the block multiplies
    as that engine does (train/step.py tp_logprobs)."""
    modules = [m for _, m in matmul_modules(lm)]
    before = [getattr(m, "tile_rows", None) for m in modules]
    for m in modules:
        m.tile_rows = rows
    try:
        yield lm
    finally:
        for m, was in zip(modules, before):
            m.tile_rows = was


def relayout(w: torch.Tensor, layout: str) -> None:
    """w's storage in `layout`, its shape [out, in] kept."""
    w.data = w.data.t().contiguous().t() if layout == "in_out" else w.data.contiguous()


@torch.no_grad()
def warm_up(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Compile the fused kernels now, at load, for the first module that will use each (one kernel for any number of
    rows), rather than inside the first decode step, where the other ranks would wait for it in a collective."""
    done = set()
    for m in modules:
        kind = "float" if m.scales is None else "int8"
        x = torch.zeros(1, m.weight.shape[1], dtype=dtype, device=m.weight.device)
        if kind not in done and fused_kernel(kind, x, m.weight, m.fused) is not None:
            linear(x, m.weight, m.scales, fused=m.fused)
            done.add(kind)


def stored_bytes(lm: nn.Module) -> int:
    """Bytes of lm's matmul weights (and their scales) as stored: what one decode step reads of them."""
    return sum(m.weight.numel() * m.weight.element_size() +
               (0 if m.scales is None else m.scales.numel() * m.scales.element_size())
               for _, m in matmul_modules(lm))
