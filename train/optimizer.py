"""The distributed optimizer (Megatron's `--use-distributed-optimizer`, ZeRO-1): AdamW whose state is split over
the dp replicas.

Each rank's parameters (its tp slices) are laid end to end in one flat vector of N values, padded to a multiple of
dp; dp rank d owns [d·N/dp, (d+1)·N/dp) of it: the float32 (or float64) master copy of those values and Adam's two
moments, 1/dp of what plain data parallelism keeps on every rank. One step:

    g_d  = (Σ_replicas g)[own] / dp            ★ reduce-scatter of the flat gradient [N] over dp
    ‖g‖² = Σ over dp of each rank's own squares (★ all-reduce [2] over dp), the sharded parameters' part summed over
           tp as well (★ all-reduce [1] over tp), a replicated parameter counted once
    AdamW on the owned values (torch.optim.AdamW's update, elementwise, decay only where the parameter decays)
    p    = the owned values of every rank       ★ all-gather [N] over dp, copied back into the parameters

The same bytes as the plain all-reduce of the gradient (a reduce-scatter and an all-gather are its two halves);
train/step.py keeps the plain one as the reference this one is checked against.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tp.comm import all_gather_values, all_reduce_values, reduce_scatter_values


class DistributedAdamW:
    def __init__(self, named_parameters, c, dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None,
                 replicated: set[str], decays):
        """c: train/step.py TrainConfig (betas, eps, weight_decay); decays(name, parameter): whether it decays."""
        named = list(named_parameters)
        self.params = [p for _, p in named]
        self.c, self.dp_group, self.tp_group = c, dp_group, tp_group
        self.dp, self.rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.sizes = [p.numel() for p in self.params]
        n = sum(self.sizes)
        self.per_rank = -(-n // self.dp)
        own = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

        def flat_mask(keep) -> torch.Tensor:
            mask = torch.cat([torch.full((p.numel(),), float(keep(name, p)), dtype=torch.float64) for name, p in named])
            return torch.nn.functional.pad(mask, (0, self.per_rank * self.dp - n))[own]

        self.decay = flat_mask(decays)
        self.sharded = flat_mask(lambda name, p: name not in replicated)
        master_dtype = torch.float64 if self.params[0].dtype == torch.float64 else torch.float32
        self.master = self._flat([p.detach() for p in self.params])[own].to(master_dtype)
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.steps = 0

    def state_dict(self) -> dict:
        return {"master": self.master, "m": self.m, "v": self.v, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        for name in ("master", "m", "v"):
            getattr(self, name).copy_(state[name])
        self.steps = state["steps"]

    def _flat(self, tensors) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.per_rank * self.dp - flat.numel()))

    def step(self, lr: float) -> torch.Tensor:
        """Reduce-scatter, clip, AdamW on the owned values, all-gather; returns the gradient norm before clipping."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        g = reduce_scatter_values(self._flat(grads), self.dp_group, "optimizer/reduce-scatter")  # ★ [N] over dp
        g = g.to(self.master.dtype) / self.dp
        squares = torch.stack([(g * g * self.sharded).sum(), (g * g * (1 - self.sharded)).sum()])
        squares = all_reduce_values(squares, self.dp_group, "sum", "optimizer/all-reduce norm dp")  # ★ [2]
        sharded = squares[0] if self.tp_group is None else \
            all_reduce_values(squares[:1], self.tp_group, "sum", "optimizer/all-reduce norm")[0]  # ★ [1]
        norm = (sharded + squares[1]).sqrt()
        if self.c.grad_clip > 0:
            g = g * torch.clamp(self.c.grad_clip / (norm + 1e-6), max=1.0)
        self.steps += 1
        (b1, b2), t = self.c.betas, self.steps
        self.master.mul_(1 - lr * self.c.weight_decay * self.decay)  # decoupled weight decay
        self.m.lerp_(g, 1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (self.v.sqrt() / math.sqrt(1 - b2 ** t)).add_(self.c.eps)
        self.master.addcdiv_(self.m, denom, value=-lr / (1 - b1 ** t))
        flat = all_gather_values(self.master.to(self.params[0].dtype), self.dp_group, "optimizer/all-gather")  # ★
        with torch.no_grad():
            for p, part in zip(self.params, torch.split(flat[:sum(self.sizes)], self.sizes)):
                p.copy_(part.view_as(p))
        return norm
