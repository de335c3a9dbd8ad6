"""Vocab-parallel cross-entropy (Megatron's): each rank's logits stay on it.

Rank r holds z[:, V_r], its slice of every row's logits (layers/parallel/vocab.py local_logits; padding ids -inf).
The loss of a row, log Σ_v exp(z_v) − z_target, needs three numbers per row from the ranks, never the logits:

    m = max_v z_v                  ★ all-reduce (max) of each rank's row max                    [n]
    s = Σ_v exp(z_v − m)           ★ all-reduce (sum) of each rank's partial sums                [n]
    t = z_target − m               ★ all-reduce (sum): the rank holding the target gives it, 0 elsewhere  [n]
    loss = log s − t

The backward is local, no collective: ∂loss/∂z[:, V_r] = softmax(z)[:, V_r] − onehot(target)[:, V_r], each row
scaled by its loss's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.sampling.sampler import log_normaliser
from tp.comm import all_reduce_values


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: dist.ProcessGroup):
        n, width = logits.shape
        m = all_reduce_values(logits.max(dim=-1).values, group, "max", "loss/all-reduce max")  # ★ [n]
        exp = torch.exp(logits - m[:, None])  # [n, V/p]; padding ids give 0
        s = all_reduce_values(exp.sum(dim=-1), group, "sum", "loss/all-reduce sum")  # ★ [n]
        local = targets - start
        mine = (local >= 0) & (local < width)  # the rows whose target id this rank holds
        rows = torch.arange(n, device=logits.device)
        target = torch.where(mine, logits[rows, local.clamp(0, width - 1)] - m, torch.zeros_like(m))
        t = all_reduce_values(target, group, "sum", "loss/all-reduce target")  # ★ [n]
        ctx.save_for_backward(exp / s[:, None], local, mine)
        return torch.log(s) - t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()  # softmax(z)[:, V_r] − onehot(target)[:, V_r]: local
        rows = torch.arange(g.shape[0], device=g.device)[mine]
        g[rows, local[mine]] -= 1
        return g * grad[:, None], None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """Each row's cross-entropy [n] from this rank's logits [n, V/p] (its ids start at `start`) and the target ids
    [n], equal to torch.nn.functional.cross_entropy(z, targets, reduction="none") on the whole rows z."""
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z)[target] per row in float64, in the serving sampler's arithmetic (layers/sampling/sampler.py:
    the same m, the same sum exp(z − m), log_normaliser), so where the logits are the engine's bits the logprobs are
    too. The same three all-reduces [n] as the cross-entropy, in float64; the backward local."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group: dist.ProcessGroup):
        z = logits.double()
        n, width = z.shape
        m = all_reduce_values(z.max(dim=-1).values, group, "max", "logprobs/all-reduce max")  # ★ [n]
        exp = torch.exp(z - m[:, None])
        z_sum = all_reduce_values(exp.sum(dim=-1), group, "sum", "logprobs/all-reduce sum")  # ★ [n]
        local = targets - start
        mine = (local >= 0) & (local < width)
        rows = torch.arange(n, device=z.device)
        target = torch.where(mine, z[rows, local.clamp(0, width - 1)], torch.zeros_like(m))
        z_t = all_reduce_values(target, group, "sum", "logprobs/all-reduce target")  # ★ [n]: z + 0 elsewhere, exact
        ctx.save_for_backward(exp / z_sum[:, None], local, mine)
        ctx.dtype = logits.dtype
        return z_t - log_normaliser(m, z_sum)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine = ctx.saved_tensors
        g = -softmax  # onehot(target)[:, V_r] − softmax(z)[:, V_r]: local
        rows = torch.arange(g.shape[0], device=g.device)[mine]
        g[rows, local[mine]] += 1
        return (g * grad[:, None]).to(ctx.dtype), None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, start: int,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """Each row's log-probability of its target [n] float64 from this rank's logits [n, V/p] (ids from `start`):
    torch.log_softmax(z.double(), -1)[row, target] on the whole rows, differentiable (an RL step's policy logprobs),
    with the sampler's arithmetic (the engine's logprobs to the bit where the logits are its bits)."""
    return _TokenLogprobs.apply(logits, targets, start, group)
