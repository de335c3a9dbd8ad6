"""Serving on the TP stack: per-iteration plans, the ORCA scheduler, per-rank KV caches, the engine loop.

    plan.py       the per-iteration plan: each request's (q_start, q_end, kv_length) triple
    scheduler.py  who runs this iteration (plain Python, no torch): evict, admit, carry, chunk
    kv_cache.py   each rank's K,V of its own heads, one contiguous region per request
    engine.py     the loop: plan -> tensors -> one forward through the TP LM -> greedy tokens
"""
