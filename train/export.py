"""A trained model out of the TP stack: its slices gathered into the dense model, and that written in transformers'
save_pretrained layout (which transformers, `LLM` and the server read as any other checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from layers.models.families import of
from layers.models.lm import dense_lm


@torch.no_grad()
def gather_dense(lm, group: dist.ProcessGroup):
    """The dense LM from every rank's slices, on every rank: each rank's plan (the one the engine loads with) says
    which rows of which dense tensor each of its rows holds; this is its inverse. Replicated tensors are written by
    every rank alike; padding rows are dropped. One gather of the ranks' parameters (control plane, not ledgered)."""
    mine = (lm.plan(), {name: p.detach().cpu() for name, p in lm.named_parameters()})
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    dtype = next(lm.parameters()).dtype
    dense = dense_lm(lm.cfg, dtype, "cpu")
    target = dict(dense.named_parameters())
    for plan, params in every:
        for part in plan:
            if part.source is None:  # the vocabulary's padding rows
                continue
            whole = target[part.source]
            n = part.cut.shape(tuple(whole.shape))[0]
            rows = params[part.param].narrow(0, part.row, n)
            if part.cut.ranges is None:
                whole.copy_(rows)
                continue
            pieces = torch.split(rows, [b - a for a, b in part.cut.ranges], dim=part.cut.dim)
            for (a, b), piece in zip(part.cut.ranges, pieces):
                whole.narrow(part.cut.dim, a, b - a).copy_(piece)
    return dense


def save_pretrained(dense, directory: str | Path, tokenizer=None) -> Path:
    """Write the dense LM (and the tokenizer, if given) in transformers' layout: its family's config and checkpoint
    keys (layers/models/families.py: hf_config, names), weights transposed where transformers stores them so."""
    import transformers

    cfg = dense.cfg
    family = of(cfg)
    if family.hf_config is None:
        raise ValueError(f"{family.title} models are not exported yet")
    dtype = next(dense.parameters()).dtype
    eos = None if tokenizer is None else tokenizer.eos_token_id  # without a tokenizer: none (not GPT-2's 50256)
    config = family.hf_config(cfg, bos_token_id=eos, eos_token_id=eos)
    hf = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    keys = family.names(cfg, hf.state_dict(), cfg.n_layers, True)  # our parameter -> (its keys, transposed?)
    state = {}
    for ours, (theirs, transposed) in keys.items():
        t = dense.get_parameter(ours).detach()
        t = t.t().contiguous() if transposed else t
        state.update(zip(theirs, t.chunk(len(theirs), dim=0)))  # several keys: their rows, stacked (gate_up)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    left = [k for k in missing if k != "lm_head.weight"]  # the head is tied to the token embedding
    if left or unexpected:
        raise ValueError(f"export to transformers: missing {left}, unexpected {unexpected}")
    directory = Path(directory)
    transformers.utils.logging.disable_progress_bar()
    hf.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
