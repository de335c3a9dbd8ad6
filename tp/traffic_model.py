"""The analytic traffic model: every collective a forward or backward issues, from the config alone.

A pure function of (model shape, p, n, dtype, variant, phase). The traffic ledger
(tp/ledger.py) observes the same list at run time; tests require the two to be equal.

Per block, with n tokens, d = d_model, k = n_heads·d_head, f = d_ffn:

    variant     forward                                   backward
    v2          all-reduce [n,d] ×2                       all-reduce [n,d] ×2 (dx of qkv, mlp_up)
    v1          all-gather [n,k], [n,d], [n,f], [n,d]     all-reduce [n,d], [n,k], [n,d], [n,f] (dx)
    intra_head  all-reduce [h,ΣL²], [n,d] ×2              all-reduce [h,ΣL²] (dP), [n,d] ×2 (dx)
    v2sp        (all-gather, reduce-scatter) [n',d] ×2    (all-gather, reduce-scatter) [n',d] ×2,
                                                          all-reduce [3d] ×2 (GPT-2: LayerNorm w, b, row bias;
                                                          Llama: [d], the norm weight)

v2sp pads n to n' = p·⌈n/p⌉ rows; a reduce-scatter of M elements sends (p-1)/p·M·e per rank, an all-gather the
same, so with p | n its forward moves exactly v2's bytes per layer, in twice as many collectives.

With many requests flattened (lengths Lᵢ, n = Σ Lᵢ) nothing changes but n, except
intra_head's scores: each request's [h, Lᵢ, Lᵢ] block, side by side, [h, Σ Lᵢ²].

Llama-family blocks (layers/models/llama.py) are v2: the same list, whatever h_kv is (grouped-query
attention changes what each rank caches, not what it sends); the MLP's backward site is
"gate_up dx". The backward listed is the input gradients' (all that is checked). Training with
K,V heads replicated (p > h_kv) would add an all-reduce of those heads' weight gradients among
their p/h_kv replicas, which is not modelled: nothing here trains. Their LM has the vocab-parallel embedding and an untied vocab-parallel head,
so a serving iteration adds exactly what GPT-2's vocab-parallel LM adds.

A serving iteration (layers/models/lm.py) of T rows, S of them sampled, adds to the stack's
collectives, outside any block: an all-gather of every rank's plan fingerprint (the engine
checks that all ranks scheduled the same rows), and with the vocab-parallel embedding one
all-reduce of [T, d] after the lookup and one all-gather of (max, argmax) pairs [S, 2] float64
per rank in the LM head. A replicated embedding and head communicate nothing.

Bytes per rank follow the ring model: all-reduce 2(p-1)/p·M·e, all-gather (p-1)/p·M·e.
On one rank nothing is communicated.
"""

from __future__ import annotations

import math

import torch

from tp.partition import ModelShape, ceil_div, kv_head_range, kv_heads_per_rank, llama_block, padded
from tp.ledger import Traffic, Transfer


PHASES = ("forward", "backward")


def block_collectives(cfg: ModelShape, n: int, variant: str, phase: str,
                      lengths: list[int] | None = None, p: int = 1) -> list[tuple[str, str, str, tuple]]:
    """(sublayer, site, kind, logical shape) for one block, in issue order. lengths: the requests (default [n]).
    p: the ranks, for v2sp's padding (n' = p·⌈n/p⌉ rows)."""
    d, k, f, h = cfg.d_model, cfg.k, cfg.d_ffn, cfg.n_heads
    scores = (h, sum(x * x for x in (lengths or [n])))
    ar, ag, rs = "all_reduce", "all_gather", "reduce_scatter"
    llama = llama_block(cfg)
    up = "gate_up dx" if llama else "mlp_up dx"  # Llama: gate and up are one column-parallel matmul
    if llama and variant not in ("v2", "v2sp"):
        raise ValueError(f"Llama-family blocks are built as v2 or v2sp only, not {variant!r}")
    rows = padded(n, p)  # v2sp: n padded up to a multiple of p
    dw = ("norm dw", (d,)) if llama else ("norm+bias dw", (3 * d,))  # v2sp's replicated parameters
    table = {
        ("v2", "forward"): [("attn", "all-reduce #1", ar, (n, d)), ("mlp", "all-reduce #2", ar, (n, d))],
        ("v2", "backward"): [("mlp", up, ar, (n, d)), ("attn", "qkv dx", ar, (n, d))],
        ("v1", "forward"): [("attn", "gather #1", ag, (n, k)), ("attn", "gather #2", ag, (n, d)),
                            ("mlp", "gather #3", ag, (n, f)), ("mlp", "gather #4", ag, (n, d))],
        ("v1", "backward"): [("mlp", "mlp_down dx", ar, (n, f)), ("mlp", "mlp_up dx", ar, (n, d)),
                             ("attn", "attn_out dx", ar, (n, k)), ("attn", "qkv dx", ar, (n, d))],
        ("intra_head", "forward"): [("attn", "scores all-reduce", ar, scores),
                                    ("attn", "all-reduce #1", ar, (n, d)), ("mlp", "all-reduce #2", ar, (n, d))],
        ("intra_head", "backward"): [("mlp", "mlp_up dx", ar, (n, d)), ("attn", "probs dP", ar, scores),
                                     ("attn", "qkv dx", ar, (n, d))],
        # v2sp: each v2 all-reduce [n, d] becomes a reduce-scatter and an all-gather of [n', d]; backward swaps them
        # (a record keeps its forward site) and adds one all-reduce per sub-layer of the replicated parameters'
        # gradients, partial over each rank's rows
        ("v2sp", "forward"): [("attn", "all-gather #1", ag, (rows, d)), ("attn", "reduce-scatter #1", rs, (rows, d)),
                              ("mlp", "all-gather #2", ag, (rows, d)), ("mlp", "reduce-scatter #2", rs, (rows, d))],
        ("v2sp", "backward"): [("mlp", "reduce-scatter #2", ag, (rows, d)), ("mlp", "all-gather #2", rs, (rows, d)),
                               ("mlp", dw[0], ar, dw[1]), ("attn", "reduce-scatter #1", ag, (rows, d)),
                               ("attn", "all-gather #1", rs, (rows, d)), ("attn", dw[0], ar, dw[1])],
    }
    if (variant, phase) not in table:
        raise ValueError(f"no traffic model for variant={variant!r} phase={phase!r}")
    if getattr(cfg, "qk_norm", False) and phase == "backward":  # Qwen3: the per-head norms' gradients, partial over heads
        return table[(variant, phase)] + [("attn", "qk_norm dw", ar, (2 * cfg.d_head,))]
    return table[(variant, phase)]


def _blocks(cfg: ModelShape, layers, n: int, variant: str, phase: str, dtype: torch.dtype, p: int,
            lengths: list[int] | None = None) -> list[Traffic]:
    """block_collectives of every one of `layers`, layer by layer, on p ranks."""
    return [Traffic.of(layer=i, sublayer=sub, site=site, phase=phase, kind=kind, shape=shape, dtype=dtype, p=p)
            for i in layers for sub, site, kind, shape in block_collectives(cfg, n, variant, phase, lengths, p)]


def _outside(sublayer: str, site: str, kind: str, shape: tuple, dtype: torch.dtype, p: int) -> Traffic:
    """A forward collective outside any block."""
    return Traffic.of(layer=None, sublayer=sublayer, site=site, phase="forward", kind=kind, shape=shape, dtype=dtype,
                      p=p)


def predict(cfg: ModelShape, p: int, n: int, dtype: torch.dtype, variant: str, phase: str = "forward",
            lengths: list[int] | None = None) -> list[Traffic]:
    """Every collective of one pass through the whole L-layer stack, layer by layer."""
    return [] if p == 1 else _blocks(cfg, range(cfg.n_layers), n, variant, phase, dtype, p, lengths)


def predict_sp_stack(cfg: ModelShape, p: int, n: int, dtype: torch.dtype, phase: str = "forward",
                     gathered: bool = True, input_grad: bool = True) -> list[Traffic]:
    """v2sp's collectives outside any block (layers/models/tp_block.SPStack): forward, the output's all-gather [n', d]
    (if the caller gathers it); backward, the input's all-gather of dx [n', d] (if the input needs a gradient).
    The input's scatter and the output gather's backward split rows: no communication."""
    if p == 1 or not {"forward": gathered, "backward": input_grad}[phase]:
        return []
    site = "gather output" if phase == "forward" else "scatter input"
    return [Traffic.of(layer=None, sublayer="stack", site=site, phase=phase, kind="all_gather",
                       shape=(padded(n, p), cfg.d_model), dtype=dtype, p=p)]


def bytes_per_rank_per_layer(cfg: ModelShape, p: int, n: int, dtype: torch.dtype, variant: str,
                             phase: str = "forward", lengths: list[int] | None = None) -> float:
    """Closed form, for sweeps and plots."""
    return sum(t.bytes_per_rank for t in _blocks(cfg, [0], n, variant, phase, dtype, p, lengths)) if p > 1 else 0.0


def predict_iteration(cfg: ModelShape, p: int, rows: int, sampled: int, dtype: torch.dtype, variant: str,
                      vocab_parallel: bool, plan_check: int, sampler: tuple[tuple[int, ...], bool, bool] | None = None,
                      cp: int = 1) -> list[Traffic]:
    """Every collective of one serving iteration, in issue order. plan_check: fingerprint elements per rank.
    sampler: None for a greedy head (one all-gather of (max, argmax) pairs); else (rounds, normalisers, race) of
    layers/sampling/sampler.py: the candidates each rank gave per round, whether the normalisers were all-reduced, and
    whether any row raced over the slices (rows whose kept ids are all candidates need no more communication).
    cp > 1: the world is cp × p (context parallelism, layers/attention/context_parallel.SplitCacheBackend): the plan
    check goes over all cp·p ranks, and every layer first merges its attention over the cp group, an all-gather of
    [cp·rows, h/p, d_head + 1] in float32 at least."""
    if p == 1 and cp == 1:
        return []
    if cp > 1:
        check = (1, plan_check * p * cp)
        out = [_outside("engine", "plan check", "all_gather", check, torch.float64, p * cp)] if plan_check else []
        inner = predict_iteration(cfg, p, rows, sampled, dtype, variant, vocab_parallel, 0, sampler)
        out += [t for t in inner if t.layer is None and t.sublayer == "embed"]
        for i in range(cfg.n_layers):  # each layer merges its attention over the cp group first
            out.append(Traffic.of(layer=i, sublayer="attn", site="cp merge", phase="forward", kind="all_gather",
                                  shape=(cp * rows, cfg.n_heads // p, cfg.d_head + 1),
                                  dtype=torch.promote_types(dtype, torch.float32), p=cp))
            out += [t for t in inner if t.layer == i]
        return out + [t for t in inner if t.layer is None and t.sublayer != "embed"]

    out = [_outside("engine", "plan check", "all_gather", (1, plan_check * p), torch.float64, p)] if plan_check else []
    if vocab_parallel:
        out.append(_outside("embed", "all-reduce", "all_reduce", (rows, cfg.d_model), dtype, p))
    out += predict(cfg, p, rows, dtype, variant, "forward")
    if vocab_parallel and sampled:
        out += predict_sampler(p, sampled, sampler, cfg.vocab_size, dtype)
    return out


def predict_sampler(p: int, sampled: int, sampler: tuple[tuple[int, ...], bool, bool] | None, vocab_size: int = 0,
                    dtype: torch.dtype = torch.float32) -> list[Traffic]:
    """The vocab-parallel head's pick (layers/sampling/sampler.py) for `sampled` rows: greedy, one all-gather of (max,
    argmax) pairs [S, 2p]; sampling, per round of c candidates an all-gather [S, 2cp] (the first followed by the
    normalisers' all-reduce [S, 2] when top-p or logprobs need them; a round of 0: the logits themselves, [S, V'] in
    the model's dtype), then, when some row races over the slices, the race's all-gather [S, 3p]."""
    def gather(site, width, dt=torch.float64):
        return _outside("head", site, "all_gather", (sampled, width), dt, p)

    if sampler is None:
        return [gather("argmax all-gather", 2 * p)]
    rounds, normalisers, race = sampler
    out = []
    for i, c in enumerate(rounds):
        out.append(gather("candidates all-gather", 2 * c * p) if c else
                   gather("logits all-gather", padded(vocab_size, p), dtype))  # V': V padded to a multiple of p
        if i == 0 and normalisers:
            out.append(_outside("head", "normaliser all-reduce", "all_reduce", (sampled, 2), torch.float64, p))
    return out + ([gather("sample all-gather", 3 * p)] if race else [])


def predict_verify(p: int, rows: int, rounds: tuple[int, ...], normalisers: bool, vocab_size: int = 0,
                   dtype: torch.dtype = torch.float32) -> list[Traffic]:
    """Speculative decoding's verifier (layers/sampling/rejection_sampler.py) over `rows` verified rows:
    filtered_logprobs (the candidates' rounds and the normalisers as the sampler's, then the kept ids' normaliser
    all-reduce [S]), the accept all-reduce [S, 3] and the residual race's all-gather [S, 3p]."""
    if p == 1 or not rows:
        return []
    out = [t for t in predict_sampler(p, rows, (rounds, normalisers, False), vocab_size, dtype)]
    for site, kind, shape in (("kept normaliser all-reduce", "all_reduce", (rows,)),
                              ("accept all-reduce", "all_reduce", (rows, 3)),
                              ("residual all-gather", "all_gather", (rows, 3 * p))):
        out.append(_outside("head", site, kind, shape, torch.float64, p))
    return out


def predict_prompt_logprobs(p: int, rows: int, n: int) -> list[Traffic]:
    """Prompt logprobs (layers/sampling/prompt_logprobs.py) over `rows` scored rows with the top `n`: one all-gather
    of each rank's [rows, 3 + 2n] float64 pack (its slice's max, sum of exponentials, the scored id's logit, its top
    n and their ids)."""
    if p == 1 or not rows:
        return []
    return [_outside("head", "prompt logprobs all-gather", "all_gather", (rows, p * (3 + 2 * n)), torch.float64, p)]


def predict_eviction_scores(p: int, blocks: int, dtype: torch.dtype) -> list[Traffic]:
    """kv_eviction h2o (serve/eviction.py): the ranks' attention per block summed, so every rank evicts the same
    blocks: one all-reduce of the step's scheduled blocks (each chunk's block table) in float32 at least."""
    if p == 1 or not blocks:
        return []
    return [_outside("engine", "eviction scores", "all_reduce", (blocks,), torch.promote_types(dtype, torch.float32),
                     p)]


def predict_tier_checks(p: int, checks: int) -> list[Traffic]:
    """The KV connector's disk tier (serve/kv_connector/offloading.py): each admission lookup that reaches a
    disk-tier block agrees, over the TP group, how many of its blocks every rank can read: one all-reduce of one
    int64."""
    if p == 1:
        return []
    return [_outside("engine", "kv disk check", "all_reduce", (1,), torch.int64, p) for _ in range(checks)]


def predict_control(p: int, payload: int, header: int) -> list[Traffic]:
    """The online engine's per-step control message (serve/engine.py's LLMEngine): rank 0 broadcasts a header of
    `header` float64 numbers (how many requests arrive, how many are aborted, the payload's length), then, when
    something arrived or was aborted, the payload: `payload` float64 numbers (each new request's fields, stop ids
    and prompt; the aborted ids)."""
    if p == 1:
        return []
    msg = [_outside("engine", "control header", "broadcast", (header,), torch.float64, p)]
    if payload:
        msg.append(_outside("engine", "control payload", "broadcast", (payload,), torch.float64, p))
    return msg


# ---- prefill/decode disaggregation: K,V moved between two TP groups (serve/pd/) ----------------


def head_overlaps(n_kv_heads: int, p_src: int, p_dst: int) -> list[tuple[int, int, int, int]]:
    """(source rank, destination rank, lo, hi): every destination rank gets its K,V heads [lo, hi) from the lowest
    source rank holding them (a head replicated on several source ranks is sent once per destination rank).

    Without replication (p_src, p_dst ≤ h_kv) these are the pairs whose ranges overlap: p_src + p_dst − gcd."""
    out = []
    for r in range(p_src):
        for s in range(p_dst):
            heads = [j for j in kv_head_range(n_kv_heads, s, p_dst) if _lowest_holder(n_kv_heads, j, p_src) == r]
            if heads:
                out.append((r, s, heads[0], heads[-1] + 1))
    return out


def pd_pairs(n_kv_heads: int, n_layers: int, p_prefill: int, p_decode: int,
             prefill_pp: int = 1) -> list[tuple[int, int, int, int, range]]:
    """(prefill global rank, decode rank index, lo, hi, layers): the hand-over's pairs (head_overlaps) and the layers
    each carries. A pipelined prefill side (prefill_pp stages of tp = p_prefill / prefill_pp ranks, serve/pipeline.py)
    holds each layer on one stage only: every stage's TP ranks pair with the decode ranks for their stage's layers
    (pp_stage_layers). Ordered by prefill rank, then decode rank."""
    tp = p_prefill // prefill_pp
    return [(stage * tp + r, s, lo, hi, layers) for stage, layers in enumerate(pp_stage_layers(n_layers, prefill_pp))
            for r, s, lo, hi in head_overlaps(n_kv_heads, tp, p_decode)]


def token_sources(pairs: list[tuple[int, int, int, int, range]], n_layers: int) -> dict[int, int]:
    """decode rank index -> the prefill rank that sends it each request's first token: the lowest rank of the last
    stage paired with it (pd_pairs). The last stage runs the micro-batch that samples the token in the same step as
    it streams its own layers' K,V, so on every pair the token follows the K,V it belongs to (NCCL matches a pair's
    messages in order, not by tag). With one stage: the lowest prefill rank overlapping it."""
    out: dict[int, int] = {}
    for r, s, _, _, layers in pairs:
        if layers.stop == n_layers:
            out.setdefault(s, r)
    return out


def _lowest_holder(n_kv_heads: int, head: int, p: int) -> int:
    return head // (n_kv_heads // p) if p <= n_kv_heads else ceil_div(head * p, n_kv_heads)


def pair_count(n_kv_heads: int, p_src: int, p_dst: int) -> int:
    """How many (source, destination) pairs head_overlaps finds, in closed form: with a = min(p_src, h_kv) and
    b = min(p_dst, h_kv) distinct holders on each side, (a + b − gcd(a, b)) · p_dst / b."""
    a, b = min(p_src, n_kv_heads), min(p_dst, n_kv_heads)
    return (a + b - math.gcd(a, b)) * p_dst // b


def predict_transfers(cfg: ModelShape, p_prefill: int, p_decode: int, handovers: list[tuple[int, int]],
                      dtype: torch.dtype, streaming: bool, rank: int, prefill_pp: int = 1) -> list[Transfer]:
    """The messages global rank `rank` sends (a prefill rank, 0 .. p_P−1) or receives (a decode rank, p_P ..)
    when the requests `handovers` [(request id, prompt length N)] move from the prefill to the decode group.

    Per request and pair (head_overlaps, on K,V heads): the K,V of heads [lo, hi) for positions [0, N) of every
    layer, one message [L, 2, hi−lo, N, d_head] (sent after prefill) or L messages [2, hi−lo, N, d_head] (streamed
    layer by layer); and to each decode rank its first token, [1] int64, from the lowest prefill rank overlapping it
    (of the last stage: token_sources).
    Before them, once per pair, the set-up's warm-up message ("pd/warm-up", request −1, [1] int64).
    Each decode rank receives its own cache share, L_p · 2·L·max(h_kv/p_D, 1)·d_head·e bytes per request: summed,
    L_p · K_tok (K_tok = 2·L·h_kv·d_head·e) while p_D ≤ h_kv, more once decode ranks replicate K,V heads.
    prefill_pp > 1: the prefill side is a pipeline (pd_pairs): each stage's ranks send their stage's layers, one
    message [L_s, 2, hi−lo, N, d_head] per pair or L_s streamed; the same bytes in all, from pp times as many ranks."""
    dh, e = cfg.d_head, dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    pairs = pd_pairs(cfg.n_kv_heads, cfg.n_layers, p_prefill, p_decode, prefill_pp)
    first = token_sources(pairs, cfg.n_layers)
    out = []

    def message(r: int, s: int, site: str, request: int, layer, heads, shape: tuple, dtype_name: str, size: int):
        """The message of the pair (prefill rank r, decode rank index s), if this rank is one of its ends."""
        if rank in (r, p_prefill + s):
            side, peer = ("send", p_prefill + s) if rank == r else ("recv", r)
            out.append(Transfer(side, site, request, layer, rank, peer, heads, shape, dtype_name, size))

    for r, s, *_ in pairs:  # set-up: one warm-up message per pair (serve/pd/handover.warm_up_pairs)
        message(r, s, "pd/warm-up", -1, None, (0, 0), (1,), "int64", 8)
    for rid, n in handovers:
        for r, s, lo, hi, layers in pairs:
            shapes = ([(layer, (2, hi - lo, n, dh)) for layer in layers] if streaming
                      else [(None, (len(layers), 2, hi - lo, n, dh))])
            for layer, shape in shapes:
                message(r, s, "pd/kv", rid, layer, (lo, hi), shape, name, math.prod(shape) * e)
        for s, r in sorted(first.items()):
            message(r, s, "pd/first token", rid, None, (0, 0), (1,), "int64", 8)
    return out


def predict_moe_layer(cfg, placement: str, p: int, rank: int, layer: int, dtype: torch.dtype,
                      ids_by_rank: list[torch.Tensor], n: int | None = None) -> list[Traffic]:
    """One MoE block's forward collectives on `rank` (layers/models/moe.py), from the routing alone.

    tp, ep   attn all-reduce #1 and mlp all-reduce #2 of [n, d]: the routing does not change the bytes.
    ep_a2a   ids_by_rank[s]: the expert ids [T_s, k] of rank s's own tokens. Rank r's pairs bound for rank j are
             its pairs whose expert is in [j·E/p, (j+1)·E/p); the ones for itself never leave it. In order: the
             counts per (rank, local expert) [p, E/p] (int64), the dispatch of its pairs' rows [S_r, d], their local expert ids [S_r, 1] (int64), and
             the combine of the rows it received [R_r, d] back to their ranks."""
    if p == 1:
        return []
    d = cfg.d_model
    if placement in ("tp", "ep"):
        return [Traffic.of(layer=layer, sublayer=s, site=site, phase="forward", kind="all_reduce", shape=(n, d),
                           dtype=dtype, p=p) for s, site in (("attn", "all-reduce #1"), ("mlp", "all-reduce #2"))]
    per = cfg.n_experts // p
    to = [torch.bincount((ids.flatten() // per), minlength=p).tolist() for ids in ids_by_rank]  # to[s][j]: s -> j
    sent, received = to[rank], [to[s][rank] for s in range(p)]
    away, back = sum(sent) - sent[rank], sum(received) - received[rank]
    e, i64 = dtype.itemsize, torch.int64

    def a2a(site, shape, sent_bytes, kind_dtype=dtype):
        return Traffic.of(layer=layer, sublayer="mlp", site=site, phase="forward", kind="all_to_all", shape=shape,
                          dtype=kind_dtype, p=p, sent_bytes=sent_bytes)

    return [a2a("dispatch counts", (p, per), (p - 1) * per * 8, i64), a2a("dispatch", (sum(sent), d), away * d * e),
            a2a("dispatch experts", (sum(sent), 1), away * 8, i64), a2a("combine", (sum(received), d), back * d * e)]


def pp_stage_layers(n_layers: int, pp: int) -> list[range]:
    """The layers of each of pp stages (layers/models/pipeline.stage_layers' rule, written again here from its statement
    so that the model does not read the code it checks): L // pp each, and the L % pp left over one each to the stages
    just before the last."""
    sizes = [n_layers // pp + (1 if pp - 1 - (n_layers % pp) <= s < pp - 1 else 0) for s in range(pp)]
    return [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(pp)]


def predict_pp_stage(cfg: ModelShape, pp: int, tp: int, rank: int, n: int, dtype: torch.dtype, variant: str,
                     boundary: str) -> tuple[list[Traffic], list[Transfer]]:
    """What global rank `rank` of a pp × tp pipeline moves in one forward (one micro-batch) of n rows: its stage's
    layers' collectives on its TP group (and, with the scatter boundary on every stage but the first, the all-gather
    of the received rows, [tp·⌈n/tp⌉, d], outside any layer); and its point-to-point messages, per micro-batch: from
    the previous stage (recv) and to the next (send), [n, d] each (whole), or this rank's [⌈n/tp⌉, d] (scatter); the
    messages are numbered micro-batch 0 (a caller of several renumbers them)."""
    stage, r = rank // tp, rank % tp
    layers = pp_stage_layers(cfg.n_layers, pp)[stage]
    piece = boundary == "scatter" and tp > 1
    shape = (ceil_div(n, tp), cfg.d_model) if piece else (n, cfg.d_model)
    name, size = str(dtype).removeprefix("torch."), math.prod(shape) * dtype.itemsize
    collectives, messages = [], []
    if piece and stage > 0:
        collectives.append(_outside("pp", "all-gather", "all_gather", (tp * ceil_div(n, tp), cfg.d_model), dtype, tp))
    if tp > 1:
        collectives += _blocks(cfg, layers, n, variant, "forward", dtype, tp)
    if stage > 0:
        messages.append(Transfer("recv", "pp/boundary", 0, None, rank, (stage - 1) * tp + r, (0, 0), shape, name, size))
    if stage < pp - 1:
        messages.append(Transfer("send", "pp/boundary", 0, None, rank, (stage + 1) * tp + r, (0, 0), shape, name, size))
    return collectives, messages


def predict_cp(cfg: ModelShape, cp: int, tp: int, rank: int, rows: list[int], new_tokens: int,
               dtype: torch.dtype) -> tuple[list[Traffic], list[Transfer]]:
    """What global rank `rank` (= c·tp + t) of a cp × tp layout moves for one request
    (layers/attention/context_parallel.py): the prefill of rows[c'] rows per cp rank c' by ring attention, then
    new_tokens decodes over the split cache.

    prefill, per layer   its TP all-reduces of [rows[c], d] over the tp group (v2's two); cp − 1 pass-KV steps, each
                         a send of the block it holds (owner (c − s) mod cp: [2, h_kv/tp, rows[owner], d_head]) to the
                         next cp rank and a receive of the previous owner's block from the previous cp rank
    decode, per layer    the merge's all-gather of [cp, h/tp, d_head + 1] (float32 at least) over the cp group, then the
                         TP all-reduces of [1, d]
    Messages carry global ranks; request 0."""
    c, t = rank // tp, rank % tp
    h_kv, h, dh = kv_heads_per_rank(cfg.n_kv_heads, tp), cfg.n_heads // tp, cfg.d_head
    nxt, prev = ((c + 1) % cp) * tp + t, ((c - 1) % cp) * tp + t
    name = str(dtype).removeprefix("torch.")
    stats = torch.promote_types(dtype, torch.float32)
    collectives, messages = [], []
    for i in range(cfg.n_layers):
        collectives += _blocks(cfg, [i], rows[c], "v2", "forward", dtype, tp) if tp > 1 else []
        for s in range(cp - 1):
            for kind, peer, owner in (("send", nxt, (c - s) % cp), ("recv", prev, (c - s - 1) % cp)):
                shape = (2, h_kv, rows[owner], dh)
                messages.append(Transfer(kind, "cp/pass-kv", 0, i, rank, peer, (0, 0), shape, name,
                                         math.prod(shape) * dtype.itemsize))
    for _ in range(new_tokens):
        for i in range(cfg.n_layers):
            if cp > 1:
                collectives.append(Traffic.of(layer=i, sublayer="attn", site="cp merge", phase="forward",
                                              kind="all_gather", shape=(cp, h, dh + 1), dtype=stats, p=cp))
            collectives += _blocks(cfg, [i], 1, "v2", "forward", dtype, tp) if tp > 1 else []
    return collectives, messages


def pass_kv_bytes_per_rank_per_layer(cfg: ModelShape, cp: int, tp: int, n: int, elem_bytes: int) -> float:
    """The closed form (cp − 1)·2·(S/cp)·h_kv·d·e a rank sends per layer in ring attention's pass-KV (S/cp rows per
    rank on average: exact when 2·cp divides S)."""
    return (cp - 1) * 2 * (n / cp) * kv_heads_per_rank(cfg.n_kv_heads, tp) * cfg.d_head * elem_bytes


def predict_train_logprobs(cfg: ModelShape, tp: int, rows: int, dtype: torch.dtype, backward: bool = False,
                           sequence_parallel: bool = False) -> list[Traffic]:
    """Every collective of train/step.py tp_logprobs over `rows` rows (the sequences' lengths less one, summed) on a
    rank of a tp group, in issue order: the embedding's all-reduce [rows, d], the blocks forward (v2, or v2sp with
    the rows' gathers), the sampler's statistics in float64 (three all-reduces [rows]: train/loss.py
    token_logprobs); backward: the head's f and the blocks from the last layer."""
    return _train_rows(cfg, tp, rows, dtype, "v2sp" if sequence_parallel else "v2", "logprobs", torch.float64,
                       backward)


def _train_rows(cfg: ModelShape, tp: int, n: int, dtype: torch.dtype, variant: str, statistics: str,
                statistics_dtype: torch.dtype, backward: bool) -> list[Traffic]:
    """The collectives of the train step's forward over n rows (train/step.py tp_logits), the three all-reduces [n]
    of `statistics` (the loss's, or the logprobs'), and with backward its backward."""
    if tp == 1:
        return []
    sp = variant == "v2sp"

    def outside(sublayer, site, shape, dt, phase="forward"):
        return Traffic.of(layer=None, sublayer=sublayer, site=site, phase=phase, kind="all_reduce", shape=shape,
                          dtype=dt, p=tp)

    out = [outside("embed", "all-reduce", (n, cfg.d_model), dtype)]
    out += predict(cfg, tp, n, dtype, variant, "forward")
    if sp:
        out += predict_sp_stack(cfg, tp, n, dtype, "forward")
    out += [outside(statistics, site, (n,), statistics_dtype)
            for site in ("all-reduce max", "all-reduce sum", "all-reduce target")]
    if backward:
        out.append(outside("head", "f", (n, cfg.d_model), dtype, "backward"))
        out += _blocks(cfg, reversed(range(cfg.n_layers)), n, variant, "backward", dtype, tp)
        if sp:
            out += predict_sp_stack(cfg, tp, n, dtype, "backward")
    return out


def predict_train_step(cfg: ModelShape, tp: int, dp: int, micro_rows: list[int], flat: int, dtype: torch.dtype,
                       distributed_optimizer: bool = False, sequence_parallel: bool = False) -> list[Traffic]:
    """Every collective of one training step (train/step.py) on a rank of a dp × tp world, in issue order: per
    micro-batch of micro_rows[i] = B·T rows, the embedding's all-reduce, the blocks forward, the loss's three
    all-reduces [rows], the head's f (backward) and the blocks backward from the last layer; then the step's loss
    over dp (for the log), and the gradient's dp reduction with the norm: a plain all-reduce of the rank's flat
    gradient [flat] and the norm over tp, or the distributed optimizer's reduce-scatter [dp·⌈flat/dp⌉], the norm's
    squares over dp and tp, and the all-gather of the updated values. sequence_parallel: the v2sp blocks, the rows
    all-gathered after the last block (forward) and the embedding's gradient all-gathered after the first (backward)."""
    out: list[Traffic] = []
    variant = "v2sp" if sequence_parallel else "v2"
    f64 = torch.float64

    def outside(sublayer, site, kind, shape, dt, p, phase="forward"):
        if p > 1:
            out.append(Traffic.of(layer=None, sublayer=sublayer, site=site, phase=phase, kind=kind, shape=shape,
                                  dtype=dt, p=p))

    for n in micro_rows:
        out += _train_rows(cfg, tp, n, dtype, variant, "loss", dtype, backward=True)
    outside("dp", "loss", "all_reduce", (1,), f64, dp)
    if not distributed_optimizer:
        outside("dp", "all-reduce", "all_reduce", (flat,), dtype, dp)
        outside("optimizer", "all-reduce norm", "all_reduce", (1,), f64, tp)
        return out
    padded_flat = padded(flat, dp)
    outside("optimizer", "reduce-scatter", "reduce_scatter", (padded_flat,), dtype, dp)
    outside("optimizer", "all-reduce norm dp", "all_reduce", (2,), f64, dp)
    outside("optimizer", "all-reduce norm", "all_reduce", (1,), f64, tp)
    outside("optimizer", "all-gather", "all_gather", (padded_flat,), dtype, dp)
    return out
