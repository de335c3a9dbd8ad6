"""The one log-sum-exp merge of partial attention (docs/background.md, seeds/00 articles 11-13): attention over a
part K_a of the keys gives o_a (softmax-weighted values over K_a) and lse_a = log Σ_{k∈K_a} e^{q·k·s}; parts combine
exactly: lse = log Σ_a e^{lse_a}, o = Σ_a e^{lse_a − lse}·o_a. An empty part has lse = −∞ and weight 0.

Context parallelism merges the cp ranks' parts with it (layers/attention/context_parallel.py); FlashDecoding merges a
long cache's key chunks with it (layers/attention/flash.py)."""

from __future__ import annotations

import math

import torch


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention outputs o_a [..., d] with their log-sum-exps lse_a [...] (−∞: an empty part) -> (o, lse),
    exactly the attention over the union of the parts. Rows whose every part is empty come out 0 with lse −∞."""
    lse_all = torch.stack(lses)  # [parts, ...]
    top = lse_all.amax(0)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all parts empty: nothing to weigh
    weights = torch.exp(lse_all - safe)  # e^{lse_a − max}: 0 for an empty part
    total = weights.sum(0)
    lse = torch.where(total > 0, safe + torch.log(total), torch.full_like(top, -math.inf))
    w = torch.where(total > 0, weights / total.clamp_min(torch.finfo(total.dtype).tiny), torch.zeros_like(weights))
    o = sum(wi[..., None].to(oi.dtype) * oi for wi, oi in zip(w, outs))
    return o, lse
