"""Serving on the TP stack: the engine as a library, and the pieces it is made of.

    from serve import LLM, SamplingParams
    LLM("article03", tensor_parallel_size=2).generate([[464, 3290]], SamplingParams(max_tokens=8))

    llm.py             LLM: starts the ranks, text in and out, generate(); vLLM's online calls (add_request, step, ...)
    engine.py          LLMEngine (every rank): control message -> schedule -> agree -> run -> update; Engine: a
                       known workload added at its arrivals and stepped through (launch/serve.py, P/D, tests)
    scheduler.py       who runs this iteration (plain Python, no torch): finish, carry, chunk, admit, preempt
    block_manager.py   KV memory as pages (plain Python, no torch): block tables, prefix caching, reference counts
    model_runner.py    a plan -> the step's tensors -> one forward through the TP model -> sampled ids
    request.py         one request's tokens and status; sampling_params.py: how it is decoded; outputs.py: results
    config.py          EngineConfig: every engine setting, its default and its check, once
    plan.py            the per-iteration plan: each request's (q_start, q_end, kv_length) triple and block table
    inputs.py          a plan -> the iteration's tensors (ids, positions, slot mapping, attention groups), once
    kv_cache.py        each rank's pool of blocks: K,V of its own heads only, one tensor allocated once
    detokenizer.py     ids -> text as they arrive (no split characters), stop strings
    worker.py          the rank processes behind LLM
    pd/                prefill/decode disaggregation: two engines, K,V handed over between two groups of ranks
"""

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
_HOMES = {"LLM": "serve.llm", "SamplingParams": "serve.sampling_params", "EngineConfig": "serve.config",
          "RequestOutput": "serve.outputs", "CompletionOutput": "serve.outputs"}


def __getattr__(name: str):
    """`from serve import LLM` imports serve/llm.py (and torch) only then: the scheduler and the block manager stay
    plain Python to import."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'serve' has no attribute {name!r}")
