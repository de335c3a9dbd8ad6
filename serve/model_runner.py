"""Turns one iteration's plan into tensors and runs it through this rank's TP model: nano-vllm's ModelRunner.

    runner = ModelRunner(lm, ctx, num_blocks, block_size, attention)   # allocates this rank's KV pool, once
    tokens, logits = runner.run(plan, tokens_of)                        # [S] ids and their logits, every rank

It owns the rank's KV pool (serve/kv_cache.py: K,V of the rank's own heads, one tensor), builds the step's
inputs once per iteration (serve/inputs.py: ids, positions, slot mapping, block tables, attention groups; one
host-to-device copy) and calls the model's `step` (layers/lm.py: embedding, the stack over the paged cache, the
vocab-parallel head's pick). The results stay on the device: reading them is the engine's one wait per step.
"""

from __future__ import annotations

import torch

from layers.lm import TPLM, TPLlamaLM
from layers.sampler import SampleResult, SamplingBatch
from serve.inputs import prepare_step
from serve.kv_cache import KVPool
from serve.plan import IterationPlan
from tp.dist import TPContext


class ModelRunner:
    def __init__(self, lm: TPLM | TPLlamaLM, ctx: TPContext, num_blocks: int, block_size: int, attention: str):
        self.lm, self.ctx, self.block_size, self.attention = lm, ctx, block_size, attention
        self.dtype = next(lm.parameters()).dtype
        cfg = lm.cfg
        # K,V heads this rank caches: h/p (GPT-2), max(h_kv/p, 1) (Llama's grouped-query attention)
        self.cache = KVPool(cfg.n_layers, num_blocks, block_size, lm.cache_heads, cfg.d_head, self.dtype, ctx.device)

    @torch.no_grad()
    def run(self, plan: IterationPlan, tokens_of: dict[int, list[int]],
            sampling: SamplingBatch | None = None) -> SampleResult:
        """tokens_of: request id -> its tokens (prompt + output so far); sampling: the sampled rows' parameters (None:
        greedy). Returns the sampled rows' tokens and their logits (and logprobs when asked), on the device."""
        step = prepare_step(plan, tokens_of, self.block_size, self.ctx.device, self.attention)
        return self.lm.step(step.ids, step.positions, self.cache.layers(step.batch), step.sample_rows, sampling)
