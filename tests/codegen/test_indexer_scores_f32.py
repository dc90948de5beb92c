"""indexer_topk.triton_scores: the f32 `index_scores` of a decode step in one Triton launch. Oracles: a float64
loop over heads (independent of the op's einsum), and the op's torch reference; the causal mask exactly (-inf
where j >= (p+1)//ratio, finite elsewhere). CPU: the Triton interpreter; sm90: the PTX builds with TF32 wgmmas;
the gpu test runs the compiled kernel (3xTF32 dots) at V4.1's decode dims."""

import pytest
import torch

from deepinfer.codegen.kernels import indexer_topk as it
from deepinfer.ir.ops.attention import indexer_scores
from tests.codegen._triton_aot import compile_sm90, spill_free


def _inputs(t: int, c: int, start: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 32, 128, generator=g)
    w = torch.randn(t, 32, generator=g) * 32**-0.5
    keys = torch.randn(c, 128, generator=g)
    pos = torch.arange(start, start + t)
    return q.to(device), w.to(device), keys.to(device), pos.to(device)


def _oracle_f64(q, w, keys, pos, ratio: int, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.float64)
    for h in range(q.shape[1]):
        out += (q[:, h].double() @ keys.double().T).clamp(min=0) * scale * w[:, h].double().unsqueeze(-1)
    vis = torch.arange(keys.shape[0]) < ((pos + 1) // ratio).unsqueeze(-1)
    return out.masked_fill(~vis, float("-inf"))


def _check(s, ref, tol):
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(s)) and (s[~fin] == float("-inf")).all()
    err = ((s.double() - ref.double())[fin].abs().max() / ref.double()[fin].abs().max()).item()
    assert err < tol, err


@pytest.mark.parametrize("t,c,start,ratio,block_c", [(20, 150, 280, 2, 64), (5, 64, 40, 1, 64), (33, 130, 0, 2, 64),
                                                     (21, 300, 0, 1, 128)])  # the prefill tile (select_kernels)
def test_interpreter_matches_f64_and_the_op(interpret, t, c, start, ratio, block_c):
    q, w, keys, pos = _inputs(t, c, start, seed=t + c)
    # partial query blocks (t % 4) and key blocks (c % block_c)
    cfg = it.F32ScoresConfig(block_c=block_c, block_t=4, warps=8 if block_c == 128 else 4)
    s = it.triton_scores(q, w, keys, pos, ratio=ratio, scale=0.088, cfg=cfg)
    _check(s, _oracle_f64(q, w, keys, pos, ratio, 0.088), 1e-6)
    _check(s, indexer_scores(q, w, keys, pos, ratio=ratio, scale=0.088)[0], 1e-6)


def test_config_puts_every_head_of_a_query_in_one_dot():
    for h in (32, 16, 64):
        cfg = it.f32_scores_config(64, 4160, h)
        assert cfg.block_t * h == 128 or (h > 128 and cfg.block_t == 1)


@pytest.mark.parametrize("bc,warps", [(64, 4), (128, 8)])  # the decode and prefill tiles (select_kernels)
def test_compiles_for_hopper_with_tf32_wgmma(bc, warps):
    sig = {"q_ptr": "*fp32", "w_ptr": "*fp32", "k_ptr": "*fp32", "pos_ptr": "*i64", "s_ptr": "*fp32", "T": "i32",
           "C": "i32", "scale": "fp32", "ratio": "i32"}  # fmt: skip
    ptx, report = compile_sm90("deepinfer.codegen.kernels.indexer_topk", "_f32_scores_kernel", sig,
                               dict(H=32, DI=128, BC=bc, BT=4, PREC="tf32x3", OWN_KEYS=False, DK=128), num_warps=warps)
    assert spill_free(report), report
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and ".f32.tf32.tf32" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("c,ratio", [(2080, 2), (4160, 1)])
def test_cuda_kernel_at_decode_dims(c, ratio):
    q, w, keys, pos = _inputs(64, c, 4096, seed=c, device="cuda")
    s = it.triton_scores(q, w, keys, pos, ratio=ratio, scale=128**-0.5)
    _check(s.cpu(), _oracle_f64(q.cpu(), w.cpu(), keys.cpu(), pos.cpu(), ratio, 128**-0.5), 1e-5)
    s1 = it.triton_scores(q, w, keys, pos, ratio=ratio, scale=128**-0.5, cfg=it.F32ScoresConfig(precision="tf32"))
    _check(s1.cpu(), s.cpu(), 5e-3)  # one TF32 product: ~1e-3 of the row maximum, for the bench's comparison


_SPREAD = [0, 3, 63, 130, 399, 1000, 150]  # 7 queries: nothing visible .. the whole (clamped) cache


@pytest.mark.parametrize("t,c,positions,ratio,bt", [(1, 300, [97], 1, 1), (1, 300, [1], 2, 1),
                                                    (7, 200, _SPREAD, 2, 1), (7, 200, _SPREAD, 2, 4)])  # fmt: skip
@pytest.mark.parametrize("per_row", [False, True])
def test_balanced_form_is_the_first_form_bit_for_bit(interpret, monkeypatch, t, c, positions, ratio, bt, per_row):
    """The balanced form (3 CTAs walking every live key tile -- per row: 3 CTAs a query block or at least one --,
    then the -inf fill in 64-column items) against the
    first form (a CTA per key tile) at the same tile and k_split, and the float64 oracle; T 1 is the one-sequence
    decode step (one query block), 7 queries at very different lengths share the keys, one or 4 a CTA (a
    partial last block; the 4-query tile is correct but spills on sm_90a in the balanced loop)."""
    monkeypatch.setattr(it, "_sm_count", lambda device: 1)
    q, w, keys, _ = _inputs(t, c, 0, seed=t + c + ratio)
    pos = torch.tensor(positions)
    first = it.triton_scores(q, w, keys, pos, ratio=ratio, scale=0.088, cfg=it.F32ScoresConfig(block_t=bt, k_split=32))
    cfg = it.F32ScoresConfig(block_t=bt, k_split=32, ctas_per_sm=3, fill_block=64, per_row=per_row)
    s = it.triton_scores(q, w, keys, pos, ratio=ratio, scale=0.088, cfg=cfg)
    assert torch.equal(s, first)
    _check(s, _oracle_f64(q, w, keys, pos, ratio, 0.088), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("pos,c,ratio", [(4095, 32768, 2), (70000, 65536, 1)])  # a 4k context / the whole cache
def test_cuda_balanced_one_query_step(pos, c, ratio):
    """The one-sequence decode step (T 1) in decode_form against the first form at the same tile and k_split (the
    same bits) and the float64 oracle."""
    q, w, keys, _ = _inputs(1, c, 0, seed=pos, device="cuda")
    p = torch.tensor([pos], device="cuda")
    cfg = it.decode_form(it.F32ScoresConfig(), 8)
    s = it.triton_scores(q, w, keys, p, ratio=ratio, scale=128**-0.5, cfg=cfg)
    first = it.triton_scores(q, w, keys, p, ratio=ratio, scale=128**-0.5, cfg=it.F32ScoresConfig(block_t=1, k_split=32))
    assert torch.equal(s, first)
    _check(s.cpu(), _oracle_f64(q.cpu(), w.cpu(), keys.cpu(), p.cpu(), ratio, 128**-0.5), 1e-5)


def test_long_caches_take_the_per_row_form_when_asked(monkeypatch):
    """decode_config: with DECODE_LONG_C 0 every cache takes decode_form (the first form by default); with
    DECODE_LONG_C set (16384 by default), a cache of at least that many columns takes the per-row form with
    DECODE_LONG_CTAS CTAs an SM (one-sequence and batched steps alike), a shorter one the first form;
    DECODE_CTAS_PER_SM, when set, wins."""
    monkeypatch.setattr(it, "DECODE_CTAS_PER_SM", 0)
    assert it.DECODE_LONG_C == 16384  # the default (H200 call 3: see the constant's comment)
    monkeypatch.setattr(it, "DECODE_LONG_C", 0)
    assert it.f32_batched_scores_config(64, 65536).ctas_per_sm == 0
    monkeypatch.setattr(it, "DECODE_LONG_C", 16384)
    for cfg in (it.f32_batched_scores_config(64, 65536), it.f32_scores_config(1, 16384)):
        assert cfg.ctas_per_sm == it.DECODE_LONG_CTAS and cfg.per_row and cfg.block_t == 1
    assert it.f32_batched_scores_config(64, 4096).ctas_per_sm == 0
    assert it.f32_scores_config(4, 65536).ctas_per_sm == 0  # prefill rows: the first form
    monkeypatch.setattr(it, "DECODE_CTAS_PER_SM", 8)
    assert it.f32_batched_scores_config(64, 65536).ctas_per_sm == 8
