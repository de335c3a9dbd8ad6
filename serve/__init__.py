"""Serving on the TP stack: per-iteration plans, the ORCA scheduler over paged KV memory, the engine loop.

    plan.py           the per-iteration plan: each request's (q_start, q_end, kv_length) triple and block table
    block_manager.py  KV memory as pages (plain Python, no torch): block tables, prefix caching, reference counts
    scheduler.py      who runs this iteration (plain Python, no torch): finish, carry, chunk, admit, preempt
    inputs.py         a plan -> the iteration's tensors (ids, positions, slot mapping, attention groups), once
    kv_cache.py       each rank's pool of blocks: K,V of its own heads only, one tensor allocated once
    engine.py         the loop: plan -> inputs -> one forward through the TP LM -> greedy tokens
    disagg.py         prefill/decode disaggregation: two engines, K,V handed over between two groups of ranks
"""
