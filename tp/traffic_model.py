"""The analytic traffic model: every collective a forward or backward issues, from the config alone.

A pure function of (model shape, p, n, dtype, variant, phase). The traffic ledger
(tp/ledger.py) observes the same list at run time; tests require the two to be equal.

Per block, with n tokens, d = d_model, k = n_heads·d_head, f = d_ffn:

    variant     forward                                   backward
    v2          all-reduce [n,d] ×2                       all-reduce [n,d] ×2 (dx of qkv, mlp_up)
    v1          all-gather [n,k], [n,d], [n,f], [n,d]     all-reduce [n,d], [n,k], [n,d], [n,f] (dx)
    intra_head  all-reduce [h,ΣL²], [n,d] ×2              all-reduce [h,ΣL²] (dP), [n,d] ×2 (dx)

With many requests flattened (lengths Lᵢ, n = Σ Lᵢ) nothing changes but n, except
intra_head's scores: each request's [h, Lᵢ, Lᵢ] block, side by side, [h, Σ Lᵢ²].

A serving iteration (SPEC §6; layers/lm.py) of T rows, S of them sampled, adds to the stack's
collectives, outside any block: an all-gather of every rank's plan fingerprint (the engine
checks that all ranks scheduled the same rows), and with the vocab-parallel embedding one
all-reduce of [T, d] after the lookup and one all-gather of (max, argmax) pairs [S, 2] float64
per rank in the LM head. A replicated embedding and head communicate nothing.

Bytes per rank follow the ring model: all-reduce 2(p-1)/p·M·e, all-gather (p-1)/p·M·e.
On one rank nothing is communicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tp.ledger import Traffic

if TYPE_CHECKING:  # shapes only; tp/ does not import layers/ at run time
    from layers.config import ModelConfig

PHASES = ("forward", "backward")


def block_collectives(cfg: ModelConfig, n: int, variant: str, phase: str,
                      lengths: list[int] | None = None) -> list[tuple[str, str, str, tuple]]:
    """(sublayer, site, kind, logical shape) for one block, in issue order. lengths: the requests (default [n])."""
    d, k, f, h = cfg.d_model, cfg.k, cfg.d_ffn, cfg.n_heads
    scores = (h, sum(x * x for x in (lengths or [n])))
    ar, ag = "all_reduce", "all_gather"
    table = {
        ("v2", "forward"): [("attn", "all-reduce #1", ar, (n, d)), ("mlp", "all-reduce #2", ar, (n, d))],
        ("v2", "backward"): [("mlp", "mlp_up dx", ar, (n, d)), ("attn", "qkv dx", ar, (n, d))],
        ("v1", "forward"): [("attn", "gather #1", ag, (n, k)), ("attn", "gather #2", ag, (n, d)),
                            ("mlp", "gather #3", ag, (n, f)), ("mlp", "gather #4", ag, (n, d))],
        ("v1", "backward"): [("mlp", "mlp_down dx", ar, (n, f)), ("mlp", "mlp_up dx", ar, (n, d)),
                             ("attn", "attn_out dx", ar, (n, k)), ("attn", "qkv dx", ar, (n, d))],
        ("intra_head", "forward"): [("attn", "scores all-reduce", ar, scores),
                                    ("attn", "all-reduce #1", ar, (n, d)), ("mlp", "all-reduce #2", ar, (n, d))],
        ("intra_head", "backward"): [("mlp", "mlp_up dx", ar, (n, d)), ("attn", "probs dP", ar, scores),
                                     ("attn", "qkv dx", ar, (n, d))],
    }
    if (variant, phase) not in table:
        raise ValueError(f"no traffic model for variant={variant!r} phase={phase!r}")
    return table[(variant, phase)]


def predict(cfg: ModelConfig, p: int, n: int, dtype: torch.dtype, variant: str, phase: str = "forward",
            lengths: list[int] | None = None) -> list[Traffic]:
    """Every collective of one pass through the whole L-layer stack, layer by layer."""
    if p == 1:
        return []
    return [
        Traffic.of(layer=i, sublayer=sub, site=site, phase=phase, kind=kind, shape=shape, dtype=dtype, p=p)
        for i in range(cfg.n_layers)
        for sub, site, kind, shape in block_collectives(cfg, n, variant, phase, lengths)
    ]


def bytes_per_rank_per_layer(cfg: ModelConfig, p: int, n: int, dtype: torch.dtype, variant: str,
                             phase: str = "forward", lengths: list[int] | None = None) -> float:
    """Closed form, for sweeps and plots."""
    if p == 1:
        return 0.0
    return sum(Traffic.of(layer=0, sublayer=s, site=t, phase=phase, kind=k, shape=sh, dtype=dtype, p=p).bytes_per_rank
               for s, t, k, sh in block_collectives(cfg, n, variant, phase, lengths))


def predict_iteration(cfg: ModelConfig, p: int, rows: int, sampled: int, dtype: torch.dtype, variant: str,
                      vocab_parallel: bool, plan_check: int) -> list[Traffic]:
    """Every collective of one serving iteration, in issue order. plan_check: fingerprint elements per rank."""
    if p == 1:
        return []

    def extra(sublayer, site, kind, shape, dt):
        return Traffic.of(layer=None, sublayer=sublayer, site=site, phase="forward", kind=kind, shape=shape,
                          dtype=dt, p=p)

    out = [extra("engine", "plan check", "all_gather", (1, plan_check * p), torch.float64)] if plan_check else []
    if vocab_parallel:
        out.append(extra("embed", "all-reduce", "all_reduce", (rows, cfg.d_model), dtype))
    out += predict(cfg, p, rows, dtype, variant, "forward")
    if vocab_parallel and sampled:
        out.append(extra("head", "argmax all-gather", "all_gather", (sampled, 2 * p), torch.float64))
    return out
