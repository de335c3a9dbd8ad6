"""Many requests in one forward: flat tokens + cu_seqlens through the dense and the TP stacks."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from layers.attention.attention import causal_attention
from layers.attention.varlen import Requests, check_cu_seqlens, check_same_on_every_rank, score_entries
from layers.models.tp_block import shard_stack
from tests.common import SMALL, collective_counts, dense_and_input, rel_err
from tests.harness import run_ranks
from tp.dist import ConfigError
from tp.ledger import TrafficLedger
from tp.traffic_model import predict
from layers.models.config import VARIANTS


def random_lengths(seed: int, count: int, longest: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=gen).tolist()
    return lengths + [1]  # always one single-token request


def cu_of(lengths):
    return Requests.from_lengths(lengths).cu_seqlens


def check_per_request(ctx, variant, lengths, dtype=torch.float64):
    cu = cu_of(lengths)
    dense, x = dense_and_input(SMALL, dtype, cu[-1])
    stack = shard_stack(dense, variant, ctx.group)
    with torch.no_grad():
        out = stack(x, torch.tensor(cu, dtype=torch.int32))
        worst = 0.0
        for s, e in zip(cu[:-1], cu[1:]):
            alone = dense(x[s:e])  # that request alone through the single-device stack
            for layer_out, ref in zip(out, alone):
                err = rel_err(layer_out[s:e], ref)
                assert err < 1e-12, (variant, (s, e), err)
                worst = max(worst, err)
    return worst


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("p", [1, 2, 4])
def test_each_request_matches_running_it_alone(p, variant):
    run_ranks(p, check_per_request, variant, [10, 30])


def check_random_mixes(ctx):
    for seed in range(4):
        for variant in ("v1", "v2"):
            check_per_request(ctx, variant, random_lengths(seed, count=1 + seed * 3, longest=24))
        check_per_request(ctx, "v2", [1, 1, 1])  # nothing but single-token requests
    return True


@pytest.mark.parametrize("p", [2, 4])
def test_random_request_mixes(p):
    run_ranks(p, check_random_mixes)


def check_no_leakage(ctx, variant):
    lengths = [7, 12, 5]
    cu = cu_of(lengths)
    dense, x = dense_and_input(SMALL, torch.float32, cu[-1])
    stack = shard_stack(dense, variant, ctx.group)
    y = x.clone()
    y[7:19] += torch.randn(12, SMALL.d_model, generator=torch.Generator().manual_seed(5))  # request 1 only
    with torch.no_grad():
        a, b = stack(x, cu)[-1], stack(y, cu)[-1]
        da, db = dense(x, cu)[-1], dense(y, cu)[-1]
    for out_x, out_y in ((a, b), (da, db)):
        assert torch.equal(out_x[:7], out_y[:7]) and torch.equal(out_x[19:], out_y[19:])
        assert not torch.allclose(out_x[7:19], out_y[7:19])


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_cross_request_leakage(variant):
    run_ranks(2, check_no_leakage, variant)


def count_collectives(ctx, lengths):
    dense, x = dense_and_input(SMALL, torch.float32, sum(lengths))
    stack = shard_stack(dense, "v2", ctx.group)
    with CommDebugMode() as comm, torch.no_grad():
        stack(x, cu_of(lengths))
    return [collective_counts(comm.comm_module_counts[f"TPStack.blocks.{i}"]["forward"]) for i in range(SMALL.n_layers)]


def test_collective_count_does_not_depend_on_the_number_of_requests():
    for lengths in ([40], [10, 30], [4] * 10, [1] * 40):
        assert run_ranks(2, count_collectives, lengths)[0] == [{"all_reduce": 2}] * SMALL.n_layers, lengths


def check_bytes_and_model(ctx, variant, lengths):
    dense, x = dense_and_input(SMALL, torch.float32, sum(lengths))
    stack = shard_stack(dense, variant, ctx.group)
    ledger = TrafficLedger(ctx.world_size)
    x.requires_grad_()
    with ledger.attach(stack):
        stack(x, cu_of(lengths))[-1].sum().backward()
    for phase in ("forward", "backward"):
        seen = sorted((r.traffic() for r in ledger.records if r.phase == phase), key=repr)
        assert seen == sorted(predict(SMALL, ctx.world_size, sum(lengths), torch.float32, variant, phase, lengths),
                              key=repr)
    return sum(r.bytes_per_rank for r in ledger.records if r.phase == "forward")


def test_bytes_grow_with_total_tokens_and_match_the_model():
    v2 = {T: run_ranks(2, check_bytes_and_model, "v2", [T // 4] * 4)[0] for T in (8, 16, 32)}
    assert v2[16] == 2 * v2[8] and v2[32] == 2 * v2[16]  # ∝ T, whatever the split into requests
    assert run_ranks(2, check_bytes_and_model, "v2", [30, 2])[0] == v2[32]
    # intra_head's scores are Σ Lᵢ² per head: [16, 16] sends less than [32]
    split, whole = (run_ranks(2, check_bytes_and_model, "intra_head", lengths)[0] for lengths in ([16, 16], [32]))
    assert whole - split == 2 * (1 / 2) * SMALL.n_heads * (32 ** 2 - 2 * 16 ** 2) * 4 * SMALL.n_layers


# ---- bad cu_seqlens ------------------------------------------------------------------------------

BAD = [
    (torch.tensor([0.0, 10.0, 40.0]), "must be an integer tensor"),
    (torch.tensor([[0, 10, 40]]), "one-dimensional"),
    ([0], "at least two entries"),
    ([1, 10, 40], "must start at 0"),
    ([0, 10, 10, 40], "strictly increasing"),
    ([0, 30, 10, 40], "strictly increasing"),
    ([0, 10, 39], "must end at the number of tokens 40"),
    ([0, 10, 41], "must end at the number of tokens 40"),
    ([0, 10, 1040], "more than max_seq_len=1024"),
]


@pytest.mark.parametrize("cu,message", BAD, ids=[m for _, m in BAD])
def test_bad_cu_seqlens_local_checks(cu, message):
    n = 1040 if message.startswith("more than") else 40
    with pytest.raises(ConfigError, match=message):
        check_cu_seqlens(cu, n, max_seq_len=1024)


def check_bad_input_fails_everywhere(ctx):
    dense, x = dense_and_input(SMALL, torch.float32, 40)
    stack = shard_stack(dense, "v2", ctx.group)
    errors = []
    for cu, _ in BAD[:-1]:
        try:
            stack(x, cu)  # validated before the first block, i.e. before any collective
        except ConfigError as exc:
            errors.append(str(exc))
    mine = (0, 10, 40) if ctx.rank == 0 else (0, 20, 40)  # ranks disagree
    try:
        check_same_on_every_rank(mine, ctx.group)
    except ConfigError as exc:
        errors.append(str(exc))
    check_same_on_every_rank((0, 10, 40), ctx.group)  # agreeing ranks pass
    return errors


def test_bad_cu_seqlens_fail_on_every_rank_without_a_hang():
    results = run_ranks(4, check_bad_input_fails_everywhere, timeout=120)
    for errors in results:
        assert len(errors) == len(BAD) - 1 + 1
        assert "cu_seqlens differ between ranks" in errors[-1]


# ---- attention work: Σ Lᵢ², never the cross-request blocks ------------------------------------------


def test_score_entries_match_the_seed():
    assert score_entries([10, 30], "varlen") == 1000
    assert score_entries([10, 30], "flat_masked") == 1600  # seeds/04 §6: the full 40x40, masked
    assert score_entries([10, 30], "padded") == 1800  # seeds/04 §3: [2 x 30], A padded from 10 to 30
    assert score_entries([1000], "varlen") == 10**6
    assert score_entries([100] * 10, "varlen") == 10**5


@pytest.mark.parametrize("padded,expected", [(False, 1000), (True, 1800)])
def test_attention_computes_only_what_it_should(monkeypatch, padded, expected):
    computed = []
    real = F.scaled_dot_product_attention

    def counting(q, k, v, **kw):
        computed.append(q.shape[:-2].numel() * q.shape[-2] * k.shape[-2])  # heads x Lq x Lk
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    h, d = 2, 4
    qkv = torch.randn(40, 3 * h * d, dtype=torch.float64)
    out = causal_attention(qkv, d, Requests((0, 10, 40), padded=padded))
    assert sum(computed) == h * expected
    monkeypatch.undo()
    alone = torch.cat([causal_attention(qkv[:10], d), causal_attention(qkv[10:], d)])
    torch.testing.assert_close(out, alone, rtol=1e-12, atol=1e-12)
