"""swab_program(slot_map=True, slots=S): the masked layout's slot -> expert map (Meta = Counts ++ SlotExpert ++
[experts with tokens]) that replaces every CTA's scan of the E counts, the grid trimmed to S expert slots, and the
persistent grid (cfg.persistent: G CTAs walking the active (slot, N tile) items).

CPU: the map against a plain Python scan (the order the kernel's scan assigns), the programs on TileLang's `c` target
(E = 12 with idle experts) against the float64 / W4A8 references and against the scan program bit for bit, the slot
order made observable by a grid with fewer slots than active experts, the persistent grid against one CTA per item,
and the sm90 sources. H200: map == scan and persistent == per-item grid, every output byte."""

import dataclasses

import pytest
import torch

from deepinfer.codegen.kernels import _common
from deepinfer.codegen.kernels import moe_grouped_gemm as mg

E, MR, BT = 12, 8, 4
# idle experts at the start, in the middle and at the end; one expert past one token tile (block_t 4)
COUNTS = torch.tensor([0, 3, 1, 0, 0, 8, 2, 0, 5, 1, 0, 0], dtype=torch.int32)


def _scan_order(counts: torch.Tensor) -> list[int]:
    """The kernel's scan: slot s -> the s-th expert with a non-zero count; slots past them -> none."""
    return [e for e, c in enumerate(counts.tolist()) if c > 0]


@pytest.mark.parametrize("seed", range(6))
def test_slot_expert_meta_is_the_scan_order(seed):
    g = torch.Generator().manual_seed(seed)
    n = [1, 5, 12, 48, 384, 384][seed]
    counts = torch.randint(0, 3, (n,), generator=g) * torch.randint(0, 2, (n,), generator=g)
    if seed == 4:
        counts.zero_()
    if seed == 5:
        counts.fill_(1)
    meta = mg.slot_expert_meta(counts)
    assert meta.dtype == torch.int32 and meta.shape == (2 * n + 1,)
    assert torch.equal(meta[:n], counts.int())
    active = _scan_order(counts)
    assert meta[n : n + len(active)].tolist() == active and meta[2 * n] == len(active)
    assert sorted(meta[n : 2 * n].tolist()) == list(range(n))  # a permutation: idle slots name idle experts
    assert all(counts[i] == 0 for i in meta[n + len(active) : 2 * n].tolist())


_ROWS_SCRIPT = """
import os
import torch
from deepinfer.codegen.kernels import moe_grouped_gemm as mg
from deepinfer.runtime import kernel_adapters as ka

cases = [(6, 384, 16), (96, 384, 16), (384, 384, 64), (1536, 384, 256), (7, 12, 8), (40, 12, 8), (1, 1, 16)]
for seed, (p, e, mr) in enumerate(cases):
    g = torch.Generator().manual_seed(seed)
    ek = torch.randint(0, e + 1, (p,), generator=g)  # e: merged duplicates (the spare expert)
    want = mg.masked_rows_reference(ek, e, mr)
    for spread in (False, True, None):  # (None: the default, spread)
        got = mg.masked_rows(ek, e, mr, spread=spread)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (p, e, spread)
# the adapter's layout, duplicates included: the interpreter's launch against the torch path
g = torch.Generator().manual_seed(9)
idx = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(5)])
idx[0, 1] = idx[0, 0]
w = torch.rand(5, 3, generator=g)
tri = ka.masked_layout(idx, w, 12, 8, with_meta=True)
os.environ["TRITON_INTERPRET"] = "0"
ref = ka.masked_layout(idx, w, 12, 8, with_meta=True)
assert all(torch.equal(a, b) for a, b in zip(tri, ref))
print("OK")
"""


def test_masked_rows_triton_is_the_torch_formulation_bit_for_bit():
    """moe_grouped_gemm.masked_rows (one Triton launch: ranks, counts, slot map) under the CPU interpreter against
    masked_rows_reference (the one-hot running count + slot_expert_meta), P up to 1536 pairs, merged duplicates;
    and the adapter's masked_layout through it against its torch path."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_ADAPTER_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _ROWS_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("spread", [False, True, None])  # None: the default (spread)
def test_masked_rows_on_the_h200(spread):
    for seed, (p, e, mr) in enumerate([(6, 384, 16), (96, 384, 16), (384, 384, 64), (1536, 384, 256)]):
        g = torch.Generator().manual_seed(seed)
        ek = torch.randint(0, e + 1, (p,), generator=g).cuda()
        got, want = mg.masked_rows(ek, e, mr, spread=spread), mg.masked_rows_reference(ek, e, mr)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (p, e)


@pytest.fixture(scope="module")
def cpu(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    return compile_cpu


def _fp8_operands(N, K, seed):
    torch.manual_seed(seed)
    a, sa = _common.quant_fp8_groups(torch.randn(E * MR, K), 32)
    quant = [_common.quant_fp8_blocks(torch.randn(N, K) * 0.05, 32) for _ in range(E)]
    return a, sa, torch.stack([q for q, _ in quant]), torch.stack([s for _, s in quant])


def _run_fp8(cpu, a, sa, b, sb, meta, *, slot_map, slots=0, **kw):
    N, K = b.shape[1], b.shape[2]
    cfg = mg.SwabConfig(64, BT, 64, 2, 1)
    prog = mg.swab_program(E * MR, N, K, E, fmt="fp8", cfg=cfg, max_rows=MR, slot_map=slot_map, slots=slots,
                           target="cpu", **kw)  # fmt: skip
    glu = kw.get("swiglu_limit") is not None
    outs = (torch.full((E * MR, N // 2), float("nan")), torch.full((N // 64, E * MR), float("nan"))) if glu else (
        torch.full((E * MR, N), float("nan")),)  # fmt: skip
    cpu(prog)(a.float(), sa.T.contiguous(), b.float(), sb, meta, *outs)
    return outs


def test_fp8_map_equals_the_scan_and_the_f64_reference(cpu):
    a, sa, b, sb = _fp8_operands(128, 128, seed=1)
    (c_map,) = _run_fp8(cpu, a, sa, b, sb, mg.slot_expert_meta(COUNTS), slot_map=True)
    (c_scan,) = _run_fp8(cpu, a, sa, b, sb, COUNTS, slot_map=False)
    real = mg.row_experts(COUNTS, MR, masked=True) >= 0
    assert torch.equal(c_map[real], c_scan[real])  # same expert per slot, same arithmetic: bit for bit
    want = mg.reference_f64(a, sa, b, sb, mg.masked_tile_expert(COUNTS, MR, MR), MR, 32, 32)
    assert (c_map[real].double() - want[real]).abs().max() <= 1e-5 * want.abs().max()
    # an idle expert's rows and token tiles past a count are never written (a tile's rows past the count hold junk)
    tiles = mg.row_experts(((COUNTS + BT - 1) // BT) * BT, MR, masked=True) >= 0
    assert c_map[~tiles].isnan().all() and not c_map[tiles].isnan().any()


def test_fewer_slots_than_active_experts_reach_the_first_ones_in_scan_order(cpu):
    """slots=3 < 7 active experts: only the first 3 in expert order (the scan's slots 0-2) are computed, by the map
    and by the scan alike; every other row stays unwritten. A map in another order would compute other experts."""
    a, sa, b, sb = _fp8_operands(64, 64, seed=2)
    first = _scan_order(COUNTS)[:3]
    re_ = mg.row_experts(COUNTS, MR, masked=True)
    reached = torch.isin(re_, torch.tensor(first))
    for slot_map, meta in ((True, mg.slot_expert_meta(COUNTS)), (False, COUNTS)):
        (c,) = _run_fp8(cpu, a, sa, b, sb, meta, slot_map=slot_map, slots=3)
        written = ~c.isnan().all(1)
        assert not c[reached].isnan().any() and torch.equal(written & (re_ >= 0), reached), slot_map
    # the map is read, not recomputed: reversing the active part of SlotExpert reaches the last three instead
    meta = mg.slot_expert_meta(COUNTS)
    n_act = len(_scan_order(COUNTS))
    meta[E : E + n_act] = meta[E : E + n_act].flip(0)
    (c,) = _run_fp8(cpu, a, sa, b, sb, meta, slot_map=True, slots=3)
    last = torch.isin(re_, torch.tensor(_scan_order(COUNTS)[-3:]))
    assert not c[last].isnan().any() and torch.equal(~c.isnan().all(1) & (re_ >= 0), last)


def test_fp8_glu_split_map_equals_the_scan(cpu):
    """The fused SwiGLU on the plain w1|w3 stack (the runtime's decode kernel), map vs scan: every code and scale."""
    a, sa, b, sb = _fp8_operands(256, 64, seed=3)
    sb = sb * 64.0  # powers of two still: large enough to exercise the clamp
    kw = {"swiglu_limit": 10.0, "glu_split": True}
    hq_m, hs_m = _run_fp8(cpu, a, sa, b, sb, mg.slot_expert_meta(COUNTS), slot_map=True, slots=9, **kw)
    hq_s, hs_s = _run_fp8(cpu, a, sa, b, sb, COUNTS, slot_map=False, **kw)
    real = mg.row_experts(COUNTS, MR, masked=True) >= 0
    assert torch.equal(hq_m[real], hq_s[real]) and torch.equal(hs_m[:, real], hs_s[:, real])
    h = mg.reference(a, sa, b, sb, mg.masked_tile_expert(COUNTS, MR, MR), MR, 32, 32)
    assert h.abs().max() > 10.0
    rq, rs = mg.swiglu_quant_reference(h, 10.0)
    assert torch.equal(hs_m.T[real], rs[real])
    assert (hq_m[real].to(torch.float8_e4m3fn).float() != rq[real].float()).float().mean() < 1e-3


def test_w4a8_swiglu_map_matches_the_reference(cpu):
    """FP4 weights (W4A8) with the fused SwiGLU, interleaved stack, slot map + trimmed grid: every code and scale."""
    N, K = 128, 128
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(116, 126, (E, N, K // 32), dtype=torch.uint8, generator=g)
    torch.manual_seed(4)
    a, sa = _common.quant_fp8_groups(torch.randn(E * MR, K), 32)
    b, sb = mg.w4a8_weights(mg.gate_up_tiles(packed, 32), mg.gate_up_tiles(scale, 32))
    cfg = mg.SwabConfig(64, 4, 64, 2, 1)
    prog = mg.swab_program(E * MR, N, K, E, fmt="fp4", cfg=cfg, max_rows=MR, swiglu_limit=10.0, slot_map=True,
                           slots=7, target="cpu")  # fmt: skip
    hq, hs = torch.zeros(E * MR, N // 2), torch.zeros(N // 64, E * MR)
    cpu(prog)(a.float(), sa.T.contiguous(), b, sb, mg.slot_expert_meta(COUNTS), hq, hs)
    re_ = mg.row_experts(COUNTS, MR, masked=True)
    rq, rs = mg.swiglu_quant_reference(mg.reference_w4a8(a, sa, packed, scale, re_), 10.0)
    real = re_ >= 0
    assert torch.equal(hs.T[real], rs[real])
    assert torch.equal(hq[real].to(torch.float8_e4m3fn).float(), rq[real].float())


def test_the_map_needs_the_masked_layout_and_slots_fit(tilelang_required):
    with pytest.raises(AssertionError, match="masked"):
        mg.swab_program(64, 128, 128, 4, cfg=mg.SwabConfig(64, 16, 64, 2, 1), slot_map=True)
    with pytest.raises(AssertionError, match="slots"):
        mg.swab_program(4 * 16, 128, 128, 4, cfg=mg.SwabConfig(64, 16, 64, 2, 1), max_rows=16, slots=5)


def test_sm90_source_reads_the_map_once_and_the_grid_has_the_slots(tilelang_required):
    """The lowered sm90 kernel: no loop over the 384 counts, SlotExpert read at Meta[slot + E], the scales staged
    only for a slot with tokens; the scan program (slot_map off) keeps its loop. Grid: 36 column CTAs x slots."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = mg.SwabConfig(64, 16, 128, 4, 4)
    args = (384 * 16, 2 * 2304, 5120, 384)
    kw = {"fmt": "fp8", "cfg": cfg, "max_rows": 16, "swiglu_limit": 10.0, "glu_split": True}
    src_map = tb.lower(mg.swab_program(*args, slot_map=True, slots=96, **kw), "sm90")
    src_scan = tb.lower(mg.swab_program(*args, **kw), "sm90")
    assert "i < 384" in src_scan and "i < 384" not in src_map
    assert "Meta[(((int)blockIdx.y) + 384)]" in src_map
    assert "if (0 < n_tt)" in src_map
    script = str(mg.swab_program(*args, slot_map=True, slots=96, **kw).script())
    assert 'T.thread_binding(36, thread="blockIdx.x")' in script
    assert 'T.thread_binding(96, thread="blockIdx.y")' in script


@pytest.mark.parametrize("persistent", [0, 264])
def test_slots_reach_only_the_grid_so_the_compile_lowers_them_once(tilelang_required, persistent):
    """GRID_ONLY_KWARGS' claim: the sm90 CUDA source is the same for every slots value (0 = all E, the decode
    buckets' 6 .. 96), so plan_kernels lowers swab_program at slots 0 for every spec that differs only there."""
    from deepinfer.codegen import plan_kernels as pk
    from deepinfer.codegen import tilelang_backend as tb

    cfg = mg.SwabConfig(64, 16, 128, 4, 4, persistent=persistent)
    args = (384 * 16, 2 * 2304, 5120, 384)
    kw = {"fmt": "fp8", "max_rows": 16, "swiglu_limit": 10.0, "glu_split": True, "slot_map": True}
    sources = {s: tb.lower(mg.swab_program(*args, cfg=cfg, slots=s, **kw), "sm90") for s in (0, 6, 96)}
    assert sources[0] == sources[6] == sources[96]
    spec = pk.KernelSpec("moe_grouped_gemm", "swab_program", args, {**kw, "slots": 6}, dataclasses.asdict(cfg), "t")
    assert pk._device_spec(spec).kwargs == {**kw, "slots": 0} and spec.kwargs["slots"] == 6
    assert pk._device_spec(pk._device_spec(spec)) == pk._device_spec(spec)


def _random_e4m3(shape, dev) -> torch.Tensor:
    """Random e4m3 codes without NaNs, one byte per element (bit 6 cleared: exponent <= 7, |w| <= 1.875)."""
    return (torch.randint(0, 256, shape, dtype=torch.uint8, device=dev) & 0xBF).view(torch.float8_e4m3fn)


def _filled_rows(outs, dest) -> list[torch.Tensor]:
    """The real rows of the kernels' outputs as bytes: Hq / C rows dest, Hs (MN-major) columns dest."""
    picked = [outs[0][dest]] + [o[:, dest] for o in outs[1:]]
    return [p.contiguous().view(torch.uint8) for p in picked]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,tokens", [("fp8", 64), ("fp8", 16), ("fp4", 64)])
def test_map_equals_the_scan_on_the_h200(fmt, tokens):
    """V4.1 decode (384 experts, top-6): the runtime's two kernels (glu_split SwiGLU w1|w3 on the plain stack, then
    w2), the slot map (trimmed to T*6 slots at T = 16) against the scan program: every output byte equal."""
    from deepinfer.runtime import kernel_adapters as ka

    e, d, inter, topk, dev = 384, 5120, 2304, 6, "cuda"
    g = torch.Generator().manual_seed(tokens)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).to(dev)
    cfg = mg.swab_config(4, fmt)
    max_rows = -(-tokens // cfg.block_t) * cfg.block_t
    dest, counts, _ = ka.masked_layout(idx, torch.ones(tokens, topk, device=dev), e, max_rows)
    rows, slots = e * max_rows, tokens * topk if tokens * topk < e else 0
    for n, k, glu in ((2 * inter, d, True), (d, inter, False)):
        a, sa = _common.quant_fp8_groups(torch.randn(rows, k, device=dev), 32)
        if fmt == "fp8":
            b = _random_e4m3((e, n, k), dev)
            sb = torch.exp2(torch.randint(-8, -4, (e, n // 32, k // 32), device=dev).float())
        else:
            packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev)
            b, sb = mg.w4a8_weights(packed, torch.randint(116, 126, (e, n, k // 32), dtype=torch.uint8, device=dev))
        c = dataclasses.replace(cfg, min_blocks=max(1, cfg.min_blocks // (1 + glu)))  # the adapter's (fp8: wide)
        got = []
        for kw in ({}, {"slot_map": True, "slots": slots}):
            key = ka._key("moe_grouped_gemm", "swab_program", (rows, n, k, e), c, act_group=32, fmt=fmt,
                          weight_block=32, max_rows=max_rows, swiglu_limit=10.0 if glu else None, glu_split=glu,
                          **kw)  # fmt: skip
            if glu:
                outs = (torch.zeros(rows, n // 2, dtype=torch.float8_e4m3fn, device=dev),
                        torch.zeros(n // 64, rows, device=dev))  # fmt: skip
            else:
                outs = (torch.zeros(rows, n, dtype=torch.bfloat16, device=dev),)
            meta = mg.slot_expert_meta(counts) if kw else counts
            ka.build_kernel(key)(a, sa.T.contiguous(), b, sb, meta, *outs)
            torch.cuda.synchronize()
            got.append(_filled_rows(outs, dest))
        assert all(torch.equal(x, y) for x, y in zip(*got)), (fmt, tokens, glu)


# ---------------------------------------------------------------------------------------------- persistent grid


@pytest.mark.parametrize("glu", [False, True])
def test_persistent_grid_equals_one_cta_per_item(cpu, glu):
    """cfg.persistent = 4 CTAs walking the 7 active experts' (slot, N tile) items (2 or 4 N tiles each, so the CTAs
    take different item counts): every output value of the one-CTA-per-item program."""
    a, sa, b, sb = _fp8_operands(256, 64, seed=6)
    kw = {"swiglu_limit": 10.0, "glu_split": True} if glu else {}
    meta = mg.slot_expert_meta(COUNTS)
    want = _run_fp8(cpu, a, sa, b, sb, meta, slot_map=True, **kw)
    N, K = b.shape[1], b.shape[2]
    prog = mg.swab_program(E * MR, N, K, E, cfg=mg.SwabConfig(64, BT, 64, 2, 1, persistent=4), max_rows=MR,
                           slot_map=True, target="cpu", **kw)  # fmt: skip
    got = tuple(torch.full_like(w, float("nan")) for w in want)
    cpu(prog)(a.float(), sa.T.contiguous(), b.float(), sb, meta, *got)
    real = mg.row_experts(COUNTS, MR, masked=True) >= 0
    assert torch.equal(got[0][real], want[0][real])
    if glu:
        assert torch.equal(got[1][:, real], want[1][:, real])


def test_persistent_sm90_source_walks_the_active_items(tilelang_required):
    """One 1-D grid of G CTAs; the item loop runs to Meta[2E] (experts with tokens) x N tiles, strided by G."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = mg.SwabConfig(64, 16, 128, 4, 4, persistent=528)
    func = mg.swab_program(384 * 64, 5120, 2304, 384, cfg=cfg, max_rows=64, slot_map=True)
    assert 'T.thread_binding(528, thread="blockIdx.x")' in str(func.script()) and "blockIdx.y" not in str(func.script())
    src = tb.lower(func, "sm90")
    assert "Meta[768] * 80" in src and "/ 528)" in src and "blockIdx.y" not in src
    with pytest.raises(AssertionError, match="persistent"):
        mg.swab_program(384 * 64, 5120, 2304, 384, cfg=cfg, max_rows=64)


@pytest.mark.gpu
@pytest.mark.parametrize("glu", [True, False])
def test_persistent_equals_one_cta_per_item_on_the_h200(glu):
    """V4.1 decode at 64 tokens (384 experts, top-6), wide tiles: the persistent grid (132 x CTAs per SM) and the grid
    of one CTA per (slot, N tile), every output byte equal."""
    from deepinfer.runtime import kernel_adapters as ka

    e, d, inter, topk, tokens, dev = 384, 5120, 2304, 6, 64, "cuda"
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).to(dev)
    dest, counts, _ = ka.masked_layout(idx, torch.ones(tokens, topk, device=dev), e, 64)
    n, k = (2 * inter, d) if glu else (d, inter)
    rows = e * 64
    a, sa = _common.quant_fp8_groups(torch.randn(rows, k, device=dev), 32)
    b = _random_e4m3((e, n, k), dev)
    sb = torch.exp2(torch.randint(-8, -4, (e, n // 32, k // 32), device=dev).float())
    got = []
    for persistent in (0, 132 * (2 if glu else 4)):
        cfg = mg.SwabConfig(64, 16, 128, 4, 2 if glu else 4, wide_tma=True, persistent=persistent)
        key = ka._key("moe_grouped_gemm", "swab_program", (rows, n, k, e), cfg, act_group=32, fmt="fp8",
                      weight_block=32, max_rows=64, swiglu_limit=10.0 if glu else None, glu_split=glu,
                      slot_map=True, slots=0)  # fmt: skip
        if glu:
            outs = (torch.zeros(rows, n // 2, dtype=torch.float8_e4m3fn, device=dev),
                    torch.zeros(n // 64, rows, device=dev))  # fmt: skip
        else:
            outs = (torch.zeros(rows, n, dtype=torch.bfloat16, device=dev),)
        ka.build_kernel(key)(a, sa.T.contiguous(), b, sb, mg.slot_expert_meta(counts), *outs)
        torch.cuda.synchronize()
        got.append(_filled_rows(outs, dest))
    assert all(torch.equal(x, y) for x, y in zip(*got))


@pytest.mark.parametrize("block_p,spread", [(512, False), (2048, False), (512, True), (2048, True)])  # T 64, 256
def test_masked_rows_builds_for_sm90(block_p, spread):
    from tests.codegen._triton_aot import compile_sm90, spill_free

    sig = {"e_ptr": "*i64", "dest_ptr": "*i64", "meta_ptr": "*i32", "P": "i32", "E": "i32", "max_rows": "i32"}
    ptx, report = compile_sm90("deepinfer.codegen.kernels.moe_grouped_gemm", "_masked_rows_kernel", sig,
                               {"BLOCK_P": block_p, "BLOCK_E": 512, "CHUNK": 16,
                                "N_CHUNKS": 1 if spread else block_p // 16},
                               num_warps=4 if spread else 8)  # fmt: skip
    assert "st.global" in ptx
    assert spill_free(report), report  # T=256 (2048): a runtime loop over the chunks, not a 128-chunk unroll
