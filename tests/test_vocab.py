"""Vocab-parallel embedding and greedy LM head against the dense lookup and torch.argmax over full logits."""

import pytest
import torch

from layers.parallel.vocab import ReplicatedEmbedding, VocabParallelEmbedding, padded_vocab
from tests.harness import run_ranks

V, D = 37, 16  # 37 is prime: padded at every p > 1


def pick(emb, x):
    """The greedy pick (layers/sampling/sampler.py) on an embedding's tied head."""
    from layers.sampling.sampler import greedy_pick

    return greedy_pick(emb.local_logits(x), emb.start, emb.head_group)


def dense_table():
    return torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def check_lookup_and_greedy(ctx):
    w = dense_table().to(ctx.device)
    emb = VocabParallelEmbedding(V, D, ctx.group, torch.float64, ctx.device).load_dense(w)
    assert emb.weight.shape == (padded_vocab(V, ctx.world_size) // ctx.world_size, D)
    ids = torch.tensor([0, 36, 5, 18, 19, 36, 0, 9], device=ctx.device)
    with torch.no_grad():
        assert torch.equal(emb(ids), w[ids])  # zero rows elsewhere, summed once: exact
        x = torch.randn(6, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(ctx.device)
        tokens, logits = pick(emb, x)
        full = x @ w.t()  # [6, V]
        assert torch.equal(tokens, full.argmax(-1))
        # a slice's matmul may round differently in the last bit than the full one
        torch.testing.assert_close(logits, full.gather(1, tokens[:, None])[:, 0], rtol=1e-13, atol=0)
    return tokens.tolist()


@pytest.mark.nccl
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_vocab_parallel_matches_dense(p):
    results = run_ranks(p, check_lookup_and_greedy)
    assert all(r == results[0] for r in results)


def check_ties_and_padding(ctx):
    """Ties across rank boundaries go to the lowest id; padded ids (logit 0 if unmasked) never win."""
    w = dense_table().to(ctx.device)
    w[30] = w[3]  # ids 3 and 30 (different ranks at p >= 2) give equal logits
    w[31] = w[3]
    emb = VocabParallelEmbedding(V, D, ctx.group, torch.float64, ctx.device).load_dense(w)
    x = w[3][None].clone()  # the row whose best logit is the tied one
    # Every real logit negative: an unmasked padding id (a zero row, logit 0) would win.
    w2 = dense_table().to(ctx.device)
    w2[:, 0] = -(w2[:, 0].abs() + 0.1)
    neg = torch.zeros(1, D, dtype=torch.float64, device=ctx.device)
    neg[0, 0] = 1.0
    emb2 = VocabParallelEmbedding(V, D, ctx.group, torch.float64, ctx.device).load_dense(w2)
    with torch.no_grad():
        return pick(emb, x)[0].item(), pick(emb2, neg)[0].item(), int(w2[:, 0].argmax())


@pytest.mark.nccl
@pytest.mark.parametrize("p", [2, 8])
def test_ties_go_to_the_lowest_id_and_padding_never_wins(p):
    assert padded_vocab(V, p) > V
    for tied, padded_winner, reference in run_ranks(p, check_ties_and_padding):
        assert tied == 3
        assert padded_winner == reference


def only_padding(ctx):
    """V = 5 on 4 ranks: V' = 8, rank 2 holds id 4 and a padding row, rank 3 holds nothing but padding."""
    w = torch.randn(5, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(ctx.device)
    emb = VocabParallelEmbedding(5, D, ctx.group, torch.float64, ctx.device).load_dense(w)
    x = -w.sum(0, keepdim=True)  # mostly negative logits: an unmasked padding row (logit 0) would win
    with torch.no_grad():
        ids = torch.arange(5, device=ctx.device)
        return emb.n_real, torch.equal(emb(ids), w), pick(emb, x)[0].item(), int((x @ w.t()).argmax())


def test_a_rank_holding_only_padding():
    results = run_ranks(4, only_padding)
    assert [r[0] for r in results] == [2, 2, 1, 0]
    for _, lookup_ok, got, want in results:
        assert lookup_ok and got == want


def test_replicated_matches_dense():
    w = dense_table()
    emb = ReplicatedEmbedding(V, D, torch.float64).load_dense(w)
    x = torch.randn(3, D, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(pick(emb, x)[0], (x @ w.t()).argmax(-1))


def test_padded_vocab():
    assert [padded_vocab(50257, p) for p in (1, 2, 4, 8)] == [50257, 50258, 50260, 50264]
