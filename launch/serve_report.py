"""What rank 0 of launch/serve.py prints: the iteration table, the request table, the verdicts."""

from __future__ import annotations

from launch.loading import render_load
from launch.report import format_table, kib

SHOW_FIRST, SHOW_LAST = 30, 10  # longer runs print these iterations; report.json keeps all of them


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids)) or "-"


def _kv(m: dict) -> str:
    """h_kv for Llama models (grouped-query attention); nothing for GPT-2's multi-head attention."""
    return f"h_kv={m['n_kv_heads']} " if "n_kv_heads" in m else ""


def _moe(c: dict) -> str:
    """MoE models: the experts and where they live."""
    m = c["model"]
    return (f"; {m['n_experts']} experts of ffn={m['d_ffn']}, top_k={m['top_k']}, moe_parallel={c['moe_parallel']}"
            if "n_experts" in m else "")


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


def render(r: dict) -> str:
    c, m, t, kv = r["config"], r["config"]["model"], r["totals"], r["kv_cache"]
    lines = [
        f"tpref: serving on the TP stack  (tp = {r.get('tp', r['world_size'])}"
        + (f", pp = {r['pp']['pp']} stages, boundary {r['pp']['boundary']}"
           + (", chunk_pipelining" if r["config"].get("chunk_pipelining") else "") if r.get("pp") else "")
        + f", backend {r['backend']}, device {r['device']})",
        f"model {c['model_name']}: d={m['d_model']} h={m['n_heads']} {_kv(m)}d_head={m['d_head']} ffn={m['d_ffn']} "
        f"L={m['n_layers']} vocab={m['vocab_size']}; variant {c['variant']}, "
        f"{'vocab-parallel' if c['vocab_parallel'] else 'replicated'} embedding and LM head; dtype={c['dtype']}"
        + _from(c) + _moe(c) + _eos(c),
        f"{c['requests']} requests; chunk_size={c['chunk_size']} max_batched_tokens={c['max_batched_tokens']} "
        f"max_running={c['max_running'] if c['max_running'] is not None else c['max_batched_tokens']}; "
        f"KV pool of {kv['blocks']} blocks of block_size={kv['block_size']} per rank, prefix_cache="
        f"{str(c['prefix_cache']).lower()}, attention={c['attention']}"
        + (f" ({c['attention_setting']})" if c.get("attention_setting", c["attention"]) != c["attention"] else "")
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
                     ", ".join(f"{n} {k}" for k, n in sorted(it["collectives"].items())) or "none",
                     kib(it["bytes_per_rank"]), _ms(it["time_s"]), "yes" if it["ledger_matches_model"] else "NO"])
    if len(rows) > SHOW_FIRST + SHOW_LAST:
        rows = rows[:SHOW_FIRST] + [["..."] + [""] * 12] + rows[-SHOW_LAST:]
    lines.append(format_table(["iter", "rows", "prefill chunks", "decodes", "finished", "admitted", "preempted",
                               "blocks used", "prefix hits", "collectives",
                               "sent/rank KiB", "time ms", "model"], rows))
    lines += ["", "per request (times from arrival; match: tokens vs the dense oracle; every generated id: report.json's "
                  "requests[i].output_ids):"]
    rows = [[q["request"], q["arrival"], q["prompt_length"], q.get("prefix_hit_tokens", 0), q["generated"],
             first_ids(q["output_ids"]), q.get("preemptions", 0), _ms(q["ttft_s"]), _ms(q["mean_tbt_s"]),
             q.get("match", "not checked")] for q in r["requests"]]
    lines.append(format_table(["request", "arrives at iter", "prompt", "prefix hits", "generated", "first ids",
                               "preempted", "TTFT ms", "mean TBT ms", "match"], rows))
    lines += render_texts(r["requests"])
    lines += [
        "",
        f"generated {t['generated_tokens']} tokens in {t['iterations']} "
        + (f"micro-batches ({r['pp']['stages'][0]['steps']} steps)" if r.get("pp") else "iterations") + f", {t['time_s']:.2f} s "
        f"({t['tokens_per_s']:.1f} tokens/s); {t['mixed_iterations']} iterations mixed prompt chunks and decodes",
        f"paged KV: {kv['blocks']} blocks x {kv['block_size']} positions per rank ({kib(kv['pool_bytes_per_rank'])} KiB "
        f"reserved), at most {kv['peak_blocks_used']} in use; {kv['prefix_hit_tokens']} prompt tokens from the prefix "
        f"cache; {t['rows_computed']} rows computed; {t['preemptions']} preemptions",
        f"KV cache per rank: {kv['bytes_per_token_per_rank']} bytes per token (dense {kv['bytes_per_token_dense']}, "
        f"ratio {kv['ratio_to_dense']:.4f} = 1/{round(1 / kv['ratio_to_dense'])}"
        + (f"; formula 2·L·max(h_kv/p, 1)·d_head·e = {kv['formula_bytes_per_token_per_rank']}"
           + (" with L the stage's layers" if r.get("pp") else "")
           if "formula_bytes_per_token_per_rank" in kv else "")
        + (f"; each K,V head on {r['world_size'] * kv['kv_heads_per_rank'] // kv['n_kv_heads']} ranks"
           if kv.get("n_kv_heads") and r["world_size"] > kv["n_kv_heads"] else "") + "); "
        f"peak {kib(kv['peak_bytes_per_rank'])} KiB; token embedding "
        f"{'= LM head' if r.get('lm_head_tied', True) else 'and the (untied) LM head'}: "
        f"{kib(r['embedding_bytes_per_rank'])} KiB per rank{'' if r.get('lm_head_tied', True) else ' each'} "
        + ("of the first stage (the last holds the head, a middle stage neither) " if r.get("pp") else "")
        + f"({'vocab-parallel' if c['vocab_parallel'] else 'replicated'})",
        f"traffic: {t['collectives']} collectives, {kib(t['bytes_per_rank'])} KiB sent per rank; "
        f"ledger matches model in every iteration: {str(r['ledger_matches_model']).lower()}",
    ]
    if r.get("pp"):
        lines += render_stages(r["pp"])
    chk = r["check"]
    if chk["ok"] is None:
        lines.append("check: off (check=true to compare with the dense oracle)")
    else:
        v = chk["verdicts"]
        lines.append(f"check vs dense oracle (whole-prefix recompute, no cache): {v['match']} match, "
                     f"{v['near-tie']} near-tie, {v['MISMATCH']} mismatch; max logit rel err "
                     f"{chk['max_logit_rel_err']:.2e}")
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
        f"{c['requests']} requests; chunk_size={c['chunk_size']} max_batched_tokens={c['max_batched_tokens']}; "
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
    m, pd = r["config"]["model"], r["pd"]
    h_kv = m.get("n_kv_heads", m["n_heads"])
    stages = pd.get("prefill_pp", 1)
    replicated = max(pd["prefill_ranks"] // stages, pd["decode_ranks"]) > h_kv
    per_rank = t.get("kv_bytes_per_token_per_decode_rank", t["kv_bytes_per_token"] // pd["decode_ranks"])
    lines += [
        (f"pairs: {t['pair_count']} = " + (f"{stages} stages x " if stages > 1 else "")
         + ("(a + b - gcd(a, b)) * p_D / b, a = min(p_P, h_kv), b = min(p_D, h_kv) = " if replicated and stages == 1
            else "((a + b - gcd(a, b)) * p_D / b, a = min(p_P, h_kv), b = min(p_D, h_kv)) = " if replicated
            else "(p_P + p_D - gcd(p_P, p_D)) = " if stages > 1 else "p_P + p_D - gcd(p_P, p_D) = ")
         + (f"{t['pair_count_formula']}" + (f" (p_P = {pd['prefill_ranks'] // stages} ranks per stage)"
                                            if stages > 1 else "") + "; "))
        + (f"total {kib(t['total_bytes'])} KiB = L_p * p_D * 2*L*max(h_kv/p_D, 1)*d_head*e = {t['handed_over_tokens']} "
           f"tokens x {pd['decode_ranks']} x {per_rank} B " if replicated else
           f"total {kib(t['total_bytes'])} KiB = L_p * K_tok = {t['handed_over_tokens']} tokens x "
           f"{t['kv_bytes_per_token']} B ")
        + f"= {kib(t['total_formula'])} KiB ({'equal' if t['total_bytes'] == t['total_formula'] else 'DIFFERENT'}); "
        f"received per decode rank: {per_decode}",
        f"the decode group agreed on which requests to take in at {t['agreements']} iteration boundaries: as many "
        f"all-reduces of one int64 count, {t['agreement_bytes_per_rank']:.0f} bytes per decode rank in all",
    ]
    ll = r["llama2_7b"]
    lines += ["", f"the same formula at Llama-2-7B (K_tok = {ll['kv_bytes_per_token']:,} B/token, fp16), a "
                  f"{ll['prompt_tokens']}-token prompt = {ll['bytes'] / 1e9:.2f} GB; at the seeds' bandwidths: "
              + ", ".join(f"{name} {ms:.1f} ms" for name, ms in ll["ms"].items())]
    chk = r["check"]
    if chk["ok"] is None:
        lines.append("check: off (check=true to compare with the dense oracle)")
    else:
        v = chk["verdicts"]
        lines.append(f"check vs dense oracle: {v['match']} match, {v['near-tie']} near-tie, {v['MISMATCH']} mismatch")
    ok = r["ledger_matches_model"] and r["same_as_colocated"] and chk["ok"] in (True, None)
    lines.append(f"{'PASS' if ok else 'FAIL'}: P/D served {c['requests']} requests"
                 + (", tokens equal to the colocated engine" if r["same_as_colocated"]
                    else ", tokens DIFFER from the colocated engine")
                 + ("" if chk["ok"] is None else " and the dense oracle" if chk["ok"] else "; oracle check FAILED")
                 + ("" if r["ledger_matches_model"] else "; transfer ledger DIFFERS from the model"))
    return "\n".join(lines)
