"""Kernel generation: targets as data, the TileLang backend, and one module per kernel family.

    targets            cpu / sm90 / sm100 / ascend950 (get_target)
    tilelang_backend   lower -> CUDA C++ / AscendC, nvcc -> cubin, cuobjdump -> SASS opcode counts (cached)
    tuner              autotuner + persistent JSON tuning database (`deepinfer tune`)
    kernels/           fp8_gemm, moe_grouped_gemm, rmsnorm_quant, moe_routing, hyper_connection,
                       sparse_attn_decode, rope: TileLang factory, torch reference, config space, roofline
                       (plus Triton and Ascend variants where they exist)

Importing this package imports neither tilelang nor triton. TileLang is imported by the factories when
called; rmsnorm_quant and moe_routing import triton at module import when it is installed (their
Triton variants need `tl` as a module global for the interpreter).
"""
