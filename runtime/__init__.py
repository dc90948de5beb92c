"""The runtime: execute a compiled plan.

    plan.py       Plan on disk (write_plan / load_plan) and bind_weights
    session.py    one sequence through the interpreter (the reference the engine is tested against)
    kv_cache.py   paged blocks for growing caches, per-request slots for state caches, prefix reuse
    scheduler.py  continuous batching, chunked prefill, preemption by recompute, asynchronous scheduling
    executor.py   one scheduled batch through the graph (interpreter on cpu; ModelRunner is the kernel seam)
    sampler.py    SamplingParams, penalties/filters, counter-keyed (Philox) per-request sampling
    engine.py     LLM (generate / stream / add_request / abort / step) and RequestOutput
"""
