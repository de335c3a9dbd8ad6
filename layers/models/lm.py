"""The whole language model, of either block family.

    GPT-2   ids [T] -> wte[ids] + wpe[positions] -> L blocks -> ln_f -> x @ wteᵀ -> logits [T, V]   (tied head)
    Llama   ids [T] -> embed[ids] -> L blocks (RoPE inside) -> RMSNorm -> x @ lm_headᵀ -> logits     (own head, or tied)

DenseLM   the single-device model, and the serving oracle: `logits` recomputes a whole
          sequence without any cache; `greedy_reference` generates by recomputing every step.
TPLM      the same weights on p ranks: vocab-parallel (or replicated) embedding and head
          (layers/parallel/vocab.py), the v1 or v2 stack, and this rank's paged K,V pool handed in by the
          engine. `step` runs one serving iteration of flat rows and returns the tokens picked
          (greedy, or sampled: layers/sampling/sampler.py) for the rows asked for; the full logits are never formed.
DenseLlamaLM, TPLlamaLM   the same for Llama-family models (layers/models/llama.py): v2 blocks, the embedding and the
          head (separate, or tied) both vocab-parallel, caches of this rank's K,V heads only (`cache_heads`).
`shard_lm` shards either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from layers.attention.attention import PagedLayer
from layers.models.config import SERVING_VARIANTS, ModelConfig
from layers.models.dense import DenseStack
from layers.models.families import of
from layers.models.llama import LlamaConfig, RMSNorm
from layers.models.tp_block import TPStack, tp_stack
from layers.parallel.shard import DenseSource, Part, Source, load_plan, prefixed, whole
from layers.parallel.vocab import ReplicatedEmbedding, VocabParallelEmbedding
from layers.sampling.sampler import SampleResult, SamplingBatch, nothing_sampled, sample


class DenseLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model, **kw)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model, **kw)
        self.stack = DenseStack(cfg, dtype, device)
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, V]
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[0], device=ids.device))
        x = self.stack(x)[-1]
        return F.linear(self.ln_f(x), self.wte.weight)  # the head is tied to the token embedding


@dataclass
class Greedy:
    """What the oracle generated: ids, the logit of each, and its margin over the runner-up."""

    ids: list[int]
    logits: list[float]
    margins: list[float]  # top-1 minus top-2 logit: a near-tie if this is within rounding


class DenseLlamaLM(nn.Module):
    """The single-device Llama LM: embed -> L blocks -> RMSNorm -> lm_head (the embedding's parameter when
    cfg.tie_word_embeddings). The serving oracle."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=dtype, device=device)
        self.stack = DenseStack(cfg, dtype, device)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype, device)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight  # one parameter

    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, V], no cache; positions 0 .. n-1
        return self.lm_head(self.norm(self.stack(self.embed(ids))[-1]))


def dense_lm(cfg: ModelConfig | LlamaConfig, dtype: torch.dtype = torch.float32, device=None) -> nn.Module:
    """The single-device LM of cfg's block family."""
    return (DenseLlamaLM if of(cfg).llama_lm else DenseLM)(cfg, dtype, device)


@torch.no_grad()
def _generate(lm: DenseLM | DenseLlamaLM, prompt: list[int], steps: int, eos_id, pick) -> Greedy:
    """With no cache at all: every step runs the whole sequence so far through the model and appends what
    pick(the last row's logits [1, V], its position among the outputs) returns: (token, its logit, its margin)."""
    stops = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    device = next(lm.parameters()).device
    tokens, out = list(prompt), Greedy([], [], [])
    for position in range(steps):
        token, logit, margin = pick(lm.logits(torch.tensor(tokens, device=device))[-1:], position)
        out.ids.append(token)
        out.logits.append(logit)
        out.margins.append(margin)
        tokens.append(token)
        if token in stops:
            break
    return out


def greedy_reference(lm: DenseLM, prompt: list[int], max_new_tokens: int, eos_id=None) -> Greedy:
    """Greedy decoding with no cache at all: every step runs the whole sequence so far through the model. eos_id: an
    id, or the ids, that end it."""
    def pick(z: torch.Tensor, position: int) -> tuple[int, float, float]:
        top, token = z[0].topk(2).values, int(z[0].argmax())
        return token, float(z[0, token]), float(top[0] - top[1])

    return _generate(lm, prompt, max_new_tokens, eos_id, pick)


def sampled_reference(lm: DenseLM | DenseLlamaLM, prompt: list[int], params, seed: int, eos_id=None) -> Greedy:
    """The oracle of a sampled request: the same sampler (layers/sampling/sampler.py) on the dense logits, recomputed
    with no cache every step, with the request's noise (seed, position). margins: each step's lead in the race."""
    def pick(z: torch.Tensor, position: int) -> tuple[int, float, float]:
        batch = SamplingBatch.build([(params.temperature, params.top_k, params.top_p, params.min_p, seed, position)],
                                    -1, z.device)
        res = sample(z, 0, None, batch, lm.cfg.vocab_size)
        margin = float(res.margin[0]) if res.margin is not None else float(z.topk(2).values.diff().abs())
        return int(res.tokens[0]), float(res.logits[0]), margin

    return _generate(lm, prompt, params.max_tokens, eos_id, pick)


# a top-1/top-2 margin this small (relative to the logit) is a near-tie: rounding may pick either
NEAR_TIE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def oracle_verdict(got: list[int], got_logits: list[float], ref: Greedy, near_tie: float) -> dict:
    """Served tokens against an oracle's: "match", "near-tie" (they part where the oracle's top two were within
    near_tie: rounding picked the other), or "MISMATCH"; with the largest relative logit error before they part."""
    want = ref.ids
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    upto = len(got) if same is None else same
    rel = [abs(a - b) / max(abs(b), 1e-300) for a, b in zip(got_logits[:upto], ref.logits[:upto])]
    out = {"oracle_ids": want, "max_logit_rel_err": max(rel, default=0.0)}
    if same is None and len(got) == len(want):
        out["verdict"] = "match"
    elif same is not None and ref.margins[same] <= near_tie * max(1.0, abs(ref.logits[same])):
        out["verdict"], out["first_difference"] = "near-tie", same
    else:
        out["verdict"], out["first_difference"] = "MISMATCH", upto
    out["ok"] = out["verdict"] != "MISMATCH"
    return out


class TPLM(nn.Module):
    def __init__(self, cfg: ModelConfig, variant: str, embed: nn.Module, wpe: nn.Embedding, stack: TPStack,
                 ln_f: nn.LayerNorm):
        super().__init__()
        self.cfg, self.variant = cfg, variant  # variant: "v1" or "v2", the blocks of `stack`
        self.embed = embed  # VocabParallelEmbedding or ReplicatedEmbedding, also the LM head
        self.wpe = wpe  # positions: small, replicated
        self.stack = stack
        self.ln_f = ln_f

    @property
    def vocab_parallel(self) -> bool:
        return isinstance(self.embed, VocabParallelEmbedding)

    def plan(self) -> list[Part]:
        """This rank's slices of the dense DenseLM's parameters (layers/parallel/shard.py): its vocabulary rows of wte
        (or all of it), the replicated wpe and ln_f, and the stack's."""
        return (prefixed(self.embed.plan("wte.weight"), "embed.", "") + whole("wpe.weight", "ln_f.weight", "ln_f.bias")
                + prefixed(self.stack.plan(), "stack."))

    @property
    def cache_heads(self) -> int:
        """K,V heads per layer in this rank's cache: its h/p heads."""
        return self.cfg.n_heads // dist.get_world_size(self.stack.blocks[0].group)

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, width) of each layer's cache on this rank (serve/kv_cache.KVPool.for_model)."""
        return 2, self.cache_heads, self.cfg.d_head

    def step(self, ids: torch.Tensor, positions: torch.Tensor, layers: list[PagedLayer],
             sample_rows: torch.Tensor, sampling: SamplingBatch | None = None) -> SampleResult:
        """One iteration. ids, positions: [T]; the tokens picked for sample_rows [S] (greedy without `sampling`),
        the same on every rank."""
        return self.pick(self.hidden(ids, positions, layers), sample_rows, sampling)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, layers: list[PagedLayer],
               x: torch.Tensor | None = None) -> torch.Tensor:
        """The model's one forward over the paged cache, [T, d] before the final norm: what `step` picks from, the
        verifier's and the draft's rows (serve/model_runner.py, serve/draft.py) and a pipeline stage's part
        (layers/models/pipeline.py). Block i attends with layers[i]; x: a stage's received hidden states (ids are then
        not embedded)."""
        x = self.embed_rows(ids, positions) if x is None else x
        for block, cached in zip(self.stack.blocks, layers, strict=True):
            x = block(x, cached)  # ★ v2: 2 all-reduces [T, d] per layer; v1: 4 all-gathers
        return x

    def embed_rows(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.wpe(positions)  # ★ vocab-parallel: all-reduce [T, d]

    def pick(self, x: torch.Tensor, sample_rows: torch.Tensor, sampling: SamplingBatch | None) -> SampleResult:
        """The tokens of rows sample_rows of the stack's output x [T, d]."""
        if sample_rows.numel() == 0:  # only prompt chunks that do not finish their prompt: nothing to sample
            return nothing_sampled()
        # ★ vocab-parallel: greedy, an all-gather of (max, argmax) pairs [S, 2] per rank (sampling:
        # layers/sampling/sampler.py)
        return sample(*self.head_logits(x, sample_rows), sampling, self.cfg.vocab_size)

    def head_logits(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup | None]:
        """Rows `rows` of the stack's output through the final norm and this rank's slice of the head: (logits
        [S, V'/p], the slice's first id, the head's group). LayerNorm is per row, so only these rows need it."""
        return self.embed.local_logits(self.ln_f(x[rows])), self.embed.start, self.embed.head_group

    @property
    def output_embedding(self) -> nn.Module:
        """The LM head: the token embedding, tied (train/step.py's loss reads the head and final_norm)."""
        return self.embed

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class TPLlamaLM(nn.Module):
    """The Llama LM on p ranks: vocab-parallel embedding and LM head, v2 Llama blocks, per-rank caches of this
    rank's K,V heads (replicated on p/h_kv ranks once p > h_kv). `step` is one serving iteration, as TPLM's."""

    variant = "v2"
    vocab_parallel = True

    def __init__(self, cfg: LlamaConfig, embed: VocabParallelEmbedding, stack: TPStack, norm: RMSNorm,
                 head: VocabParallelEmbedding):
        super().__init__()
        self.cfg, self.embed, self.stack, self.norm, self.head = cfg, embed, stack, norm, head

    @property
    def cache_heads(self) -> int:
        """K,V heads per layer in this rank's cache: max(h_kv/p, 1) (MLA: its one latent "head")."""
        return self.cache_layout[1]

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, width): K and V of max(h_kv/p, 1) heads of d_head; MLA (family deepseek_v3): one plane,
        one latent of c + r, on every rank."""
        block = self.stack.blocks[0]
        return block.cache_layout if hasattr(block, "cache_layout") else (2, block.kv_heads, self.cfg.d_head)

    def plan(self) -> list[Part]:
        """This rank's slices of the dense DenseLlamaLM's parameters: its vocabulary rows of the embedding and of the
        head (none of its own when tied), the replicated final norm, and the stack's."""
        head = [] if self.head is self.embed else prefixed(self.head.plan("lm_head.weight"), "head.", "")
        return (prefixed(self.embed.plan("embed.weight"), "embed.", "") + head + whole("norm.weight")
                + prefixed(self.stack.plan(), "stack."))

    step = TPLM.step  # embed_rows, the stack over the paged cache (★ 2 all-reduces [T, d] per layer), pick
    hidden = TPLM.hidden
    pick = TPLM.pick  # ★ greedy: an all-gather of (max, argmax) pairs [S, 2] per rank, from head_logits' slice

    def embed_rows(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)  # ★ all-reduce [T, d]; positions enter in every block (RoPE)

    def head_logits(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup | None]:
        """As TPLM.head_logits: the final RMSNorm, then this rank's slice of the head."""
        return self.head.local_logits(self.norm(x[rows])), self.head.start, self.head.head_group

    @property
    def output_embedding(self) -> nn.Module:
        """The LM head: its own, or the token embedding when tied."""
        return self.head

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def shard_lm(weights: DenseLM | DenseLlamaLM | Source, variant: str, group: dist.ProcessGroup,
             vocab_parallel: bool = True, moe_parallel: str = "tp") -> TPLM | TPLlamaLM:
    """This rank's TPLM (or TPLlamaLM), holding its slices of the weights: a dense LM (load dense, then shard) or a
    Source with cfg, dtype and device (layers/models/hf.CheckpointSource: each rank reads only its slices of the files).
    moe_parallel: an MoE model's placement of its experts (tp or ep; layers/models/moe.py)."""
    source = weights if hasattr(weights, "fill") else DenseSource(weights)
    lm = tp_lm(source.cfg, variant, group, vocab_parallel, source.dtype, source.device, moe_parallel)
    try:
        return load_plan(lm, lm.plan(), source)
    finally:
        getattr(source, "close", lambda: None)()  # a checkpoint's source: release a mapped .bin file


def tp_lm(cfg: ModelConfig | LlamaConfig, variant: str, group: dist.ProcessGroup, vocab_parallel: bool = True,
          dtype: torch.dtype = torch.float32, device=None, moe_parallel: str = "tp") -> TPLM | TPLlamaLM:
    """The TP LM of cfg's family, its parameters not yet loaded (load_plan fills them from its plan). An MoE model
    is a TPLlamaLM whose blocks route their FFN (tp: experts split; ep: whole experts per rank)."""
    if variant not in SERVING_VARIANTS:
        raise ValueError(f"serving runs variant v1 or v2, not {variant!r}")
    kw = dict(dtype=dtype, device=device)
    stack = tp_stack(cfg, variant, group, dtype, device, moe_parallel=moe_parallel)
    if of(cfg).llama_lm:
        if variant != "v2" or not vocab_parallel:
            raise ValueError("Llama-family models are served with variant v2 and a vocab-parallel embedding and head")
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group, **kw)
        head = embed if cfg.tie_word_embeddings else VocabParallelEmbedding(  # only its local_logits() is used
            cfg.vocab_size, cfg.d_model, group, **kw)
        return TPLlamaLM(cfg, embed, stack, RMSNorm(cfg.d_model, cfg.norm_eps, **kw), head)
    embed = (VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, group, **kw) if vocab_parallel
             else ReplicatedEmbedding(cfg.vocab_size, cfg.d_model, **kw))
    return TPLM(cfg, variant, embed, nn.Embedding(cfg.max_seq_len, cfg.d_model, **kw), stack,
                nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, **kw))
