"""run_block's fifth job: the activation memory autograd keeps for backward, per layer on each rank, measured.

Every tensor a block's forward saves for its backward passes through torch.autograd.graph.saved_tensors_hooks;
its storage is counted once per layer (views such as q, k, v of one qkv output share it), the parameters'
storages are not counted (they are weights, not activations). tp/memory_model.py predicts the same bytes from
the shapes alone.
"""

from __future__ import annotations

import torch

from layers.models.tp_block import TPStack


def saved_bytes_per_layer(stack: TPStack, x: torch.Tensor) -> list[int]:
    """Bytes of activations saved for backward by each block of `stack` on this rank, for one sequence x [n, d]."""
    params = {p.untyped_storage().data_ptr() for p in stack.parameters()}
    n = x.shape[0]
    current: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            current.setdefault(storage.data_ptr(), storage.nbytes())
        # Detached: the same storage without its grad_fn. Kept as it is, a saved output would hold the very node
        # that saves it, a cycle through C++ that Python's collector cannot see: the graph (and the process group
        # its nodes hold) would live until interpreter teardown.
        return t.detach()

    out = []
    with torch.enable_grad():
        h = stack.enter(x.detach().clone().requires_grad_())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for block in stack.blocks:
                current.clear()
                h = stack.layer(block, h, None, n)
                out.append(sum(current.values()))
    return out
