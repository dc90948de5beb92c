"""sm90 builds of sparse_attn_decode's warp-specialised program (H 64, D 512, a 256K-row pool, 640 selected entries)
for test_sparse_attn_ws / _s9 / _s10, once per session per program: several tests read the same kernel (an option's
build next to the plain config's, the s10 defaults that s9 also checks, the trace build), and one build is ~20 CPU
seconds on the CI box (lowering ~11, nvcc ~9). The artifacts live in the session's codegen cache (the tests ask for
the `codegen_cache` fixture); treat them as read-only."""

from __future__ import annotations

import functools

from deepinfer.codegen.kernels import sparse_attn_decode as sad


@functools.cache
def ws_program(B: int, cfg: sad.Config, n_win: int = 0, kv_fp8: bool = False):
    return sad.program(B, 64, 512, 1 << 18, 640, target="sm90", cfg=cfg, kv_fp8=kv_fp8, n_win=n_win)


@functools.cache
def build_ws(B: int, cfg: sad.Config, n_win: int = 0, kv_fp8: bool = False):
    """tilelang_backend.build of ws_program under the pass configs tilelang.compile applies from the program's attr."""
    import tvm

    from deepinfer.codegen import tilelang_backend as tb

    func = ws_program(B, cfg, n_win, kv_fp8)
    with tvm.transform.PassContext(config=sad.WS_PASS_CONFIGS):
        return tb.build(f"sparse_attn_ws_B{B}_{cfg.tag}_{int(kv_fp8)}_{n_win}", func, "sm90")
