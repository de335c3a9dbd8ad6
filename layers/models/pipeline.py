"""Pipeline parallelism composed with tensor parallelism: pp stages × tp ranks (docs/background.md, PP's row).

    world rank g  ->  stage s = g // tp, TP rank r = g % tp
    stage s       =  the TP group of ranks [s·tp, (s+1)·tp): the Megatron blocks of layers stage_layers(L, pp)[s]
    pipe r        =  ranks {r, tp + r, 2·tp + r, ...}: rank r of every stage, along which the activations flow

Between stage s and s+1 the hidden states [T, d] move one way, point to point, in one of two ways:

    whole      every TP rank r of stage s sends the whole [T, d] to rank r of stage s+1
               bytes across the boundary per rank: T·d·e
    scatter    rank r sends its 1/tp of the rows (T padded up to tp·⌈T/tp⌉ with zero rows), and the receiving stage
               all-gathers them in its TP group (vLLM's way): T·d·e / tp per rank across the boundary, one more
               collective inside the stage

Every message goes into the traffic ledger as a Transfer (site "pp/boundary", `request` = the micro-batch), and
tp/traffic_model.predict_pp_stage predicts each rank's messages and collectives; the scatter mode's all-gather is an ordinary
collective ("pp/all-gather"). With tp = 1 both ways are the same message. A stage is a PPStage (the block check's,
run() drives a forward-only GPipe schedule) or, for serving, a PPLM.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from layers.models.families import of
from layers.models.llama import pad_rows
from layers.models.lm import tp_lm
from layers.models.tp_block import TPStack, tp_stack
from layers.parallel.shard import DenseSource, Part, load_plan, prefixed
from layers.sampling.sampler import SampleResult, nothing_sampled, table_width
from tp.comm import broadcast_from, gather_rows_to_parallel
from tp.dist import wait_for_stream
from tp.ledger import TransferRecord, active
from tp.partition import ceil_div

BOUNDARIES = ("whole", "scatter")
PP_VARIANTS = ("v1", "v2")  # v2sp and intra_head are refused: their stage boundary is not modelled


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """Layers per stage: L // pp each, and the L % pp left over one each to the stages just before the last (vLLM's
    rule: the last stage also holds the LM head, so it takes no extra block). pp > L is an error."""
    if not 1 <= pp <= n_layers:
        raise ValueError(f"pp={pp} must be between 1 and the model's {n_layers} layers (each stage needs a layer)")
    sizes = [n_layers // pp] * pp
    for i in range(2, n_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


@dataclass(frozen=True)
class PPLayout:
    pp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, r) for r in range(self.tp)]


def pp_layout(world_size: int, pp: int) -> PPLayout:
    """The rule "pp divides the world" (each stage a TP group of world / pp ranks), checked before any collective."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world_size % pp:
        raise ValueError(f"pp={pp!r} must divide the world of {world_size} ranks (each stage is a TP group of "
                         f"world / pp ranks)")
    return PPLayout(pp, world_size // pp)


def check_pipeline(model, world_size: int, pp: int, variant: str = "v2", vocab_parallel: bool = True) -> PPLayout:
    """Every rule of serving a model through pp stages (check_layout's, and what serving adds), checked before any
    collective; ValueError, one line."""
    if pp > 1 and not of(model).pipeline:
        raise ValueError(f"pp={pp} with an MoE model is not built: its experts are placed over the world, not one "
                         f"stage (serve it with pp=1)")
    if pp > 1 and not vocab_parallel:
        raise ValueError(f"pp={pp} with vocab_parallel=false is not built: a pipeline's first and last stages hold "
                         f"the embedding and the head vocabulary-parallel")
    return check_layout(world_size, pp, model.n_layers, variant)


def check_layout(world_size: int, pp: int, n_layers: int, variant: str) -> PPLayout:
    """The checks run before any collective: pp divides the world, pp <= L, a variant whose boundary is modelled."""
    pp_layout(world_size, pp)
    if pp > n_layers:
        raise ValueError(f"pp={pp} is more stages than the model's {n_layers} layers")
    if pp > 1 and variant not in PP_VARIANTS:
        raise ValueError(f"pp={pp} runs variant {' or '.join(PP_VARIANTS)}, not {variant!r} (its rows are cut "
                         "across the TP ranks, a stage boundary this pipeline does not model)")
    return PPLayout(pp, world_size // pp)


def new_pp_groups(layout: PPLayout) -> list[dist.ProcessGroup]:
    """Every stage's TP group, built once; every rank of the world calls this, in this order. The stage boundary's
    messages address global ranks on the default group."""
    return [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp)]


class StagePosition:
    """Where a stage sits in the pipeline: `index` of `layout.pp` stages."""

    index: int
    layout: PPLayout

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.layout.pp - 1


class PPStage(StagePosition, nn.Module):
    """This rank's part of a pp × tp pipeline: the TP blocks of its stage's layers, on its stage's TP group.

    forward(x, rows, microbatch) takes the stage's input (the stack's input on stage 0; None elsewhere: it is
    received), runs its layers, sends the last output to the next stage, and returns its layers' outputs (each
    [rows, d], replicated in the stage as in TPStack). run() drives a schedule of micro-batches."""

    def __init__(self, cfg, variant: str, layout: PPLayout, rank: int, group: dist.ProcessGroup, dtype, device,
                 boundary: str = "whole"):
        super().__init__()
        if variant not in PP_VARIANTS:  # forward runs the blocks on replicated rows, as v1 and v2 take them
            raise ValueError(f"a pipeline stage runs variant {' or '.join(PP_VARIANTS)}, not {variant!r}")
        self.cfg, self.layout, self.boundary, self.global_rank = cfg, layout, boundary, rank
        self.index, self.tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
        self.layers = stage_layers(cfg.n_layers, layout.pp)[self.index]
        self.group, self.dtype, self.device = group, dtype, device
        self.stack: TPStack = tp_stack(cfg, variant, group, dtype, device, len(self.layers))
        self.link = Boundary(cfg, layout, rank, group, dtype, device, boundary)

    def plan(self) -> list[Part]:
        """The stack's plan, its local block j named as the dense stack's block layers[j]."""
        return prefixed([renumbered(part, self.layers.start) for part in self.stack.plan()], "stack.", "")

    def forward(self, x: torch.Tensor | None, rows: int, microbatch: int = 0, received: bool = False,
                requests=None, send: bool = True) -> tuple[torch.Tensor, ...]:
        """received: x is this stage's input already (run() received it); else stages after the first receive it.
        requests: layers/attention/varlen.Requests, when x flattens several (each attends within itself). send: pass the
        last output on to the next stage (run() sends it itself, to time the compute alone)."""
        if not self.first and not received:
            x = self.link.receive(rows, microbatch)
        ledger = active()
        layer_before = ledger.layer if ledger is not None else None
        outs = []
        for j, block in enumerate(self.stack.blocks):
            if ledger is not None:
                ledger.layer = self.layers[j]
            x = block(x, requests)
            outs.append(x)
        if ledger is not None:
            ledger.layer = layer_before
        if send and not self.last:
            self.link.send(x, microbatch)
        return tuple(outs)

    def run(self, inputs: list[torch.Tensor] | None, rows: list[int],
            requests: list | None = None) -> tuple[list[tuple[torch.Tensor, ...]], dict]:
        """A forward-only GPipe schedule of len(rows) micro-batches: each stage takes micro-batch m as soon as it
        arrives, runs it, sends it on and takes m + 1, so stage s works on m while stage s + 1 works on m − 1.
        inputs: the micro-batches' stack inputs (stage 0; None elsewhere); requests: each micro-batch's
        layers/attention/varlen.Requests when it flattens several (None: one sequence each). Returns every micro-batch's layer outputs
        and this stage's timeline: per micro-batch the time from the schedule's start at which it began and ended
        its compute, the time it waited to receive its input and the time its send took (on a GPU each is
        closed by a wait for the stream, so the compute is the device's time)."""
        start, timeline, outs = time.perf_counter(), [], []
        for m, n in enumerate(rows):
            t0 = time.perf_counter()
            x = inputs[m] if self.first else self.link.receive(n, m)
            wait_for_stream(self.device)  # on a GPU: the received rows are there (a no-op on a CPU)
            t1 = time.perf_counter()
            out = self.forward(x, n, m, received=True, send=False, requests=None if requests is None else requests[m])
            wait_for_stream(self.device)  # on a GPU: its compute is done, so busy is the device's time
            t2 = time.perf_counter()
            if not self.last:
                self.link.send(out[-1], m)
            outs.append(out)
            timeline.append({"microbatch": m, "wait_s": t1 - t0, "begin_s": t1 - start, "end_s": t2 - start,
                             "send_s": time.perf_counter() - t2})
        return outs, {"stage": self.index, "total_s": time.perf_counter() - start, "microbatches": timeline}


class Boundary:
    """One rank's side of the stage boundaries: what it sends to the same TP rank of the next stage and receives
    from the previous one's, whole or scattered (the module docstring), every message ledgered."""

    def __init__(self, cfg, layout: PPLayout, rank: int, group: dist.ProcessGroup, dtype, device,
                 mode: str = "whole"):
        if mode not in BOUNDARIES:
            raise ValueError(f"boundary={mode!r}: choose {' or '.join(BOUNDARIES)}")
        self.cfg, self.layout, self.global_rank, self.group, self.dtype, self.device, self.mode = \
            cfg, layout, rank, group, dtype, device, mode
        self.index, self.tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)

    def _piece(self, rows: int) -> tuple[int, int]:
        """The rows [lo, hi) a message carries: all T (whole, or tp = 1), or this TP rank's of the padded tp·⌈T/tp⌉
        (scatter)."""
        if self.mode == "whole" or self.layout.tp == 1:
            return 0, rows
        per = ceil_div(rows, self.layout.tp)
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def send(self, x: torch.Tensor, microbatch: int, wait: bool = True):
        """wait=False: post the message and return (work, tensor), the tensor kept alive with its work until the
        caller waits on it (the serving pipeline posts a micro-batch's rows in one step, the next stage having posted
        their receive in the same step, and waits for the send in a later step)."""
        peer = self.layout.rank(self.index + 1, self.tp_rank)
        lo, hi = self._piece(x.shape[0])
        x = pad_rows(x[lo:hi], hi - lo).contiguous()  # scatter: zero rows past T
        start, work = time.perf_counter(), None
        if wait:
            dist.send(x, peer)  # ★ point to point, between stages
        else:
            work = (dist.isend(x, peer), x)  # ★ point to point, between stages (posted)
        self._record("send", x, peer, microbatch, start)
        return work

    def receive(self, rows: int, microbatch: int) -> torch.Tensor:
        """A micro-batch's rows [T, d] from the previous stage, received now."""
        return self.take(self.post_receive(rows, microbatch))

    def post_receive(self, rows: int, microbatch: int) -> "PostedReceive":
        """Post the receive of a micro-batch's rows now, take them later (take): the serving pipeline posts it in
        the step the previous stage sends them, before that step's broadcast over the world, so no send is ever
        pending across a collective without its receive posted (NCCL runs a communicator's operations in order)."""
        peer = self.layout.rank(self.index - 1, self.tp_rank)
        lo, hi = self._piece(rows)
        buf = torch.empty(hi - lo, self.cfg.d_model, dtype=self.dtype, device=self.device)
        return PostedReceive(dist.irecv(buf, peer), buf, rows, microbatch, peer, time.perf_counter())

    def take(self, posted: "PostedReceive") -> torch.Tensor:
        """A posted receive's rows [T, d]: wait for it, ledger it, and with the scatter boundary all-gather the
        stage's pieces."""
        posted.work.wait()
        self._record("recv", posted.buf, posted.peer, posted.microbatch, posted.at)
        if self.mode == "scatter" and self.layout.tp > 1:
            return gather_rows_to_parallel(posted.buf, self.group, "pp/all-gather")[:posted.rows]  # ★ all-gather
        return posted.buf

    def _record(self, kind: str, t: torch.Tensor, peer: int, microbatch: int, start: float) -> None:
        ledger = active()
        if ledger is not None:
            ledger.transfer(TransferRecord(kind, "pp/boundary", microbatch, None, self.global_rank, peer, (0, 0),
                                           tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                           t.numel() * t.element_size(), time.perf_counter() - start))


@dataclass
class PostedReceive:
    work: object  # the irecv's work
    buf: torch.Tensor  # where the rows land: [T, d], or this rank's piece with the scatter boundary
    rows: int
    microbatch: int
    peer: int
    at: float  # when it was posted (time.perf_counter())


def shard_stage(dense, variant: str, layout: PPLayout, rank: int, group: dist.ProcessGroup,
                boundary: str = "whole") -> PPStage:
    """Load dense (a DenseStack), then shard: this rank's stage, holding its TP slices of its layers' weights."""
    source = DenseSource(dense)
    stage = PPStage(dense.cfg, variant, layout, rank, group, source.dtype, source.device, boundary)
    return load_plan(stage, stage.plan(), source)


class PPLM(StagePosition, nn.Module):
    """A whole language model as pp stages × tp ranks, for serving: this rank's TP LM holding its stage's blocks, and
    on the first stage the embedding, on the last the final norm and the head (shard_pp_lm leaves the others out).

    A micro-batch goes through the stages in three calls, on every rank of the world:

        forward_stage(ids, positions, layers, microbatch)   the first stage embeds the rows, a later one receives the
                                                             hidden states [T, d] (the boundary, as PPStage's); its
                                                             blocks over its KV pool's layers; all but the last post
                                                             the result to the next stage (flush() waits for it)
        sample(x, sample_rows, sampling)                     the last stage: the head's pick, as a table [S, w] float64
                                                             (id, logit[, logprob, top ids, top logprobs])
        broadcast_tokens(table, rows, width, device)         ★ broadcast from the last stage's TP rank 0 to every rank
                                                             ("pp/tokens"): a SampleResult on every rank

    serve/pipeline.py's PipelineEngine calls them for up to pp micro-batches in flight at once; step() is the three
    of them for one iteration alone, with TPLM.step's signature and result on every rank."""

    def __init__(self, lm, layout: PPLayout, rank: int, layers: range, boundary: str = "whole", model_cfg=None,
                 world: dist.ProcessGroup | None = None):
        """world: the group of all pp · tp ranks, ranks 0 .. pp·tp − 1 of the default group (the tokens' broadcast;
        None: the default group. P/D's pipelined prefill side passes its own group)."""
        super().__init__()
        self.world = world if world is not None else dist.group.WORLD
        self.lm, self.layout, self.global_rank, self.layers = lm, layout, rank, layers
        self.index = layout.stage_of(rank)
        self.cfg = lm.cfg  # the stage's: n_layers is this stage's layer count
        self.model_cfg = model_cfg or lm.cfg  # the whole model's
        self.variant = lm.variant
        param = next(lm.parameters())
        self.link = Boundary(lm.cfg, layout, rank, lm.stack.blocks[0].group, param.dtype, param.device, boundary)
        self._posted: list = []  # sends posted and not yet waited for

    @property
    def stack(self):
        return self.lm.stack

    vocab_parallel = True  # a stage's embedding and head are vocabulary-parallel (shard_pp_lm)

    @property
    def cache_heads(self) -> int:
        return self.lm.cache_heads

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        return self.lm.cache_layout

    def forward_stage(self, ids, positions, layers, microbatch: int = 0,
                      received: PostedReceive | None = None) -> torch.Tensor:
        """received: the stage's input, its receive posted earlier (Boundary.post_receive); None: received now."""
        x = None if self.first else \
            self.link.take(received) if received is not None else self.link.receive(ids.shape[0], microbatch)
        x = self.lm.hidden(ids, positions, layers, x)  # the first stage embeds ids
        if not self.last:
            self.flush()  # the previous tick's send has been received: the next stage took it before this tick's end
            self._posted.append(self.link.send(x, microbatch, wait=False))
        return x

    def flush(self) -> None:
        """Wait for the sends posted so far (their receivers have posted their receives, or will without waiting for
        this rank)."""
        for work, _ in self._posted:
            work.wait()
        self._posted.clear()

    def sample(self, x, sample_rows, sampling=None):
        """The last stage: (the head's pick as its table, its SampleResult for the traffic model)."""
        res = self.lm.pick(x, sample_rows, sampling)
        return res.table(), res

    def broadcast_tokens(self, table: torch.Tensor | None, rows: int, width: int, device):
        """★ The last stage's table to every rank (the others pass None); a SampleResult on every rank."""
        if not rows:
            return nothing_sampled()
        if table is None:
            table = torch.empty(rows, width, dtype=torch.float64, device=device)
        return SampleResult.from_table(broadcast_from(table, self.world, self.layout.rank(self.layout.pp - 1, 0),
                                                      "pp/tokens"))

    def step(self, ids, positions, layers, sample_rows, sampling=None):
        x = self.forward_stage(ids, positions, layers)
        self.flush()
        table = self.sample(x, sample_rows, sampling)[0] if self.last and sample_rows.numel() else None
        return self.broadcast_tokens(table, sample_rows.numel(), table_width(sampling), ids.device)


def renumbered(part: Part, first: int) -> Part:
    """part, its source's block j (blocks.<j>.) renamed block first + j: a stage's block j is the model's first + j."""
    source = re.sub(r"blocks\.(\d+)\.", lambda m: f"blocks.{first + int(m.group(1))}.", part.source, count=1)
    return Part(part.param, source, part.cut, part.row)


ENDS = ("embed", "wpe", "ln_f", "norm", "head")  # an LM's modules outside its blocks (TPLM's, TPLlamaLM's)


def shard_pp_lm(weights, variant: str, layout: PPLayout, rank: int, group: dist.ProcessGroup,
                boundary: str = "whole", world: dist.ProcessGroup | None = None) -> PPLM:
    """This rank's PPLM, its stage's blocks (and the embedding on the first stage, the final norm and head on the
    last), each cut over the stage's TP group: from a dense LM (DenseLM or DenseLlamaLM: load, then shard) or a Source (layers/models/hf.CheckpointSource: the rank reads only
    its stage's slices of the files), as layers/models/lm.shard_lm."""
    source = weights if hasattr(weights, "fill") else DenseSource(weights)
    cfg = source.cfg
    stage = layout.stage_of(rank)
    layers = stage_layers(cfg.n_layers, layout.pp)[stage]
    lm = tp_lm(replace(cfg, n_layers=len(layers)), variant, group, True, source.dtype, source.device)
    llama, keep = of(cfg).llama_lm, {"stack"}
    if stage == 0:  # the token embedding (and GPT-2's learned positions)
        keep |= {"embed"} if llama else {"embed", "wpe"}
    if stage == layout.pp - 1:  # the final norm and the head (GPT-2's head is its token embedding, as a tied one is)
        keep |= ({"norm", "head"} | ({"embed"} if cfg.tie_word_embeddings else set())) if llama else {"ln_f", "embed"}
    full = lm.plan()
    for name in ENDS:  # the ends this stage does not hold: never loaded, their memory given back
        if name not in keep and getattr(lm, name, None) is not None:
            setattr(lm, name, None)
    plan = [renumbered(part, layers.start) if part.param.startswith("stack.blocks.") else part
            for part in full if part.param.split(".", 1)[0] in keep]
    try:
        return PPLM(load_plan(lm, plan, source), layout, rank, layers, boundary, cfg, world)
    finally:
        getattr(source, "close", lambda: None)()
