"""sparse_attn_decode with fewer heads than the MMA's 16 rows (the small V4.1 preset: 8 heads of 128, bf16 KV caches):
the portable program pads the query rows to 16 and never stores the padding (session 11: every such build failed on
the H200 with "M must be divisible by 16, but got 8", so the small e2e ran its attention as torch references).

CPU: the c-target build's output at 8 heads equals the float64 oracle (one pool and the SWA + compressed pair, single
pass and split + combine; outputs start as NaN, so an unwritten element fails). sm_90a: the configs sm90_config gives
the small preset's decode buckets lower and compile with nvcc (no spills)."""

import pytest
import torch

from deepinfer.codegen.kernels import sparse_attn_decode as sad

H, D = 8, 128  # the small preset's attention heads and head dim


def _operands(B: int, S: int, K: int, seed: int):
    torch.manual_seed(seed)
    q, kv, sink = torch.randn(B, H, D), torch.randn(S, D), torch.randn(H) * 2
    idx = torch.randint(0, S, (B, K), dtype=torch.int32)
    idx[0, -7:] = -1  # invalid entries weigh 0
    return q, kv, idx, sink


@pytest.mark.parametrize("n_win", [0, 128])
@pytest.mark.parametrize("split", [1, 2])
def test_eight_heads_cpu_matches_the_oracle(tilelang_required, n_win, split):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    B, S, K = 3, 300, 192
    q, kv, idx, sink = _operands(B, S, K, seed=split * 10 + n_win)
    cfg = sad.Config(32, 256, split, 2)
    pools = (kv, kv) if n_win else kv
    ids = (idx[:, :n_win].contiguous(), idx[:, n_win:].contiguous()) if n_win else idx
    out = torch.full((B, H, D), float("nan"))
    progs = sad.split_programs(B, H, D, S, K, target="cpu", cfg=cfg, n_win=n_win, S_cmp=S) if split > 1 else None
    if progs:
        sad.run_split(tuple(compile_cpu(f) for f in progs), q, pools, ids, sink, out, split)
    else:
        kernel = compile_cpu(sad.program(B, H, D, S, K, target="cpu", cfg=cfg, n_win=n_win, S_cmp=S))
        kernel(q, *(pools if n_win else (pools,)), *(ids if n_win else (ids,)), sink, out)
    assert (out - sad.reference_f64_loops(q, kv, idx, sink)).abs().max() < 1e-5


@pytest.mark.parametrize("B", [1, 64])
def test_eight_heads_sm90_builds(codegen_cache, nvcc_required, B):
    """The small preset's decode buckets as select_kernels binds them (sm90_config: a ws config, run as the portable
    program at 8 heads): the SWA window alone (top-k 128) and window + 64 compressed entries (192)."""
    from deepinfer.codegen.tilelang_backend import build

    for topk, n_win in ((128, 0), (192, 128)):
        cfg = sad.sm90_config(B, topk)
        progs = (sad.split_programs(B, H, D, 300, topk, target="sm90", cfg=cfg, n_win=n_win, S_cmp=64)
                 if cfg.num_split > 1 else [sad.program(B, H, D, 300, topk, target="sm90", cfg=cfg, n_win=n_win,
                                                        S_cmp=64)])  # fmt: skip
        for i, prog in enumerate(progs):
            art = build(f"sad_h8_b{B}_k{topk}_{i}", prog, "sm90")
            assert art.cubin_path.exists() and art.opcodes["LDL"] + art.opcodes["STL"] == 0, (B, topk, i)



@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_h200_eight_heads_match_the_reference(B):
    """On the H200: sm90_config's choice at 8 heads (split + combine at B1, one pass at B64), one pool and the SWA +
    compressed pair, against the op's reference within bf16's error."""
    import tilelang

    def build(prog):
        return tilelang.compile(prog, target={"kind": "cuda", "arch": "sm_90a"}, execution_backend="tvm_ffi")

    S = 300
    for topk, n_win in ((128, 0), (192, 128)):
        q, kv, idx, sink = (t.cuda() for t in _operands(B, S, topk, seed=B + topk))
        q, kv = q.bfloat16(), kv.bfloat16()
        cfg = sad.sm90_config(B, topk)
        pools = (kv, kv) if n_win else kv
        ids = (idx[:, :n_win].contiguous(), idx[:, n_win:].contiguous()) if n_win else idx
        out = torch.full((B, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        if cfg.num_split > 1:
            progs = sad.split_programs(B, H, D, S, topk, target="sm90", cfg=cfg, n_win=n_win, S_cmp=S)
            sad.run_split(tuple(build(p) for p in progs), q, pools, ids, sink, out, cfg.num_split)
        else:
            kernel = build(sad.program(B, H, D, S, topk, target="sm90", cfg=cfg, n_win=n_win, S_cmp=S))
            kernel(q, *(pools if n_win else (pools,)), *(ids if n_win else (ids,)), sink, out)
        want = sad.reference(q.float(), kv.float(), idx, sink)
        err = float((out.float() - want).abs().max() / want.abs().max())
        assert err < 2e-2, (B, topk, cfg.tag, err)
