"""train/step.py: the train step at tp × dp equals one device training the dense model on the same batches, step for
step (float64): the loss of every step, the gradient norm, and every weight after the last step (the dense model's
trained weights, sharded by the same plan, against each rank's). Accumulation over 2 micro-batches per replica,
clipping and warm-up active."""

import pytest
import torch

from layers.models.config import ModelConfig
from layers.models.llama import LlamaConfig
from tests.harness import run_ranks

# the vocabulary is padded at p = 2 and 4
CFG = ModelConfig(d_model=32, n_heads=4, d_head=8, d_ffn=64, n_layers=2, max_seq_len=32, vocab_size=97)
LLAMA = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ffn=64, n_layers=2, max_seq_len=32,
                    vocab_size=97)  # GQA, an untied head
MODELS = {"gpt2": CFG, "llama": LLAMA}
B, T, STEPS = 2, 12, 5


def batches(micro: int):
    """STEPS steps of `micro` micro-batches [B, T + 1] of random ids, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g) for _ in range(micro)] for _ in range(STEPS)]


def dense_oracle(dense, c, micro: int) -> list[dict]:
    """The same training on one device, written here from the definitions (not train/step.py's code): torch's
    AdamW with decay on the matrices but wpe, the warm-up then cosine schedule, each micro-batch's mean loss over its
    count, torch's clip_grad_norm_."""
    import math

    import torch.nn.functional as F

    named = list(dense.named_parameters())
    decay = [q for n, q in named if q.ndim >= 2 and n != "wpe.weight"]
    rest = [q for n, q in named if not (q.ndim >= 2 and n != "wpe.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=c.lr, betas=c.betas, eps=c.eps)
    logs = []
    for step, micro in enumerate(batches(micro)):
        if step < c.warmup_steps:
            lr = c.lr * (step + 1) / c.warmup_steps
        else:
            done = (step - c.warmup_steps) / (c.max_steps - c.warmup_steps)
            lr = c.min_lr + (c.lr - c.min_lr) * (1 + math.cos(math.pi * done)) / 2
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for ids in micro:
            logits = torch.cat([dense.logits(row[:-1]) for row in ids])
            loss = F.cross_entropy(logits, ids[:, 1:].reshape(-1)) / len(micro)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), c.grad_clip)
        opt.step()
        logs.append({"loss": total, "grad_norm": norm.item(), "lr": lr})
    return logs


def train_both(ctx, dp: int, distributed_optimizer: bool = False, model: str = "gpt2", sp: bool = False):
    """tp = world / dp ranks per replica, dp replicas (rank d·tp + t), 2 micro-batches each; the oracle accumulates
    all 2·dp of them. sp: the v2sp blocks (sequence parallelism)."""
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm, shard_lm
    from tp.dist import grid_groups
    from train.step import TrainConfig, Trainer, train_lm

    tp = ctx.world_size // dp
    tp_groups, dp_groups = grid_groups(ctx.world_size, dp)
    group, dp_group = tp_groups[ctx.rank // tp], dp_groups[ctx.rank % tp]
    c = TrainConfig(lr=3e-2, min_lr=3e-3, warmup_steps=2, max_steps=STEPS, grad_clip=0.5, accumulation=2,
                    distributed_optimizer=distributed_optimizer)
    dense = init_weights(dense_lm(MODELS[model], torch.float64), seed=0)
    trainer = Trainer(train_lm(dense, group, sp), c, group, dp_group if dp > 1 else None)
    replica = ctx.rank // tp
    logs = [trainer.step(step[2 * replica:2 * replica + 2]) for step in batches(2 * dp)]
    dense_logs = dense_oracle(dense, c, 2 * dp)
    want = shard_lm(dense, "v2", group).state_dict()  # the trained dense weights, cut as this rank's
    worst = max(((w - trainer.lm.state_dict()[k]).abs().max() / w.abs().max().clamp_min(1e-30)).item()
                for k, w in want.items())
    return logs, dense_logs, worst


@pytest.mark.parametrize("model,tp,dp,zero,sp", [
    ("gpt2", 1, 1, False, False), ("gpt2", 2, 1, False, False), ("gpt2", 4, 1, False, False),
    ("gpt2", 1, 2, False, False), ("gpt2", 2, 2, False, False), ("gpt2", 1, 2, True, False),
    ("gpt2", 2, 2, True, False), ("llama", 2, 1, False, False), ("llama", 2, 2, True, False),
    ("gpt2", 2, 2, True, True), ("llama", 2, 1, False, True)])
def test_the_tp_train_step_equals_one_device_step_for_step(model, tp, dp, zero, sp):
    """zero: the distributed optimizer (AdamW's state split over dp) in place of the plain all-reduce; sp: sequence
    parallelism (the v2sp blocks)."""
    for logs, dense_logs, worst in run_ranks(tp * dp, train_both, dp, zero, model, sp):
        assert [r["lr"] for r in logs] == pytest.approx([r["lr"] for r in dense_logs], rel=1e-12)
        for got, want in zip(logs, dense_logs):
            assert abs(got["loss"] - want["loss"]) <= 1e-10 * abs(want["loss"]), (got, want)
            assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-10 * want["grad_norm"], (got, want)
        assert all(r["grad_norm"] > 0.5 for r in dense_logs)  # clipping acts on every step
        assert worst <= 1e-10, worst


def dp_bytes(ctx, distributed_optimizer: bool):
    """One step at tp = 2, dp = 2 with the ledger on: the bytes each rank sends for the gradient's dp reduction and
    the optimizer (the loss's log and the norms aside), and the number of parameter values this rank keeps state for."""
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm, shard_lm
    from tp.dist import grid_groups
    from tp.ledger import TrafficLedger
    from train.step import TrainConfig, Trainer

    tp_groups, dp_groups = grid_groups(ctx.world_size, 2)
    group, dp_group = tp_groups[ctx.rank // 2], dp_groups[ctx.rank % 2]
    c = TrainConfig(accumulation=2, distributed_optimizer=distributed_optimizer)
    trainer = Trainer(shard_lm(init_weights(dense_lm(CFG, torch.float64), seed=0), "v2", group), c, group, dp_group)
    ledger = TrafficLedger(ctx.world_size)
    with ledger.recording():
        trainer.step(batches(4)[0][2 * (ctx.rank // 2):2 * (ctx.rank // 2) + 2])
    moved = sum(r.bytes_per_rank for r in ledger.records if r.site in ("all-reduce", "reduce-scatter", "all-gather")
                and r.sublayer in ("dp", "optimizer"))
    state = trainer.optimizer.m.numel() if distributed_optimizer else \
        sum(s["exp_avg"].numel() for s in trainer.optimizer.state.values())
    return moved, state, sum(p.numel() for p in trainer.lm.parameters())


def test_the_distributed_optimizer_moves_the_same_bytes_and_keeps_half_the_state_at_dp_2():
    """Megatron's claim: the reduce-scatter and the all-gather are the all-reduce's two halves (the same bytes, up to
    the padding to a multiple of dp), and each rank keeps Adam's state for 1/dp of its values."""
    plain, zero = run_ranks(4, dp_bytes, False), run_ranks(4, dp_bytes, True)
    for (plain_bytes, plain_state, n), (zero_bytes, zero_state, _) in zip(plain, zero):
        assert plain_bytes > 0 and abs(zero_bytes - plain_bytes) <= 2 * 8, (plain_bytes, zero_bytes)  # ≤ one pad value
        assert plain_state == n and zero_state == -(-n // 2), (plain_state, zero_state, n)


def build_replicated_kv(ctx):
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm, shard_lm
    from train.step import TrainConfig, Trainer

    try:
        Trainer(shard_lm(init_weights(dense_lm(LLAMA, torch.float64), seed=0), "v2", ctx.group), TrainConfig(),
                ctx.group)
    except ValueError as exc:
        return str(exc)
    return None


def test_kv_heads_replicated_over_ranks_are_refused_for_training():
    """At tp = 4 > n_kv_heads = 2 each K,V head lives on two ranks, each with part of its gradient: refused in one
    line on every rank before any step."""
    for message in run_ranks(4, build_replicated_kv):
        assert message is not None and "tp=4 > n_kv_heads=2" in message and "train at tp <= 2" in message, message


def step_ledger(ctx, dp: int, distributed_optimizer: bool, sp: bool):
    """One step's collectives on this rank, as the ledger recorded them (labelled with their blocks), and as
    tp/traffic_model.predict_train_step predicts them from the shapes alone."""
    from dataclasses import fields

    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm
    from tp.dist import grid_groups
    from tp.ledger import Traffic, TrafficLedger
    from tp.traffic_model import predict_train_step
    from train.step import TrainConfig, Trainer, train_lm

    tp = ctx.world_size // dp
    tp_groups, dp_groups = grid_groups(ctx.world_size, dp)
    group, dp_group = tp_groups[ctx.rank // tp], dp_groups[ctx.rank % tp]
    c = TrainConfig(accumulation=2, distributed_optimizer=distributed_optimizer)
    trainer = Trainer(train_lm(init_weights(dense_lm(CFG, torch.float64), seed=0), group, sp), c, group,
                      dp_group if dp > 1 else None)
    replica = ctx.rank // tp
    ledger = TrafficLedger(ctx.world_size)
    with ledger.attach(trainer.lm.stack):
        trainer.step(batches(2 * dp)[0][2 * replica:2 * replica + 2])
    got = [Traffic(*(getattr(r, f.name) for f in fields(Traffic))) for r in ledger.records]
    flat = sum(p.numel() for p in trainer.lm.parameters())
    return got, predict_train_step(CFG, tp, dp, [B * T] * 2, flat, torch.float64, distributed_optimizer, sp)


@pytest.mark.parametrize("tp,dp,zero,sp", [(4, 1, False, False), (2, 2, False, False), (2, 2, True, False),
                                           (1, 2, True, False), (2, 2, True, True)])
def test_every_collective_of_a_train_step_is_the_traffic_models(tp, dp, zero, sp):
    """The ledger of one step (two micro-batches) equals the model record for record: site, layer, phase, kind,
    shape, dtype and bytes per rank, in issue order. sp: the v2sp blocks and the rows' gathers around them."""
    for got, want in run_ranks(tp * dp, step_ledger, dp, zero, sp):
        assert got == want, [(g, w) for g, w in zip(got, want) if g != w][:3] or (len(got), len(want))


def stop_and_resume(ctx, dp: int, distributed_optimizer: bool, directory: str):
    """STEPS steps straight, against 2 steps, a save, a fresh trainer that loads, and the other steps: the losses
    and the final weights, both ways; and a resume at another layout refused."""
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm, shard_lm
    from tp.dist import grid_groups
    from train.step import TrainConfig, Trainer

    tp = ctx.world_size // dp
    tp_groups, dp_groups = grid_groups(ctx.world_size, dp)
    group, dp_group = tp_groups[ctx.rank // tp], dp_groups[ctx.rank % tp]
    c = TrainConfig(lr=3e-2, min_lr=3e-3, warmup_steps=2, max_steps=STEPS, grad_clip=0.5, accumulation=2,
                    distributed_optimizer=distributed_optimizer)
    replica = ctx.rank // tp
    mine = [step[2 * replica:2 * replica + 2] for step in batches(2 * dp)]

    def fresh():
        return Trainer(shard_lm(init_weights(dense_lm(CFG, torch.float64), seed=0), "v2", group), c, group,
                       dp_group if dp > 1 else None)

    straight = fresh()
    losses = [straight.step(b)["loss"] for b in mine]
    first = fresh()
    resumed = [first.step(b)["loss"] for b in mine[:2]]
    first.save(directory)
    second = fresh()
    second.load(directory)
    resumed += [second.step(b)["loss"] for b in mine[2:]]
    same_weights = all(torch.equal(a, b) for a, b in zip(straight.lm.state_dict().values(),
                                                         second.lm.state_dict().values()))
    other = Trainer(shard_lm(init_weights(dense_lm(CFG, torch.float64), seed=0), "v2", group),
                    TrainConfig(lr=1e-3, accumulation=2, distributed_optimizer=distributed_optimizer), group,
                    dp_group if dp > 1 else None)
    try:
        other.load(directory)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    return losses, resumed, same_weights, refusal


@pytest.mark.parametrize("zero", [False, True])
def test_a_run_stopped_and_resumed_gives_the_uninterrupted_losses(tmp_path, zero):
    for losses, resumed, same_weights, refusal in run_ranks(4, stop_and_resume, 2, zero, str(tmp_path)):
        assert resumed == losses and same_weights  # bit for bit: the same arithmetic in the same order
        assert refusal is not None and "was saved with another train" in refusal, refusal


def train_gather_export(ctx, directory: str, model: str):
    """One step at tp = 2, the slices gathered into the dense model, written in transformers' layout by rank 0; the
    gathered weights against the dense model trained on one device."""
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm, shard_lm
    from train.export import gather_dense, save_pretrained
    from train.step import TrainConfig, Trainer

    c = TrainConfig(lr=3e-2, warmup_steps=1, max_steps=2, accumulation=2)
    dense = init_weights(dense_lm(MODELS[model], torch.float64), seed=0)
    trainer = Trainer(shard_lm(dense, "v2", ctx.group), c, ctx.group)
    step = batches(2)[0]
    trainer.step(step)
    Trainer(dense, c).step(step)  # the same step on one device
    gathered = gather_dense(trainer.lm, ctx.group)
    worst = max(((gathered.get_parameter(k) - w).abs().max() / w.abs().max()).item()
                for k, w in dense.named_parameters())
    if ctx.rank == 0:
        save_pretrained(gathered, directory)
    return worst


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_trained_model_is_gathered_and_read_back_by_transformers(tmp_path, model):
    """The TP slices gathered equal the dense model trained on one device; transformers reads the exported directory
    and gives the dense model's logits (float64). Llama: GQA, an untied head, gate_up written as two tensors."""
    transformers = pytest.importorskip("transformers")
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm
    from train.step import TrainConfig, Trainer

    assert all(w <= 1e-10 for w in run_ranks(2, train_gather_export, str(tmp_path), model))
    dense = init_weights(dense_lm(MODELS[model], torch.float64), seed=0)
    Trainer(dense, TrainConfig(lr=3e-2, warmup_steps=1, max_steps=2, accumulation=2)).step(batches(2)[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    ids = batches(1)[1][0][0]
    with torch.no_grad():
        want, got = dense.logits(ids), hf(ids[None]).logits[0]
    # transformers' Llama computes its rotary frequencies in float32 by design (its float64 logits differ by ~1e-7)
    assert ((got - want).abs().max() / want.abs().max()).item() < (1e-10 if model == "gpt2" else 1e-6)


def autocast_steps(ctx):
    """3 steps at tp 2 in float32, and the same from the same weights under bfloat16 autocast."""
    from layers.models.dense import init_weights
    from layers.models.lm import dense_lm
    from train.step import TrainConfig, Trainer, train_lm

    c = TrainConfig(lr=3e-2, warmup_steps=1, max_steps=3, accumulation=2)
    out = {}
    for name, autocast in (("float32", None), ("bfloat16", torch.bfloat16)):
        trainer = Trainer(train_lm(init_weights(dense_lm(CFG, torch.float32), seed=0), ctx.group), c, ctx.group,
                          autocast=autocast)
        out[name] = [trainer.step(step)["loss"] for step in batches(2)[:3]]
        out[name + " dtypes"] = {p.dtype for p in trainer.lm.parameters()} | \
            {s.dtype for st in trainer.optimizer.state.values() for s in st.values() if torch.is_tensor(s) and s.ndim}
    return out


def test_bfloat16_autocast_keeps_float32_master_weights_and_follows_float32():
    """Under autocast the matmuls run in bfloat16 (the losses differ from float32's) while the weights and Adam's
    moments stay float32; the losses follow float32's within bfloat16's rounding."""
    for out in run_ranks(2, autocast_steps):
        assert out["bfloat16 dtypes"] == {torch.float32}
        assert out["bfloat16"] != out["float32"]
        torch.testing.assert_close(out["bfloat16"], out["float32"], rtol=2e-2, atol=0)
