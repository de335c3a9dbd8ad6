"""Prefill/decode disaggregation (seeds/06): a prefill group and a decode group of TP ranks, one world.

    global ranks 0 .. p_P−1: the prefill group;  p_P .. p_P+p_D−1: the decode group

Each group runs the TP stack sharded over itself (its own TPLM) and the engine of serve/engine.py:

    prefill side   every request as if max_new_tokens were 1: (chunked) prefill, and the chunk that
                   completes a prompt samples the request's first token. The prefill side emits token 1,
                   as in seeds/06's flow (time to first token = the prefill; the hand-over and the first
                   decode iteration come before token 2).
    hand-over      the request's K,V for positions [0, N) of every layer go to the decode group by
                   point-to-point messages. Prefill rank r holds heads [r·h/p_P, (r+1)·h/p_P), decode rank s
                   needs [s·h/p_D, (s+1)·h/p_D): every overlapping (r, s) pair moves the heads they share
                   (tp/traffic_model.head_overlaps: p_P + p_D − gcd pairs, L_p·K_tok bytes in all, 1/p_D of
                   it to each decode rank), re-sharding heads in flight when p_P ≠ p_D. With grouped-query
                   attention (Llama) the heads are the h_kv K,V heads; a head replicated on several prefill
                   ranks is sent by the lowest, and each decode rank holding a replica receives it. Token 1 goes to each
                   decode rank from the lowest prefill rank overlapping it. Either sent after the prefill (one
                   message per pair) or streamed: layer ℓ leaves as soon as the prompt's last chunk has passed
                   layer ℓ, while the later layers still compute.
    decode side    each handed-over request is added to the decode group's engine with its prompt already
                   computed and token 1 in its output (LLMEngine.add_computed: blocks for its prompt, its K,V
                   written at their slots), and joins the continuous batch as a decode row.

Each side is an LLMEngine driven by serve.engine.Engine, and PrefillSide / DecodeSide are its StepHooks.

No control messages cross the groups. Which requests complete their prefill in which prefill iteration depends
only on the requests and the scheduler settings, so every rank computes it (`prefill_schedule`): the decode ranks
know what will come, from whom and in which order, and post their receives ahead. A request joins the decode
batch at the first iteration boundary at which its K,V have landed on every decode rank (★ one all-reduce of a
count over the decode group per boundary: every decode rank takes in the same requests). Every message goes
through the traffic ledger (`TrafficLedger.transfers`) and equals tp/traffic_model.predict_transfers.
Times across the two groups compare time.perf_counter() of processes on one host (CLOCK_MONOTONIC).

    plan.py        the layout, the prefill schedule every rank computes, the pools' check (host only)
    handover.py    PrefillSide / DecodeSide: the hand-over's messages, hooks on each group's engine
    run.py         serve_pd: both engines on one world, and the per-request result
"""

from serve.pd.handover import DecodeSide, HandoverTimeout, PrefillSide, warm_up_pairs
from serve.pd.plan import Layout, check_pools, prefill_schedule, validate_layout
from serve.pd.run import PDResult, new_groups, serve_pd

__all__ = ["Layout", "validate_layout", "prefill_schedule", "check_pools", "HandoverTimeout", "PrefillSide",
           "DecodeSide", "warm_up_pairs", "PDResult", "new_groups", "serve_pd"]
