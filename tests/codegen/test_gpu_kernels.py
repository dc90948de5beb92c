"""Every kernel family against its torch reference on the GPU, at real DeepSeek-V4.1-Flash shapes.

Marked `gpu`: skipped with a reason where there is no CUDA device (tests/conftest.py). Each test draws
fresh random inputs (the CUDA generator is not seeded), builds the TileLang (or Triton) kernel for sm_90a,
runs it and compares with the reference; the cases are the benchmark's (benchmarks/kernels_h200.py) run
in check-only mode, so the benchmark table and these tests check exactly the same thing.

    python3 -m pytest tests/codegen/test_gpu_kernels.py -m gpu -v      # on the H200
"""

import functools

import pytest

pytestmark = pytest.mark.gpu



H, QL, HEADS, HD, INTER = 5120, 1280, 64, 512, 2304


@pytest.mark.parametrize(
    "M,N,K", [(4096, QL, H), (4096, HEADS * HD, QL), (4096, H, 8192), (4096, 2 * INTER, H), (64, HEADS * HD, QL)]
)
@pytest.mark.parametrize("cfg_name", ["default", "sm90_overlap", "sm90_best"])
def test_fp8_gemm_v41(kb, run_case, M, N, K, cfg_name):
    from deepinfer.codegen.kernels import fp8_gemm

    cfg = {
        "default": fp8_gemm.default_config(32),
        "sm90_overlap": fp8_gemm.Config(128, 128, 64, 4, 256, True, True),
        "sm90_best": fp8_gemm.sm90_config(M, N, 32),
    }[cfg_name]
    run_case(kb.case_fp8_gemm, M, N, K, 32, cfg)


def test_fp8_gemm_v4_groups_of_128(kb, run_case):
    from deepinfer.codegen.kernels import fp8_gemm

    run_case(kb.case_fp8_gemm, 4096, HEADS * HD, QL, 128, fp8_gemm.default_config(128))
    run_case(kb.case_fp8_gemm, 4096, HEADS * HD, QL, 128, fp8_gemm.sm90_config(4096, HEADS * HD, 128))


_PERSISTENT = [("ws 128x256", 1), ("ws 128x256 pp", 1), ("ws 128x128", 1), ("ws 128x128 ovl", 1),
               ("ws 128x256", 2), ("ws 128x256 pp", 2), ("ws 128x128 ovl", 2),  # the sweep has no c2 plain 128x128
               ("ws 128x256 s4d", 1), ("ws 128x256 pp s4d", 2)]  # 4 stages, epilogue from registers


@pytest.mark.parametrize("name,cluster", _PERSISTENT)
@pytest.mark.parametrize("g", [128, 32])
def test_fp8_gemm_persistent(kb, run_case, g, name, cluster):
    """The sweep's persistent warp-specialised configs: 20 M tiles (a narrower last L2 panel), several
    waves with a partial last one, 10 K blocks (overlap pairs them), 2-CTA clusters multicasting B."""
    cfg = kb.sweep_configs(g, 2560, 4096, cluster)[name]
    run_case(kb.case_fp8_gemm, 2560, 4096, 1280, g, cfg)


def test_moe_grouped_gemm_contiguous(kb, run_case):
    run_case(kb.case_grouped_gemm, 4096, 48)  # sm90_config: fp8_gemm's 2-warpgroup overlapped main loop


@pytest.mark.parametrize(
    "name", ["ws 128x256 pp", "ws 128x256", "ws 128x128 ovl", "ws 128x256 pp s4d", "ws 128x256 pp c2n"]
)
@pytest.mark.parametrize("g", [128, 32])
def test_moe_grouped_gemm_contiguous_persistent(kb, run_case, g, name):
    """fp8_gemm's persistent warp-specialised program with experts (the benchmark's "grouped_gemm ws" rows), at 1024
    tokens: ~50 M tiles over 132 CTAs, several tiles per expert, partial last tiles of every expert."""
    dims = kb.V4_FLASH_EXPERT if g == 128 else (2 * INTER, H)
    run_case(functools.partial(kb.case_grouped_gemm, cfg=kb.grouped_ws_configs(g)[name], g=g, dims=dims), 1024, 48)


def test_moe_grouped_gemm_contiguous_portable_config(kb, run_case):
    from deepinfer.codegen.kernels import fp8_gemm

    run_case(functools.partial(kb.case_grouped_gemm, cfg=fp8_gemm.default_config(32)), 512, 48)  # plain loop


@pytest.mark.parametrize("fmt,swiglu", [("fp8", True), ("fp4", False), ("fp4", True)])  # fp8 plain: above
def test_moe_grouped_gemm_contiguous_epilogue_and_w4a8(kb, run_case, fmt, swiglu):
    run_case(functools.partial(kb.case_grouped_gemm, fmt=fmt, swiglu=swiglu), 1024, 48)


@pytest.mark.parametrize("T_", [256, 64, 16])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_moe_grouped_gemm_masked(kb, run_case, T_, fmt):
    run_case(functools.partial(kb.case_grouped_gemm_masked, fmt=fmt), T_, 48, 64)  # swap-AB program


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_moe_grouped_gemm_masked_swiglu(kb, run_case, fmt):
    run_case(functools.partial(kb.case_grouped_gemm_masked, fmt=fmt, swiglu=True), 64, 48, 64)


def test_moe_grouped_gemm_masked_old_program(kb, run_case):
    run_case(functools.partial(kb.case_grouped_gemm_masked, old=True), 16, 48, 64)


@pytest.mark.parametrize("T_", [4096, 64])
@pytest.mark.parametrize("quant", [False, True])
def test_rmsnorm(kb, run_case, T_, quant):
    run_case(kb.case_rmsnorm, T_, H, quant)


def test_rmsnorm_quant_triton(kb, run_case):
    run_case(kb.case_rmsnorm_triton, 4096, H)


@pytest.mark.parametrize("T_", [4096, 64])
@pytest.mark.parametrize("triton_variant", [False, True])
def test_moe_routing(kb, T_, triton_variant):
    row = kb.Row("test", "")
    kb.case_routing(row, T_, True, False, triton_variant)
    assert row.check


@pytest.mark.parametrize("T_", [4096, 64])
def test_hc_pre(kb, run_case, T_):
    run_case(kb.case_hc_pre, T_)


@pytest.mark.parametrize("T_", [4096, 64])
def test_hc_post(kb, run_case, T_):
    run_case(kb.case_hc_post, T_)


@pytest.mark.parametrize("B", [1, 16, 64, 128, 256])
def test_sparse_attn_decode(kb, run_case, B):
    run_case(kb.case_attn_decode, B, 640)  # sm90_config: the ws program, split-K + combine below 119 requests


@pytest.mark.parametrize("B", [1, 64, 128])
def test_sparse_attn_decode_fp8_kv(kb, run_case, B):
    run_case(functools.partial(kb.case_attn_decode, fp8=True), B, 640)  # e4m3 + ue8m0 KV, dequant in smem


@pytest.mark.parametrize(
    "name", ["lookahead", "lookahead_fp8", "n32s4", "n64_nosplit", "portable_split", "l2_prefetch", "l2_prefetch_n32s4"]
)
def test_sparse_attn_decode_other_configs(kb, run_case, name):
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    cfg, fp8 = {
        "lookahead": (sad.Config(64, 384, 2, 2, True, True), False),  # 5 blocks: the lookahead's ring tail
        "lookahead_fp8": (sad.Config(32, 384, 1, 2, True, True), True),
        "n32s4": (sad.Config(32, 384, 2, 4, True), False),  # 10 blocks in a 4-stage ring: 2 rounds + 2 tail
        "n64_nosplit": (sad.Config(64, 384, 1, 2, True), False),
        "portable_split": (sad.portable_split_config(64, 640), False),  # the previous default
        "l2_prefetch": (sad.Config(64, 384, 2, 2, True, l2_prefetch=2), False),  # 5 blocks: targets past the end
        "l2_prefetch_n32s4": (sad.Config(32, 384, 2, 4, True, l2_prefetch=1), False),
    }[name]
    run_case(functools.partial(kb.case_attn_decode, cfg=cfg, fp8=fp8), 64, 640)


@pytest.mark.parametrize("name", ["default_B128", "default_B64_split", "fp8_B64", "l2_prefetch_B128"])
def test_sparse_attn_decode_two_pools(kb, run_case, name):
    """Window + compressed pools, two index lists (program(n_win=128)): request 0's window partly -1."""
    from deepinfer.codegen.kernels import sparse_attn_decode

    B, cfg, fp8 = {
        "default_B128": (128, None, False),
        "default_B64_split": (64, None, False),
        "fp8_B64": (64, None, True),
        "l2_prefetch_B128": (128, sparse_attn_decode.Config(64, 384, 1, 2, True, l2_prefetch=1), False),
    }[name]
    run_case(functools.partial(kb.case_attn_decode, cfg=cfg, fp8=fp8, n_win=128), B, 640)


@pytest.mark.parametrize("B", [1, 16, 64])
def test_sparse_attn_decode_wide_combine(kb, run_case, B):
    """combine_program_wide after the default split kernel: 20 / 10 chunks (Op read after the weights), 2
    chunks (Op preloaded); request 0's second half of entries is -1 (whole chunks of invalid entries)."""
    run_case(functools.partial(kb.case_attn_decode, wide_combine=True), B, 640)


def test_sparse_attn_decode_single_pass_config(kb, run_case):
    from deepinfer.codegen.kernels import sparse_attn_decode

    run_case(functools.partial(kb.case_attn_decode, cfg=sparse_attn_decode.Config()), 64, 640)


@pytest.mark.parametrize(
    "T_,topk,persist,start,ratio",
    [(4096, 640, False, 0, 2), (4096, 640, True, 0, 2), (8192, 1152, True, 0, 2), (1000, 640, True, 8192, 1),
     (4096, 640, "lookahead", 0, 2)],
    ids=["T4096", "T4096_persist", "T8192_k1152_persist", "T1000_second_chunk_persist", "T4096_persist_lookahead"],
)
def test_sparse_attn_prefill(kb, run_case, T_, topk, persist, start, ratio):
    """A prefill chunk through the decode program at B = T (prefill_config) and the persistent grid: window lists
    from window_indices (causal, -1 before position 0), each token's own compressed selection (-1 past what it
    sees), against the graph op's reference. T1000: 1000 tokens over 132 CTAs (uneven: 7 or 8 tokens a CTA)."""
    import dataclasses

    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    cfg = sad.prefill_config(T_, topk, persist=bool(persist))
    assert bool(cfg.persist) == bool(persist)
    if persist == "lookahead":
        cfg = dataclasses.replace(cfg, lookahead=True)
    run_case(functools.partial(kb.case_attn_prefill, cfg=cfg, start=start, ratio=ratio, eager=False), T_, topk)


@pytest.mark.parametrize("B", [64, 16, 1])
def test_sparse_attn_decode_bf16_partials(kb, run_case, B):
    """Config.partial_bf16: the split pass writes its chunks' outputs in bf16, the combine (wide at B64) reads them;
    two pools, request 0's second half of entries -1 (whole chunks of invalid entries: weight 0)."""
    import dataclasses

    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    base = sad.sm90_config(B, 640)
    base = base if base.num_split > 1 else sad.Config(64, 384, 2, 2, True)  # B64: unsplit by default since session 9
    cfg = dataclasses.replace(base, partial_bf16=True)
    run_case(functools.partial(kb.case_attn_decode, cfg=cfg, n_win=128), B, 640)


@pytest.mark.parametrize("T_", [64, 8192])
def test_sparse_attn_q_operand(kb, run_case, T_):
    """The attention adapter's one-launch q prologue (RoPE of the last 64 channels into the bf16 operand) against
    its torch formulation: within one bf16 step."""
    run_case(kb.case_attn_q_operand, T_)


@pytest.mark.parametrize("B,n_win", [(300, 128), (256, 0)])
def test_sparse_attn_persist_is_the_single_pass_bit_for_bit(kb, B, n_win):
    """The persistent grid computes each request as one CTA a request does (the same blocks in the same order, the
    same expressions): on the same inputs the outputs are equal bit for bit (two pools: 300 requests, uneven over
    132 CTAs; one pool: the program's other entry). A difference here is a hand-off bug, not rounding."""
    import torch

    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    q = torch.randn(B, HEADS, HD, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(kb.ATTN_POOL, HD, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, kb.ATTN_POOL, (B, 640), device="cuda", dtype=torch.int32)
    if n_win:  # window entries in the window pool, the others above it
        idx[:, :n_win] %= kb.ATTN_WIN_POOL
        idx[:, n_win:] = kb.ATTN_WIN_POOL + idx[:, n_win:] % (kb.ATTN_POOL - kb.ATTN_WIN_POOL)
    idx[:, -7:] = -1
    idx[0, 320:] = -1
    idx[1, :64] = -1  # a whole first block invalid (the mask of a request's first block after another's last)
    sink = torch.randn(HEADS, device="cuda")
    kv_in, idx_in = kb._attn_two_pool_args(kv, idx, n_win) if n_win else (kv, idx)
    outs = []
    for cfg in (sad.Config(64, 384, 1, 2, True), sad.Config(64, 384, 1, 2, True, persist=132)):
        outs.append(torch.empty_like(q))
        kb._attn_kernel(B, 640, cfg, False, False, n_win)(q, kv_in, idx_in, sink, outs[-1])
    diff = (outs[0].float() - outs[1].float()).abs()
    assert torch.equal(outs[0], outs[1]), f"{int((diff > 0).sum())} values differ, max {diff.max().item():.3e}"


@pytest.mark.parametrize("B", [256, 100])
def test_sparse_attn_decode_persist(kb, run_case, B):
    """The persistent grid at decode (two pools): B256 = 2 requests on most CTAs, B100 leaves 32 CTAs idle."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    run_case(functools.partial(kb.case_attn_decode, cfg=sad.Config(64, 384, 1, 2, True, persist=132), n_win=128),
             B, 640)  # fmt: skip


@pytest.mark.parametrize("T_", [4096, 64])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(kb, run_case, T_, inverse):
    run_case(kb.case_rope, T_, inverse)
