"""Kernel generation: targets as data, the TileLang backend, and one module per kernel family.

    targets            cpu / sm90 / sm100 / ascend950 (get_target)
    tilelang_backend   lower -> CUDA C++ / AscendC, nvcc -> cubin, cuobjdump -> SASS opcode counts (cached)
    kernels/           fp8_gemm, moe_grouped_gemm, rmsnorm_quant, moe_routing, hyper_connection,
                       sparse_attn_decode: TileLang factory, torch reference, config space, roofline
                       (plus Triton and Ascend variants where they exist)

Importing this package does not import tilelang or triton; the factories do, when called.
"""
