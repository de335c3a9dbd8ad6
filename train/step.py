"""One training step on the TP stack the engine serves, and the same step on one device (the oracle).

    loss  = mean over every target token of the micro-batches' cross-entropy   (each micro-batch's mean / their count)
    step  = (forward → loss → backward) per micro-batch → clip by the global norm → AdamW → the next learning rate

On tp ranks (GPT-2 and Llama families, v2 blocks, vocab-parallel embedding and head; Llama: no wpe, RMSNorm):

    x = embed(ids) + wpe(positions)                          ★ all-reduce [B·T, d] (the vocabulary's slices)
    x = block(x, requests)  for every block                  ★ v2: 2 all-reduces [B·T, d] forward, 2 backward
    z = head(f(ln_f(x)))                                     f: ★ all-reduce of the head input's gradient, backward
    loss = vocab_parallel_cross_entropy(z, targets)          ★ 3 all-reduces [B·T] (train/loss.py)
    ‖g‖² = Σ_sharded all-reduced over tp + Σ_replicated      ★ all-reduce [1]: a replicated parameter counted once

Every replicated parameter (wpe, the norms, row-parallel biases) gets the same whole gradient on every rank (the f/g
collectives make it so), so no extra reduction is needed for it, and AdamW is elementwise: each rank's update of
its slices is the dense update's slices.

Data parallelism: dp replicas of the tp group (the world dp × tp, global rank d·tp + t: tp/dist.py grid_groups),
each with its own micro-batches of the step's batch; after the backward their gradients are averaged:

    g = (Σ_d g_d) / dp                                       ★ all-reduce of the flat gradient [N/tp] over dp

or, with distributed_optimizer, its two halves around an update of 1/dp of the values (train/optimizer.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from layers.attention.varlen import Requests
from layers.models.families import of
from tp.comm import all_reduce_values, copy_to_region
from train.loss import vocab_parallel_cross_entropy
from train.optimizer import DistributedAdamW


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    max_steps: int = 1000
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # the global gradient norm's bound (0: no clipping)
    accumulation: int = 1  # micro-batches per step
    distributed_optimizer: bool = False  # AdamW's state split over dp (train/optimizer.py); False: on every replica
    attention: str = "sdpa"  # sdpa (PyTorch's fused kernel) | flash (FlashAttention-2 forward and backward, flash.py)


def learning_rate(step: int, c: TrainConfig) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to min_lr at max_steps (nanoGPT's schedule)."""
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    progress = min(1.0, (step - c.warmup_steps) / max(1, c.max_steps - c.warmup_steps))
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (c.lr - c.min_lr)


def no_decay(name: str, p: torch.Tensor) -> bool:
    """Norms, biases and the position table keep their values: no weight decay (a 1-D tensor, or wpe)."""
    return p.ndim < 2 or name.endswith("wpe.weight")


def adamw(named_parameters, c: TrainConfig) -> torch.optim.AdamW:
    """torch's AdamW (decoupled weight decay), decay on the matrices only."""
    named = list(named_parameters)
    groups = [{"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": c.weight_decay},
              {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps)


def replicated_names(lm) -> set[str]:
    """The parameters every rank holds whole (its plan takes the whole dense tensor): counted once in the norm."""
    cut: dict[str, bool] = {}
    for part in lm.plan():
        cut[part.param] = cut.get(part.param, False) or part.cut.ranges is not None or part.source is None
    return {name for name, is_cut in cut.items() if not is_cut}


def tp_loss(lm, ids: torch.Tensor, flash: bool = False) -> torch.Tensor:
    """The mean cross-entropy of a micro-batch ids [B, T + 1] (inputs ids[:, :-1], targets ids[:, 1:]) through this
    rank's TPLM or TPLlamaLM, the logits never gathered. flash: attention through FlashAttention-2's forward and
    backward (layers/attention/flash.py) instead of SDPA."""
    B, T = ids.shape[0], ids.shape[1] - 1
    inputs, targets = ids[:, :-1].reshape(-1), ids[:, 1:].reshape(-1)
    requests = Requests.from_lengths([T] * B, flash=flash)  # each sequence attends to itself alone, from position 0
    z = tp_logits(lm, inputs, torch.arange(T, device=ids.device).repeat(B), requests)
    if z.dtype in (torch.bfloat16, torch.float16):  # autocast: the softmax's statistics in float32
        z = z.float()
    head = lm.output_embedding
    return vocab_parallel_cross_entropy(z, targets, head.start, head.group).mean()  # ★ 3 all-reduces [B·T]


def tp_logits(lm, inputs: torch.Tensor, positions: torch.Tensor, requests: Requests) -> torch.Tensor:
    """This rank's slice of the logits [n, V'/p] of the flat rows `inputs` [n] (each request's rows attend to its
    own, by `requests`): the train step's forward."""
    x = lm.embed_rows(inputs, positions)  # ★ all-reduce [n, d]
    n, stack = x.shape[0], lm.stack
    x = stack.enter(x)  # v2sp: this rank's rows (backward: ★ all-gather of dx)
    for block in stack.blocks:
        x = stack.layer(block, x, requests, n)  # ★ v2: 2 all-reduces forward, 2 backward; v2sp: 2 all-gathers and
    x = stack.output((x,), n)  # 2 reduce-scatters each way; v2sp: ★ all-gather of the rows
    head = lm.output_embedding
    # f after the final norm: the norm's weights get the whole gradient (★ all-reduce [n, d], backward)
    return head.local_logits(copy_to_region(lm.final_norm(x), head.group, "head/f"))  # [n, V'/p]


def tp_logprobs(lm, sequences, batch_invariant: bool = False) -> list[torch.Tensor]:
    """Each token's log-probability given the tokens before it, through this rank's TP model: sequences (a list of
    lists or 1-D tensors of ids, any lengths >= 2; or a 2-D tensor, a sequence per row) -> per sequence [len - 1]
    float64, entry t = log p(seq[t + 1] | seq[:t + 1]), the same on every rank and differentiable (what an RL step
    reads for the tokens an engine sampled: for prompt + completion, entries len(prompt) - 1 onwards).

    batch_invariant: the serving engine's mode (EngineConfig.batch_invariant): every product in tiles of TILE_ROWS
    rows (weight_format.tiled) and FlashAttention-2's tiles padded; these are the logprobs of an engine in that mode
    to the bit where it holds the same weights in the same dtype, at the same tensor-parallel size (1 or 2: a row-
    parallel sum's bits depend on it) with its vocab-parallel head (the default), in weight_layout auto or out_in
    (tests/test_batch_invariant.py). Otherwise SDPA and whole products: equal to the dense model's up to rounding.

    Every rank of the group calls it with the same sequences, as the train step's micro-batches (checked_sequences
    refuses bad ones before any collective)."""
    from layers.parallel.weight_format import TILE_ROWS, tiled
    from train.loss import token_logprobs

    seqs, device = checked_sequences(lm, sequences, batch_invariant), next(lm.parameters()).device
    lengths = [len(s) - 1 for s in seqs]
    inputs, targets = torch.cat([s[:-1] for s in seqs]), torch.cat([s[1:] for s in seqs])
    positions = torch.cat([torch.arange(n) for n in lengths])
    requests = Requests.from_lengths(lengths, invariant=batch_invariant)
    with tiled(lm, TILE_ROWS if batch_invariant else None):
        z = tp_logits(lm, inputs.to(device), positions.to(device), requests)
    head = lm.output_embedding
    return list(token_logprobs(z, targets.to(device), head.start, head.group).split(lengths))  # ★ 3 all-reduces [n]


def checked_sequences(lm, sequences, batch_invariant: bool) -> list[torch.Tensor]:
    """tp_logprobs' input as 1-D int64 tensors, or a ValueError in one line: read from the sequences and this rank's
    settings alone, so every rank given the same sequences raises before any collective."""
    from layers.models.tp_block import SPStack

    if isinstance(sequences, torch.Tensor) and sequences.dim() == 1 or \
            isinstance(sequences, (list, tuple)) and sequences and all(isinstance(t, int) for t in sequences):
        raise ValueError("tp_logprobs: a list of sequences, each a list of token ids (one sequence: [ids])")
    try:
        seqs = [torch.as_tensor(s).reshape(-1) for s in sequences]
    except (TypeError, RuntimeError, ValueError) as exc:
        raise ValueError(f"tp_logprobs: sequences of token ids (lists or 1-D tensors of integers): {exc}") from None
    if not seqs:
        raise ValueError("tp_logprobs: no sequences")
    if any(s.is_floating_point() or s.is_complex() or s.dtype == torch.bool for s in seqs):
        raise ValueError("tp_logprobs: sequences of token ids (integers)")
    seqs = [s.long() for s in seqs]
    if min(len(s) for s in seqs) < 2:
        raise ValueError("tp_logprobs: every sequence needs 2 tokens or more (a token and the one it predicts)")
    cfg = lm.cfg
    if max(len(s) for s in seqs) - 1 > cfg.max_seq_len:
        raise ValueError(f"tp_logprobs: a sequence of {max(len(s) for s in seqs)} tokens; the model reads at most "
                         f"max_seq_len = {cfg.max_seq_len} and predicts one more")
    if any(int(s.min()) < 0 or int(s.max()) >= cfg.vocab_size for s in seqs):
        raise ValueError(f"tp_logprobs: token ids must lie in [0, {cfg.vocab_size})")
    if batch_invariant:
        p = dist.get_world_size(lm.output_embedding.group)
        if p > 2 or isinstance(lm.stack, SPStack):
            raise ValueError(f"tp_logprobs(batch_invariant=True) at tensor-parallel size {p}"
                             f"{' with sequence parallelism' if isinstance(lm.stack, SPStack) else ''} is not built: "
                             f"the engine's mode serves v2 blocks at tp 1 or 2")
        if torch.get_num_threads() != 1 or next(lm.parameters()).device.type != "cpu":
            raise ValueError("tp_logprobs(batch_invariant=True) runs on a CPU on one intra-op thread, as the engine's "
                             "mode does (torch.set_num_threads(1)): more threads split element-wise ops and sums at "
                             "points set by the number of rows")
    return seqs


def train_lm(weights, group: dist.ProcessGroup, sequence_parallel: bool = False):
    """This rank's TP LM to train: the v2 blocks the engine serves, or with sequence_parallel (Megatron's
    --sequence-parallel) the v2sp blocks, which hold the same slices but keep 1/tp of the rows between blocks: the
    norms and dropout-free residual adds run on this rank's rows, and each all-reduce becomes an all-gather before the
    column-parallel matmul and a reduce-scatter after the row-parallel one (layers/models/tp_block.py)."""
    from layers.models.lm import shard_lm
    from layers.models.tp_block import shard_stack

    lm = shard_lm(weights, "v2", group)
    if sequence_parallel:
        lm.stack = shard_stack(weights.stack, "v2sp", group)
    return lm


def dense_loss(lm, ids: torch.Tensor) -> torch.Tensor:
    """The same mean on one device: the dense LM over each sequence, torch's cross_entropy on the whole rows."""
    logits = torch.cat([lm.logits(row[:-1]) for row in ids])
    return F.cross_entropy(logits, ids[:, 1:].reshape(-1))


def clip(named_parameters, max_norm: float, group: dist.ProcessGroup | None, replicated: set[str]) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / ‖g‖) and return ‖g‖, the norm of the whole model's gradient: the
    sharded parameters' squares summed over the group (★ all-reduce [1]), the replicated ones' counted once."""
    named = [(n, p) for n, p in named_parameters if p.grad is not None]
    squares = {n: p.grad.double().pow(2).sum() for n, p in named}
    zero = torch.zeros((), dtype=torch.float64)
    sharded = sum((sq for n, sq in squares.items() if n not in replicated), zero)
    whole = sum((sq for n, sq in squares.items() if n in replicated), zero)
    if group is not None:
        sharded = all_reduce_values(sharded.reshape(1), group, "sum", "optimizer/all-reduce norm")[0]
    norm = (sharded + whole).sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, p in named:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm


class Trainer:
    """The step loop's state: the model (a TPLM on its group, or the dense LM: group None), AdamW, the schedule."""

    def __init__(self, lm, c: TrainConfig, group: dist.ProcessGroup | None = None,
                 dp_group: dist.ProcessGroup | None = None, autocast: torch.dtype | None = None):
        """autocast: the forward's matmuls in this dtype (bfloat16) under torch.autocast; the weights, their
        gradients and AdamW stay in the weights' dtype (float32 master weights), the loss's statistics float32."""
        self.lm, self.c, self.group, self.dp_group, self.autocast = lm, c, group, dp_group, autocast
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.replicated = replicated_names(lm) if group is not None else set()
        if c.attention not in ("sdpa", "flash"):
            raise ValueError(f"attention={c.attention!r}: sdpa or flash")
        if c.attention == "flash" and group is None:
            raise ValueError("attention='flash' trains the TP model (give a group; one rank is a group of one)")
        if of(lm.cfg).moe:
            raise ValueError(f"{lm.cfg.family} models are served, not trained yet: train a GPT-2 or Llama model")
        if group is not None and dist.get_world_size(group) > lm.cfg.n_kv_heads:
            raise ValueError(f"tp={dist.get_world_size(group)} > n_kv_heads={lm.cfg.n_kv_heads}: K,V heads replicated "
                             f"over ranks are served, not trained (their gradients would be partial on each rank); "
                             f"train at tp <= {lm.cfg.n_kv_heads}")
        if c.distributed_optimizer:
            if dp_group is None:
                raise ValueError("distributed_optimizer splits AdamW's state over dp replicas: give a dp group")
            self.optimizer = DistributedAdamW(lm.named_parameters(), c, dp_group, group, self.replicated,
                                              lambda name, p: not no_decay(name, p))
        else:
            self.optimizer = adamw(lm.named_parameters(), c)
        self.step_count = 0

    def step(self, micro_batches: list[torch.Tensor]) -> dict:
        """One optimizer step over this replica's `accumulation` micro-batches [B, T + 1] (the step's batch is every
        replica's): the step's mean loss over every replica, the gradient norm before clipping, the learning rate."""
        if len(micro_batches) != self.c.accumulation:
            raise ValueError(f"{len(micro_batches)} micro-batches for accumulation={self.c.accumulation}: give one "
                             f"per accumulation step")
        lr = learning_rate(self.step_count, self.c)
        self.lm.zero_grad(set_to_none=True)
        total = 0.0
        for ids in micro_batches:
            with torch.autocast(ids.device.type, self.autocast or torch.float32, enabled=self.autocast is not None):
                loss = (tp_loss(self.lm, ids, self.c.attention == "flash") if self.group is not None else
                        dense_loss(self.lm, ids)) / len(micro_batches)
            loss.backward()
            total += loss.item()
        if self.dp > 1:  # the step's loss over every replica, for the log (★ all-reduce [1])
            total = all_reduce_values(torch.tensor([total], dtype=torch.float64), self.dp_group, "sum",
                                      "dp/loss").item() / self.dp
        if self.c.distributed_optimizer:  # reduce-scatter, clip, AdamW on this rank's 1/dp, all-gather
            norm = self.optimizer.step(lr)
        else:
            if self.dp > 1:
                self.average_over_dp()
            norm = clip(self.lm.named_parameters(), self.c.grad_clip, self.group, self.replicated)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.step()
        self.step_count += 1
        return {"step": self.step_count, "loss": total, "grad_norm": norm.item(), "lr": lr}

    @torch.no_grad()
    def evaluate(self, rows: torch.Tensor, micro_batch_size: int) -> float:
        """The mean loss over rows [N, T + 1] (every token weighs alike), no gradient, in micro-batches."""
        total = 0.0
        for ids in rows.split(micro_batch_size):
            with torch.autocast(ids.device.type, self.autocast or torch.float32, enabled=self.autocast is not None):
                total += (tp_loss if self.group is not None else dense_loss)(self.lm, ids).item() * len(ids)
        return total / len(rows)

    def layout(self) -> dict:
        """What a checkpoint must match to be resumed here: the model, the training settings, tp, dp, the rank."""
        return {"model": self.lm.cfg.asdict(), "family": self.lm.cfg.family, "train": asdict(self.c),
                "tp": 1 if self.group is None else dist.get_world_size(self.group), "dp": self.dp,
                "rank": dist.get_rank() if dist.is_initialized() else 0}

    def save(self, directory: str | Path) -> Path:
        """This rank's slices of the weights and its optimizer state (its 1/dp with distributed_optimizer), the step
        and the layout, in directory/rank<r>.pt (every rank writes its own file)."""
        layout = self.layout()
        path = Path(directory) / f"rank{layout['rank']}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")  # written whole, then renamed: a stopped save leaves the last one
        torch.save({"layout": layout, "step": self.step_count, "model": self.lm.state_dict(),
                    "optimizer": self.optimizer.state_dict()}, partial)
        partial.replace(path)
        return path

    def load(self, directory: str | Path) -> None:
        """Resume from save()'s file of this rank: ValueError naming what differs when it was written by another
        model, settings or layout (checked on every rank before any collective of the next step)."""
        layout = self.layout()
        path = Path(directory) / f"rank{layout['rank']}.pt"
        if not path.is_file():
            raise ValueError(f"{path}: no checkpoint of rank {layout['rank']} (was it saved at tp={layout['tp']}, "
                             f"dp={layout['dp']}?)")
        saved = torch.load(path, weights_only=False)
        differ = [k for k in layout if saved["layout"].get(k) != layout[k]]
        if differ:
            raise ValueError(f"{path} was saved with another " + ", ".join(
                f"{k} ({saved['layout'].get(k)!r}, here {layout[k]!r})" for k in differ) + ": resume with the same")
        self.lm.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.step_count = saved["step"]

    def average_over_dp(self) -> None:
        """Every gradient averaged over the dp replicas, in one flat bucket (★ all-reduce [N/tp])."""
        grads = [p.grad for p in self.lm.parameters() if p.grad is not None]
        flat = all_reduce_values(torch.cat([g.reshape(-1) for g in grads]), self.dp_group, "sum", "dp/all-reduce")
        for g, part in zip(grads, torch.split(flat / self.dp, [g.numel() for g in grads])):
            g.copy_(part.view_as(g))
