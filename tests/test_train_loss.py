"""train/loss.py's vocab-parallel cross-entropy against torch's cross_entropy on the whole rows (float64): the loss,
the gradient of every rank's logit slice, and the collectives it issues (three all-reduces of [n] forward, none
backward)."""

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_ranks

V, D, N = 37, 16, 11  # a vocabulary that p = 2 and 4 do not divide: the last slice holds padding ids


def _draw(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def check_loss(ctx):
    from layers.parallel.vocab import VocabParallelEmbedding
    from tp.ledger import TrafficLedger
    from train.loss import vocab_parallel_cross_entropy

    weight, x = _draw(1, V, D), _draw(2, N, D)
    x[:3] *= 300  # logits in the thousands: exp overflows unless each row is shifted by its true max
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    # the first and the last id, and the first id of every rank's slice at p = 2 (19) and p = 4 (10, 20, 30)
    targets[:6] = torch.tensor([0, V - 1, 19, 10, 20, 30])
    upstream = _draw(4, N)
    # the oracle: the whole rows on one device
    whole = (x @ weight.T).requires_grad_()
    want = F.cross_entropy(whole, targets, reduction="none")
    want.backward(upstream)
    # this rank's slice, as the tied head gives it (padding ids -inf)
    head = VocabParallelEmbedding(V, D, ctx.group, torch.float64).load_dense(weight)
    local = head.local_logits(x).detach().requires_grad_()
    ledger = TrafficLedger(ctx.world_size)
    with ledger.recording():
        got = vocab_parallel_cross_entropy(local, targets, head.start, ctx.group)
        got.backward(upstream)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    real = slice(0, head.n_real)
    torch.testing.assert_close(local.grad[:, real], whole.grad[:, head.start:head.start + head.n_real], rtol=1e-12,
                               atol=1e-12)
    assert torch.all(local.grad[:, head.n_real:] == 0)  # padding ids get no gradient
    return [(r.kind, r.phase, r.shape, r.site) for r in ledger.records]


@pytest.mark.parametrize("p", [1, 2, 4])
def test_vocab_parallel_cross_entropy_equals_the_whole_rows(p):
    for records in run_ranks(p, check_loss):
        expected = [] if p == 1 else [("all_reduce", "forward", (N,), site)
                                      for site in ("all-reduce max", "all-reduce sum", "all-reduce target")]
        assert [(k, ph, sh, site) for k, ph, sh, site in records] == expected, records
