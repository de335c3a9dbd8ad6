"""Prefill/decode disaggregation (docs/pd.md; seeds/06): a prefill group and a decode group of TP ranks in one world,
each running serve/engine.py's engine over its own TPLM, and each request's K,V handed from one to the other.

    global ranks 0 .. p_P−1: the prefill group;  p_P .. p_P+p_D−1: the decode group

    prefill side   every request as if max_new_tokens were 1: (chunked) prefill, and the chunk that completes a
                   prompt samples token 1 (time to first token = the prefill)
    hand-over      positions [0, N) of every layer's K,V by point-to-point messages, each overlapping (prefill rank,
                   decode rank) pair moving the heads it shares (re-sharded in flight when p_P ≠ p_D), and token 1;
                   after the prefill, or streamed layer by layer while the later layers still compute
    decode side    each handed-over request is added with its prompt computed and token 1 in its output
                   (LLMEngine.add_computed) and joins the continuous batch as a decode row

No control messages cross the groups: every rank computes which prompts complete in which prefill iteration
(`prefill_schedule`), so the decode ranks post their receives ahead, and ★ one all-reduce of a count per iteration
boundary makes every decode rank take in the same landed requests. Every message goes through the traffic ledger
and equals tp/traffic_model.predict_transfers.

    plan.py        the layout, the prefill schedule every rank computes, the pools' check (host only)
    handover.py    PrefillSide / DecodeSide: the hand-over's messages, hooks on each group's engine
    run.py         serve_pd: both engines on one world, and the per-request result
"""

from serve.pd.handover import DecodeSide, HandoverTimeout, PrefillSide, warm_up_pairs
from serve.pd.plan import Layout, check_pools, prefill_schedule, validate_layout
from serve.pd.run import PDResult, new_groups, serve_pd

__all__ = ["Layout", "validate_layout", "prefill_schedule", "check_pools", "HandoverTimeout", "PrefillSide",
           "DecodeSide", "warm_up_pairs", "PDResult", "new_groups", "serve_pd"]
