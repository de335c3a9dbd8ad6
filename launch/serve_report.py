"""launch/serve.py's report: report.json built from a run (build_report, build_pd_report), and what rank 0 prints of
it (render, render_pd): the iteration table, the request table, the verdicts."""

from __future__ import annotations

import torch

from launch.loading import render_load
from launch.report import counts_text, format_table, kib
from layers.attention.backends import choose
from layers.models.families import of
from layers.models.pipeline import stage_layers
from serve.kv_cache import kv_bytes_per_token
from layers.parallel.weight_format import matmul_modules, stored_bytes
from tp.cost_model import decode_weight_bytes, kv_bytes_per_token_per_rank
from tp.ledger import ring_bytes_per_rank
from tp.partition import kv_heads_per_rank
from tp.traffic_model import pair_count

SHOW_FIRST, SHOW_LAST = 30, 10  # longer runs print these iterations; report.json keeps all of them


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids)) or "-"


def _kv(m: dict) -> str:
    """h_kv for Llama models (grouped-query attention); nothing for GPT-2's multi-head attention."""
    return f"h_kv={m['n_kv_heads']} " if "n_kv_heads" in m else ""


def _shape(m: dict) -> str:
    """The attention's and FFN's widths: d_head and ffn, or MLA's latent and DeepSeekMoE's experts."""
    if "kv_lora_rank" in m:
        return (f"MLA q_lora={m['q_lora_rank']} kv_lora={m['kv_lora_rank']} rope={m['qk_rope_head_dim']} "
                f"nope={m['qk_nope_head_dim']} v={m['v_head_dim']}, ffn={m['d_ffn']} (first "
                f"{m['first_k_dense_replace']} layers), {m['n_routed_experts']} routed experts of {m['moe_d_ffn']} "
                f"in {m['n_group']} groups (top_k={m['top_k']} from {m['topk_group']}) + {m['n_shared_experts']} "
                f"shared ")
    return f"{_kv(m)}d_head={m['d_head']} ffn={m['d_ffn']} "


def _moe(c: dict) -> str:
    """MoE models: the experts and where they live."""
    m = c["model"]
    if "n_routed_experts" in m:
        return f"; moe_parallel={c['moe_parallel']}"
    return (f"; {m['n_experts']} experts of ffn={m['d_ffn']}, top_k={m['top_k']}, moe_parallel={c['moe_parallel']}"
            if "n_experts" in m else "")


def _budget(c: dict) -> str:
    """The requests and the batch's token budget."""
    e = c["engine"]
    return (f"{c['requests']} requests; long_prefill_token_threshold={e['long_prefill_token_threshold']} "
            f"max_num_batched_tokens={e['max_num_batched_tokens']}")


def _sampling(sp: dict | None) -> str:
    if not sp:
        return "decoding: greedy (temperature=0)"
    return (f"decoding: sampled, temperature={sp['temperature']} top_k={sp['top_k']} top_p={sp['top_p']} "
            f"min_p={sp['min_p']}, request i seeded from sampling_seed={sp['sampling_seed']} and i")


def _from(c: dict) -> str:
    """dtype=auto: where the dtype came from, beside it."""
    return f" ({c['dtype_from']})" if c.get("dtype_from") else ""


def _eos(c: dict) -> str:
    eos = c.get("eos_id")
    return "" if eos is None else f"; eos_id={eos}" + (f" ({c['eos_from']})" if c.get("eos_from") else "")


def render_texts(requests: list[dict], most: int = 8, width: int = 100) -> list[str]:
    """With a checkpoint's tokenizer (launch/serve.add_text): each request's generated text, one line each."""
    texts = [(q["request"], q["text"]) for q in requests if "text" in q]
    if not texts:
        return []
    lines = ["", "generated text (the checkpoint's tokenizer; report.json: requests[i].text):"]
    for rid, text in texts[:most]:
        shown = repr(text)
        lines.append(f"  {rid}: {shown if len(shown) <= width else shown[:width - 1] + '…'}")
    if len(texts) > most:
        lines.append(f"  ... and {len(texts) - most} more")
    return lines


def first_ids(ids: list[int], n: int = 4) -> str:
    """The first n generated ids, as the request table shows them: '464 3290 318 …'."""
    return " ".join(map(str, ids[:n])) + (" …" if len(ids) > n else "")


def render_stages(pp: dict) -> list[str]:
    """The pipeline's stages: what each ran, its busy and idle time, the bytes each of its ranks sent onward."""
    rows = [[x["stage"], _ids(x["ranks"]), f"{x['layers'][0]}..{x['layers'][1] - 1}", x["microbatches"], x["steps"],
             _ms(x["busy_s"]), _ms(x["idle_s"]), kib(x["sent_bytes_per_rank"])] for x in pp["stages"]]
    return ["", f"pipeline: {pp['pp']} stages x tp {pp['tp']}, boundary {pp['boundary']}; a step runs one micro-batch "
                f"per stage (busy: inside its blocks; idle: the rest of the step):",
            format_table(["stage", "ranks", "layers", "micro-batches", "steps", "busy ms", "idle ms",
                          "boundary KiB sent/rank"], rows),
            f"bubble: {pp['bubble']:.1%} of the stage-steps idle ({pp['stages'][0]['microbatches']} of "
            f"{pp['stages'][0]['steps']} steps had stage 0 busy)" if pp["bubble"] is not None else "bubble: no steps"]


def weights_report(lm, s, p: int) -> dict:
    """The matmul weights this rank stores (layers/parallel/weight_format.py: quantization, layout) against the cost
    model's bytes for one decode step (a pipeline stage's: its own, no model)."""
    out = {"quantization": s.engine.quantization, "matmul_bytes_per_rank": stored_bytes(lm),
           "in_out": sum(m.weight.dim() == 2 and m.weight.stride(0) == 1 and m.weight.shape[1] > 1
                         for _, m in matmul_modules(lm))}
    if s.pp == 1 and s.variant == "v2" and of(s.model).quantization:  # the model: v2's plain linears (no experts,
        #                                                                  no latent projections, no v1 cut)
        elem = torch.empty((), dtype=s.dtype).element_size()
        out["matmul_bytes_model"] = decode_weight_bytes(s.model, p, elem, s.engine.quantization, s.vocab_parallel)
    return out


def render_weights(w: dict) -> str:
    model = w.get("matmul_bytes_model")
    return (f"matmul weights per rank: {kib(w['matmul_bytes_per_rank'])} KiB as stored "
            f"({w['quantization'] or 'as loaded'}; {w['in_out']} stored [in, out])"
            + ("" if model is None else f", the cost model's bytes per decode step {kib(model)} KiB: "
               f"{str(model == w['matmul_bytes_per_rank']).lower()}"))


def render_check(chk: dict, how: str = "") -> str:
    """The line of the check against the dense oracle: off, or how many tokens matched."""
    if chk["ok"] is None:
        return "check: off (check=true to compare with the dense oracle)"
    v = chk["verdicts"]
    return f"check vs dense oracle{how}: {v['match']} match, {v['near-tie']} near-tie, {v['MISMATCH']} mismatch"


def render(r: dict) -> str:
    c, m, t, kv = r["config"], r["config"]["model"], r["totals"], r["kv_cache"]
    tied, int8 = r.get("lm_head_tied", True), bool(r.get("weights", {}).get("quantization"))
    untied_int8 = "(the untied LM head: with the matmul weights below)"
    lines = [
        f"tpref: serving on the TP stack  (tp = {r.get('tp', r['world_size'])}"
        + (f", pp = {r['pp']['pp']} stages, boundary {r['pp']['boundary']}"
           + (", chunk_pipelining" if c["engine"]["chunk_pipelining"] else "") if r.get("pp") else "")
        + (f", cp = {c['cp']}: each cp rank keeps 1/{c['cp']} of every request's K,V, one merge per layer"
           if c.get("cp", 1) > 1 else "")
        + f", backend {r['backend']}, device {r['device']})",
        f"model {c['model_name']}: d={m['d_model']} h={m['n_heads']} {_shape(m)}"
        f"L={m['n_layers']} vocab={m['vocab_size']}; variant {c['variant']}, "
        f"{'vocab-parallel' if c['vocab_parallel'] else 'replicated'} embedding and LM head; dtype={c['dtype']}"
        + _from(c) + _moe(c) + _eos(c),
        f"{_budget(c)} max_num_seqs={c['engine']['max_num_seqs']}; "
        f"KV pool of {kv['blocks']} blocks of block_size={kv['block_size']} per rank, enable_prefix_caching="
        f"{str(c['engine']['enable_prefix_caching']).lower()}, attention={c['attention']}"
        + (f" ({c['engine']['attention']})" if c["engine"]["attention"] != c["attention"] else "")
        + (f", shared_prefix={c['shared_prefix']}" if c.get("shared_prefix") else ""),
        _sampling(c.get("sampling")),
        *([render_load(r["load"])] if r.get("load") else []),
        "",
        "per micro-batch, in the step it came back from the last stage (iter: the step it entered; collectives and "
        "bytes: rank 0's ledger in that step; model: the analytic prediction agrees on every rank in every step):"
        if r.get("pp") else
        "per iteration (collectives and bytes from the traffic ledger; model: the analytic prediction agrees):",
    ]
    rows = []
    for it in r["iterations"]:
        rows.append([it["iteration"], it["rows"], it["prefill_chunks"], it["decodes"], _ids(it["finished"]),
                     _ids(it["admitted"]), _ids(it["preempted"]), it["blocks_used"], it["prefix_hit_tokens"],
                     counts_text(it["collectives"]),
                     kib(it["bytes_per_rank"]), _ms(it["time_s"]), "yes" if it["ledger_matches_model"] else "NO"])
    if len(rows) > SHOW_FIRST + SHOW_LAST:
        rows = rows[:SHOW_FIRST] + [["..."] + [""] * 12] + rows[-SHOW_LAST:]
    lines.append(format_table(["iter", "rows", "prefill chunks", "decodes", "finished", "admitted", "preempted",
                               "blocks used", "prefix hits", "collectives",
                               "sent/rank KiB", "time ms", "model"], rows))
    lines += ["", "per request (times from arrival; match: tokens vs the dense oracle; every generated id: "
                  "report.json's requests[i].output_ids):"]
    rows = [[q["request"], q["arrival"], q["prompt_length"], q.get("prefix_hit_tokens", 0), q["generated"],
             first_ids(q["output_ids"]), q.get("preemptions", 0), _ms(q["ttft_s"]), _ms(q["mean_tbt_s"]),
             q.get("match", "not checked")] for q in r["requests"]]
    lines.append(format_table(["request", "arrives at iter", "prompt", "prefix hits", "generated", "first ids",
                               "preempted", "TTFT ms", "mean TBT ms", "match"], rows))
    lines += render_texts(r["requests"])
    lines += [
        "",
        f"generated {t['generated_tokens']} tokens in {t['iterations']} "
        + (f"micro-batches ({r['pp']['stages'][0]['steps']} steps)" if r.get("pp") else "iterations")
        + f", {t['time_s']:.2f} s "
        f"({t['tokens_per_s']:.1f} tokens/s); {t['mixed_iterations']} iterations mixed prompt chunks and decodes",
        f"paged KV: {kv['blocks']} blocks x {kv['block_size']} positions per rank "
        f"({kib(kv['pool_bytes_per_rank'])} KiB reserved), at most {kv['peak_blocks_used']} in use; "
        f"{kv['prefix_hit_tokens']} prompt tokens from the prefix cache; {t['rows_computed']} rows computed; "
        f"{t['preemptions']} preemptions" + (f"; {kv['evicted_blocks']} blocks evicted (kv_eviction)"
                                             if kv.get("evicted_blocks") else ""),
        f"KV cache per rank ({'the model dtype' if kv.get('cache_dtype', 'auto') == 'auto' else kv['cache_dtype']}): "
        f"{kv['bytes_per_token_per_rank']} bytes per token (unsharded {kv['bytes_per_token_dense']}, "
        f"ratio {kv['ratio_to_dense']:.4f} = 1/{round(1 / kv['ratio_to_dense'])}"
        + (f"; formula {kv.get('formula', '2·L·max(h_kv/p, 1)·d_head·e')} = "
           f"{kv['formula_bytes_per_token_per_rank']}"
           + (" with L the stage's layers" if r.get("pp") else "")
           if "formula_bytes_per_token_per_rank" in kv else "")
        + (f"; each K,V head on {r.get('tp', r['world_size']) * kv['kv_heads_per_rank'] // kv['n_kv_heads']} ranks"
           if kv.get("n_kv_heads") and r.get("tp", r["world_size"]) > kv["n_kv_heads"] else "") + "); "
        f"peak {kib(kv['peak_bytes_per_rank'])} KiB; token embedding "
        f"{'= LM head' if tied else 'and the (untied) LM head' if not int8 else untied_int8}: "
        f"{kib(r['embedding_bytes_per_rank'])} KiB per rank{'' if tied or int8 else ' each'} "
        + ("of the first stage (the last holds the head, a middle stage neither) " if r.get("pp") else "")
        + f"({'vocab-parallel' if c['vocab_parallel'] else 'replicated'})",
        *([render_weights(r["weights"])] if "weights" in r else []),
        f"traffic: {t['collectives']} collectives, {kib(t['bytes_per_rank'])} KiB sent per rank; "
        f"ledger matches model in every iteration: {str(r['ledger_matches_model']).lower()}",
    ]
    if r.get("pp"):
        lines += render_stages(r["pp"])
    chk = r["check"]
    quantized = kv.get("cache_dtype", "auto") != "auto"
    round_trip = f"; K,V round-tripped through {kv['cache_dtype']} with the engine's scales" if quantized else ""
    line = render_check(chk, f" (whole-prefix recompute, no cache{round_trip})")
    lines.append(line if chk["ok"] is None else f"{line}; max logit rel err {chk['max_logit_rel_err']:.2e}")
    kv_ok = kv.get("matches_formula", True)
    ok = r["ledger_matches_model"] and kv_ok and chk["ok"] in (True, None)
    lines.append(f"{'PASS' if ok else 'FAIL'}: served {c['requests']} requests at tp={r.get('tp', r['world_size'])}"
                 + (f" x pp={r['pp']['pp']}" if r.get("pp") else "")
                 + ("" if chk["ok"] is None else ", tokens equal to the dense oracle" if chk["ok"]
                    else ", tokens DIFFER from the dense oracle")
                 + ("" if r["ledger_matches_model"] else "; ledger DIFFERS from the model")
                 + ("" if kv_ok else "; KV cache bytes per token DIFFER from the formula"))
    return "\n".join(lines)


def render_pd(r: dict) -> str:
    """Prefill/decode disaggregation: per-request time to token 1 and 2 in parts, the transfer table, verdicts."""
    c, m, pd, t = r["config"], r["config"]["model"], r["pd"], r["transfer"]
    lines = [
        f"tpref: prefill/decode disaggregation  (prefill ranks 0-{pd['prefill_ranks'] - 1}"
        + (f" as {pd['prefill_pp']} pipeline stages x tp {pd['prefill_ranks'] // pd['prefill_pp']}"
           if pd.get("prefill_pp", 1) > 1 else "")
        + f", decode ranks {pd['prefill_ranks']}-{r['world_size'] - 1}; backend {r['backend']}, device {r['device']})",
        f"model {c['model_name']}: d={m['d_model']} h={m['n_heads']} {_kv(m)}d_head={m['d_head']} L={m['n_layers']} "
        f"vocab={m['vocab_size']}; variant {c['variant']}; dtype={c['dtype']}{_from(c)}; K,V "
        f"{'streamed layer by layer' if pd['streaming'] else 'sent after prefill'}",
        f"{_budget(c)}; "
        f"{r['prefill_iterations']} prefill iterations, {r['decode_iterations']} decode iterations",
        *([render_load(r["load"])] if r.get("load") else []),
        "",
        "per request: the prefill group emits token 1 (TTFT = prefill, from arrival); token 2 comes after the",
        "hand-over (prefill done -> taken in by the decode group: K,V landed on every decode rank, at its next",
        "iteration boundary) and the first decode iteration:",
    ]
    rows = []
    for q in r["requests"]:
        to2 = None if q["first_decode_s"] is None else q["prefill_s"] + q["transfer_s"] + q["first_decode_s"]
        rows.append([q["request"], q["prompt_length"], len(q["output_ids"]), first_ids(q["output_ids"]),
                     _ms(q["prefill_s"]), _ms(q["transfer_s"]), _ms(q["first_decode_s"]), _ms(to2), kib(q["kv_bytes"]),
                     "yes" if q["same_as_colocated"] else "NO", q.get("match", "not checked")])
    lines.append(format_table(["request", "prompt", "generated", "first ids", "prefill (TTFT) ms", "transfer ms",
                               "first decode ms", "to token 2 ms", "K,V sent KiB", "= colocated", "oracle"], rows))
    lines.append("(every generated id: report.json's requests[i].output_ids)")
    lines += ["", f"K,V transfer (point-to-point; ledger vs tp/traffic_model.predict_transfers: "
                  f"{'equal' if r['ledger_matches_model'] else 'DIFFERENT'}):"]
    rows = [[p["prefill_rank"], p["decode_rank"], f"{p['heads'][0]}-{p['heads'][1] - 1}", p["messages"],
             kib(p["bytes"])] for p in t["pairs"]]
    lines.append(format_table(["prefill rank", "decode rank", "K,V heads" if "n_kv_heads" in r["config"]["model"]
                               else "heads", "messages", "KiB"], rows))
    per_decode = ", ".join(f"rank {k}: {kib(v)} KiB" for k, v in t["received_per_decode_rank"].items())
    stages = pd.get("prefill_pp", 1)
    replicated = max(pd["prefill_ranks"] // stages, pd["decode_ranks"]) > m.get("n_kv_heads", m["n_heads"])
    per_rank = t.get("kv_bytes_per_token_per_decode_rank", t["kv_bytes_per_token"] // pd["decode_ranks"])
    pairs = ("(a + b - gcd(a, b)) * p_D / b, a = min(p_P, h_kv), b = min(p_D, h_kv)" if replicated
             else "p_P + p_D - gcd(p_P, p_D)")
    per_stage = f" (p_P = {pd['prefill_ranks'] // stages} ranks per stage)" if stages > 1 else ""
    pairs = (f"{stages} stages x ({pairs})" if stages > 1 else pairs) + f" = {t['pair_count_formula']}{per_stage}"
    total = (f"L_p * p_D * 2*L*max(h_kv/p_D, 1)*d_head*e = {t['handed_over_tokens']} tokens x {pd['decode_ranks']} x "
             f"{per_rank} B" if replicated else f"L_p * K_tok = {t['handed_over_tokens']} tokens x "
             f"{t['kv_bytes_per_token']} B")
    lines += [
        f"pairs: {t['pair_count']} = {pairs}; total {kib(t['total_bytes'])} KiB = {total} = "
        f"{kib(t['total_formula'])} KiB ({'equal' if t['total_bytes'] == t['total_formula'] else 'DIFFERENT'}); "
        f"received per decode rank: {per_decode}",
        f"the decode group agreed on which requests to take in at {t['agreements']} iteration boundaries: as many "
        f"all-reduces of one int64 count, {t['agreement_bytes_per_rank']:.0f} bytes per decode rank in all",
    ]
    ll = r["llama2_7b"]
    lines += ["", f"the same formula at Llama-2-7B (K_tok = {ll['kv_bytes_per_token']:,} B/token, fp16), a "
                  f"{ll['prompt_tokens']}-token prompt = {ll['bytes'] / 1e9:.2f} GB; at the seeds' bandwidths: "
              + ", ".join(f"{name} {ms:.1f} ms" for name, ms in ll["ms"].items())]
    chk = r["check"]
    lines.append(render_check(chk))
    ok = r["ledger_matches_model"] and r["same_as_colocated"] and chk["ok"] in (True, None)
    lines.append(f"{'PASS' if ok else 'FAIL'}: P/D served {c['requests']} requests"
                 + (", tokens equal to the colocated engine" if r["same_as_colocated"]
                    else ", tokens DIFFER from the colocated engine")
                 + ("" if chk["ok"] is None else " and the dense oracle" if chk["ok"] else "; oracle check FAILED")
                 + ("" if r["ledger_matches_model"] else "; transfer ledger DIFFERS from the model"))
    return "\n".join(lines)


def build_pd_report(s, ctx, result, colocated: list[list[int]], checks: list[dict] | None) -> dict:
    m, layout = s.model, s.pd
    elem = s.dtype.itemsize
    k_tok = kv_bytes_per_token(m.n_layers, m.n_kv_heads, m.d_head, s.dtype)  # the dense cache's bytes per token
    per_decode_rank = kv_bytes_per_token_per_rank(m.n_layers, m.n_kv_heads, m.d_head, layout.decode_ranks, elem)
    requests = result.requests
    for req, ids in zip(requests, colocated):
        req["same_as_colocated"] = req["output_ids"] == ids
    sends = [t for t in result.transfers if t["kind"] == "send" and t["site"] == "pd/kv"]
    recvs = [t for t in result.transfers if t["kind"] == "recv" and t["site"] == "pd/kv"]
    pairs: dict[tuple[int, int], dict] = {}
    for t in sends:
        pair = pairs.setdefault((t["rank"], t["peer"]), {"prefill_rank": t["rank"], "decode_rank": t["peer"],
                                                         "heads": t["heads"], "messages": 0, "bytes": 0})
        pair["messages"] += 1
        pair["bytes"] += t["bytes"]
    handed_tokens = sum(r["prompt_length"] for r in requests if r["transfer_s"] is not None)
    total = sum(t["bytes"] for t in sends)
    per_decode = {rank: sum(t["bytes"] for t in recvs if t["rank"] == rank)
                  for rank in range(layout.prefill_ranks, layout.world_size)}
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "pd": {"prefill_ranks": layout.prefill_ranks, "decode_ranks": layout.decode_ranks,
               "prefill_pp": layout.prefill_pp, "streaming": s.streaming},
        "config": serve_config(s, ctx),
        "notes": list(s.notes),
        "kv_cache": {"block_size": s.engine.block_size, "decode_block_size": s.decode_block_size or s.engine.block_size,
                     # each side's pool; null: enough for its workload at its largest
                     "kv_blocks": s.engine.num_gpu_blocks_override,
                     "prefix_hit_tokens": sum(it["prefix_hit_tokens"] for it in result.prefill_iterations),
                     "peak_blocks_used": {side: max((it["blocks_used"] for it in its), default=0) for side, its in
                                          (("prefill", result.prefill_iterations),
                                           ("decode", result.decode_iterations))}},
        "totals": {"preemptions": sum(len(it["preempted"]) for it in
                                      result.prefill_iterations + result.decode_iterations)},
        "requests": requests,
        "transfer": {"pairs": sorted(pairs.values(), key=lambda x: (x["prefill_rank"], x["decode_rank"])),
                     "pair_count": len(pairs),
                     "pair_count_formula": layout.prefill_pp * pair_count(
                         m.n_kv_heads, layout.prefill_ranks // layout.prefill_pp, layout.decode_ranks),
                     "handed_over_tokens": handed_tokens, "kv_bytes_per_token": k_tok,
                     "kv_bytes_per_token_per_decode_rank": per_decode_rank,
                     # each decode rank receives its own cache share: K_tok in all unless decode ranks replicate
                     "total_bytes": total, "total_formula": handed_tokens * per_decode_rank * layout.decode_ranks,
                     "received_per_decode_rank": per_decode, "messages": len(result.transfers),
                     "agreements": result.agreements,
                     "agreement_bytes_per_rank": result.agreements * ring_bytes_per_rank(
                         "all_reduce", 1, layout.decode_ranks, 8)},
        "llama2_7b": llama_table(),
        "prefill_iterations": len(result.prefill_iterations), "decode_iterations": len(result.decode_iterations),
        "time_s": result.time_s,
        "ledger_matches_model": result.ledger_matches_model,
        "same_as_colocated": all(r["same_as_colocated"] for r in requests),
        "check": oracle_summary(requests, checks),
    }


def serve_config(s, ctx) -> dict:
    """The settings both reports record (P/D's whole config; the colocated one adds its own)."""
    return {"model_name": s.model_name, "model": s.model.asdict(), "requests": len(s.requests),
            "engine": s.engine.record(), "attention": choose(s.engine.attention, ctx.device),
            "variant": s.variant, "vocab_parallel": s.vocab_parallel, "dtype": str(s.dtype).removeprefix("torch."),
            "dtype_from": s.dtype_from, "seed": s.seed, "shared_prefix": s.shared_prefix}


def oracle_summary(requests: list[dict], checks: list[dict] | None) -> dict:
    """report.json's check: each request's verdict against the dense oracle (requests[i].match) and their counts;
    None without check."""
    if checks is None:
        return {"ok": None, "verdicts": None}
    for req, chk in zip(requests, checks):
        req["match"] = chk["verdict"]
    return {"ok": all(c["ok"] for c in checks),
            "verdicts": {v: sum(c["verdict"] == v for c in checks) for v in ("match", "near-tie", "MISMATCH")}}


def llama_table(prompt_tokens: int = 4096) -> dict:
    """seeds/06's transfer table from the same formula: Llama-2-7B's K_tok, a 4k prompt, the seeds' fabrics."""
    from tp.cost_model import FABRICS, LLAMA2_7B, kv_transfer_time

    return {"kv_bytes_per_token": LLAMA2_7B.kv_bytes_per_token, "prompt_tokens": prompt_tokens,
            "bytes": prompt_tokens * LLAMA2_7B.kv_bytes_per_token,
            "ms": {name: kv_transfer_time(LLAMA2_7B, prompt_tokens, bw) * 1e3 for name, bw in FABRICS.items()}}


def add_text(requests: list[dict], hf_checkpoint: str | None) -> None:
    """A checkpoint with tokenizer files: each request's generated ids decoded (requests[i].text); nothing otherwise."""
    from serve.llm import load_tokenizer

    tok = load_tokenizer(hf_checkpoint)
    if tok is not None:
        for req in requests:
            req["text"] = tok.decode(req["output_ids"], skip_special_tokens=True)


def kv_formula(m, n_layers: int, p: int, dtype: torch.dtype, cache_dtype: str = "auto") -> dict:
    """The cache's bytes per token: the dense model's (all layers), one rank's (its layers), the formula's words, the
    K,V heads per rank. MLA (deepseek_v3): the latent c + r per layer, whole on every rank. e: the model dtype's
    bytes, or 1 for a quantized cache (kv_cache_dtype fp8/int8; its scales are a fixed L·2·heads·4 bytes apart)."""
    elem = dtype.itemsize if cache_dtype == "auto" else 1
    if of(m).cache_layout(m, p)[0] == 1:  # one plane: MLA's latent, not K and V
        from tp.partition import mla_kv_bytes_per_token

        per_rank = mla_kv_bytes_per_token(n_layers, m.kv_lora_rank, m.qk_rope_head_dim, elem)
        return {"dense": mla_kv_bytes_per_token(m.n_layers, m.kv_lora_rank, m.qk_rope_head_dim, elem),
                "per_rank": per_rank, "text": "L·(c + r)·e, the latent whole on every rank", "heads_per_rank": 1,
                "n_kv_heads": None}
    return {"dense": kv_bytes_per_token_per_rank(m.n_layers, m.n_kv_heads, m.d_head, 1, elem),
            "per_rank": kv_bytes_per_token_per_rank(n_layers, m.n_kv_heads, m.d_head, p, elem),
            "text": "2·L·max(h_kv/p, 1)·d_head·e", "heads_per_rank": kv_heads_per_rank(m.n_kv_heads, p),
            "n_kv_heads": m.n_kv_heads}


def build_report(s, ctx, result, checks: list[dict] | None) -> dict:
    m = s.model
    p = ctx.world_size // s.pp // s.cp  # the TP group's size (a pipeline stage's; cp: world / cp)
    n_layers = len(stage_layers(m.n_layers, s.pp)[ctx.rank // (ctx.world_size // s.pp)])  # this rank's stage's
    kv = kv_formula(m, n_layers, p, s.dtype, s.engine.kv_cache_dtype)
    dense_per_token = kv["dense"]
    requests = result.requests
    for req, chk in zip(requests, checks or []):
        req["check"] = chk
    generated = sum(r["generated"] for r in requests)
    its = result.iterations
    return {
        "world_size": ctx.world_size, "tp": p, "backend": ctx.backend, "device": str(ctx.device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "config": {**serve_config(s, ctx), "hf_checkpoint": s.hf_checkpoint,
                   "eos_id": s.eos_id, "eos_from": s.eos_from, "check": s.check, "pp": s.pp, "cp": s.cp,
                   "pp_boundary": s.pp_boundary, "moe_parallel": s.moe_parallel if of(m).moe else None,
                   "sampling": s.sampling},
        "notes": list(s.notes),
        "iterations": its,
        "requests": requests,
        "totals": {"iterations": len(its), "generated_tokens": generated, "time_s": result.time_s,
                   "tokens_per_s": generated / result.time_s if result.time_s else None,
                   "mixed_iterations": sum(1 for it in its if it["decodes"] and it["prefill_chunks"]),
                   "collectives": sum(sum(it["collectives"].values()) for it in its),
                   "bytes_per_rank": sum(it["bytes_per_rank"] for it in its),
                   "preemptions": result.preemptions, "rows_computed": result.rows_computed},
        "kv_cache": {"block_size": result.block_size, "blocks": result.num_blocks,
                     "cache_dtype": s.engine.kv_cache_dtype,  # auto: the model's dtype; fp8_e4m3 | fp8_e5m2 | int8
                     "prefix_hit_tokens": result.prefix_hit_tokens, "peak_blocks_used": result.peak_blocks_used,
                     "evicted_blocks": result.evicted_blocks,  # kv_eviction: blocks no later query read, given back
                     "pool_bytes_per_rank": result.kv_pool_bytes_per_rank,
                     "bytes_per_token_per_rank": result.kv_bytes_per_token_per_rank,
                     "formula_bytes_per_token_per_rank": kv["per_rank"], "formula": kv["text"],
                     "kv_heads_per_rank": kv["heads_per_rank"], "n_kv_heads": kv["n_kv_heads"],
                     "bytes_per_token_dense": dense_per_token,
                     "ratio_to_dense": result.kv_bytes_per_token_per_rank / dense_per_token,
                     "peak_bytes_per_rank": result.kv_peak_bytes_per_rank,
                     # what the cache tensors held against the formula (no request admitted: nothing held)
                     "matches_formula": result.kv_bytes_per_token_per_rank in (0, kv["per_rank"]),
                     # context parallelism: a pool slot holds one position, and each cp rank 1/cp of every request's
                     "bytes_per_request_token_per_rank": result.kv_bytes_per_token_per_rank / s.cp},
        "ledger_matches_model": result.ledger_matches_model,
        "check": {**oracle_summary(requests, checks),
                  "max_logit_rel_err": None if checks is None else max(c["max_logit_rel_err"] for c in checks)},
    }
