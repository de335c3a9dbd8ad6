"""run_block's fourth job: what each rank holds in one block, read off the modules themselves."""

from __future__ import annotations

import torch.distributed as dist

from layers.models import families
from layers.models.llama import kv_heads_of_rank
from layers.models.tp_block import TPStack
from layers.parallel.shard import heads_of_rank
from tp.dist import TPContext

def linears(family: str) -> tuple[str, ...]:
    """A block's four linears, in forward order: Llama-family names, or GPT-2's."""
    return ("qkv", "o", "gate_up", "down") if families.family(family).llama_lm else \
        ("qkv", "attn_out", "mlp_up", "mlp_down")


def shard_rows(stack: TPStack, variant: str, ctx: TPContext) -> list[dict]:
    """What each rank holds in one block, read off the modules themselves (all-gathered)."""
    block, cfg, r, p = stack.blocks[0], stack.cfg, ctx.rank, ctx.world_size
    if variant == "intra_head":  # every head, a 1/p slice of each head's dims
        dhp = cfg.d_head // p
        mine = {"rank": r, "heads": [0, cfg.n_heads - 1], "head_dims": [r * dhp, (r + 1) * dhp - 1]}
    else:
        heads = heads_of_rank(cfg.n_heads, r, p)
        mine = {"rank": r, "heads": [heads.start, heads.stop - 1]}
    if families.of(cfg).llama_lm:  # its K,V heads: shared with p/h_kv − 1 other ranks once p > h_kv
        kv = kv_heads_of_rank(cfg, r, p)
        mine["kv_heads"] = [kv.start, kv.stop - 1]
    for name in linears(cfg.family):
        linear = getattr(block, name)
        out_f, in_f = linear.weight.shape
        mine[name] = {"kind": type(linear).__name__, "weight_in_out": [in_f, out_f]}
    rows: list = [None] * ctx.world_size
    dist.all_gather_object(rows, mine, group=ctx.group)
    return rows
