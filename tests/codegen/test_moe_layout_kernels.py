"""The prefill MoE's contiguous layout and x quant + gather as Triton kernels (moe_routing.triton_contiguous_layout,
triton_gather_quant) against an oracle written here from the layout's definition (a Python walk over the pairs in
order: expert e's pairs fill rows from its first tile on, every expert's rows padded to whole tiles) and the
runtime's quant_act for the codes; and against the torch references the adapter runs on CPU, bit for bit. CPU: the
Triton interpreter at small shapes; the gpu tests run the compiled kernels at an EP8 rank's prefill shape."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import moe_routing as mr
from deepinfer.runtime import kernel_adapters as ka
from deepinfer.runtime.kernel_adapters import quant_act
from tests.codegen._triton_aot import compile_sm90, spill_free

FLOOR = 2.0**-22  # the scale of an all-zero group (act_quant's padding rows)


def routing(t: int, k: int, e: int, kind: str, seed: int = 0) -> torch.Tensor:
    """idx [T, K] int32: "spread" (K distinct experts a token, as top-k gives), "few" (experts 3..7 only: the rest
    get no pair), "one" (every pair to expert e-1; K = 1)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "spread":
        return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    if kind == "few":
        return torch.stack([3 + torch.randperm(5, generator=gen)[:k] for _ in range(t)]).int()
    assert kind == "one" and k == 1
    return torch.full((t, 1), e - 1, dtype=torch.int32)


def oracle_layout(idx: torch.Tensor, e: int, block_m: int):
    """(slot list, tile_expert list of the exact tiles, counts list) by walking the pairs in flat order."""
    flat = idx.reshape(-1).tolist()
    counts = [flat.count(x) for x in range(e)]
    first, tiles = [], []
    for x in range(e):
        first.append(len(tiles) * block_m)
        tiles += [x] * (-(-counts[x] // block_m))
    seen = [0] * e
    slot = []
    for x in flat:
        slot.append(first[x] + seen[x])
        seen[x] += 1
    return slot, tiles, counts


CASES = [  # (T, K, E, block_m, routing)
    (40, 6, 48, 16, "spread"),  # T*K = 240: not a multiple of the tile
    (21, 6, 384, 16, "spread"),  # V4.1's E: most experts get one pair or none
    (30, 3, 48, 8, "few"),  # 43 experts without pairs
    (50, 1, 48, 16, "one"),  # one expert takes everything, K = 1
    (33, 1, 10, 128, "spread"),  # K = 1, one tile per expert
]


@pytest.mark.parametrize("t,k,e,bm,kind,segmented", [c + (False,) for c in CASES] + [c + (True,) for c in CASES
                                                                                      if c[2] < 200])  # fmt: skip
def test_layout_kernels_match_the_oracle_and_the_reference(interpret, monkeypatch, t, k, e, bm, kind, segmented):
    """segmented: 16-id steps and ~200 programs, so the ids split into several segments (at these sizes the
    defaults give one; at 8192 tokens x 6 they give 22 at E=48)."""
    if segmented:
        monkeypatch.setattr(mr, "LAYOUT_BLOCK", 16)
        monkeypatch.setattr(mr, "LAYOUT_PROGRAMS", 200)
    idx = routing(t, k, e, kind, seed=t)
    assert (mr.layout_segments(t * k, e) > 1) == segmented
    n_tiles = ka._tile_bucket(mr.layout_tile_bound(t * k, e, bm))
    slot, tile_expert, counts, total = mr.triton_contiguous_layout(idx, e, bm, n_tiles)
    want_slot, want_tiles, want_counts = oracle_layout(idx, e, bm)
    assert slot.tolist() == want_slot and counts.tolist() == want_counts and total.tolist() == [len(want_tiles)]
    assert tile_expert.tolist() == want_tiles + [-1] * (n_tiles - len(want_tiles))
    ref = mr.contiguous_layout_reference(idx, e, bm, n_tiles)
    for got, want in zip((slot, tile_expert, counts, total), ref):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _x(t: int, d: int, seed: int) -> torch.Tensor:
    """Rows over 40 binades, a zero row and a zero group, 1.75 * 2^p maxima (the scale's exponent boundary)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen) * torch.logspace(-20, 20, d, base=2.0)
    x[0] = 0.0
    x[1, :128] = 0.0
    x[2, 0], x[2, 160] = 1.75 * 2.0**3, -1.75 * 2.0**-7
    return x.bfloat16()


@pytest.mark.parametrize("t,k,e,bm,kind,group", [(c[:5] + (g,)) for c, g in zip(CASES, (32, 128, 128, 32, 128))])
def test_gather_quant_writes_each_tokens_codes_to_its_rows(interpret, t, k, e, bm, kind, group):
    d = 256
    idx, x = routing(t, k, e, kind, seed=t), _x(t, d, seed=t)
    n_tiles = ka._tile_bucket(mr.layout_tile_bound(t * k, e, bm))
    slot, _, counts, total = mr.triton_contiguous_layout(idx, e, bm, n_tiles)
    a, sa, (xq, xs) = mr.triton_gather_quant(x, slot, counts, group, n_tiles * bm, bm, with_x=True)
    a = a.to(torch.float8_e4m3fn)
    q, s = quant_act(x, group)  # the oracle's codes: the runtime's torch quantisation
    for pair, row in enumerate(slot.tolist()):
        tok = pair // k
        assert torch.equal(a[row].view(torch.uint8), q[tok].view(torch.uint8)) and torch.equal(sa[:, row], s[tok])
    real_rows = int(total) * bm
    pad = torch.ones(real_rows, dtype=torch.bool)
    pad[slot.long()] = False
    assert (a[:real_rows][pad].float() == 0).all() and (sa[:, :real_rows][:, pad] == FLOOR).all()
    assert torch.equal(xq.to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8)) and torch.equal(xs, s.T)
    ra, rsa, _ = mr.gather_quant_reference(x, slot, counts, group, n_tiles * bm, bm)
    assert torch.equal(a[:real_rows].view(torch.uint8), ra[:real_rows].view(torch.uint8))
    assert torch.equal(sa[:, :real_rows], rsa[:, :real_rows])


@pytest.mark.parametrize("read_back", [True, False])
def test_adapter_layout_on_the_interpreter_equals_its_torch_path(interpret, monkeypatch, read_back):
    """Both read-back modes; int64 ids (the slots keep the ids' dtype) in one of them."""
    idx = routing(45, 6, 48, "spread", seed=3)
    idx = idx if read_back else idx.long()
    want = ka._moe_layout_rows(idx, 48, 16, read_back=read_back)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    got = ka._moe_layout_rows(idx, 48, 16, read_back=read_back)
    assert got[2:4] == want[2:4] and (got[3] > int(got[4]) * 16) == (not read_back)  # the bound, or the count
    for g, w in zip(got[:2] + got[4:], want[:2] + want[4:]):
        assert torch.equal(g, w)


def test_kernels_build_for_hopper_without_spills():
    """sm_90a: the gather at the real width (D=5120, 1x128 groups: the wider tile, K=6) and the slot scan at E=384
    spill nothing (the [D/group, group] tile over 8 warps)."""
    mod = "deepinfer.codegen.kernels.moe_routing"
    sig = {"x_ptr": "*bf16", "slot_ptr": "*i32", "counts_ptr": "*i32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "T": "i32", "E": "i32", "D": "i32", "stride_x": "i32",
           "ROWS": "i32", "BLOCK_M": "i32"}  # fmt: skip
    consts = dict(K=6, G=40, GROUP=128, BLOCK_G=64, BLOCK_E=64, BLOCK_PAD=128, WRITE_X=True, FILL=mr.GATHER_FILL)
    ptx, report = compile_sm90(mod, "_gather_quant_kernel", sig, consts, num_warps=mr.GATHER_WARPS)
    assert spill_free(report) and "e4m3x2" in ptx, report
    sig = {"idx_ptr": "*i32", "part_ptr": "*i32", "counts_ptr": "*i32", "slot_ptr": "*i32", "tile_expert_ptr": "*i32",
           "total_ptr": "*i64", "P": "i32", "E": "i32", "S": "i32", "SEG": "i32", "N_TILES": "i32",
           "BLOCK_M": "i32"}  # fmt: skip
    consts = dict(BLOCK=mr.LAYOUT_BLOCK, BLOCK_E=512, BLOCK_S=4, TILE_BLOCK=mr.TILE_BLOCK)
    _, report = compile_sm90(mod, "_layout_slots_kernel", sig, consts, num_warps=mr.LAYOUT_WARPS)
    assert spill_free(report), report


@pytest.mark.gpu
@pytest.mark.parametrize("e", [48, 384])
def test_cuda_layout_and_gather_at_an_ep8_rank_equal_the_torch_path(e):
    """T=8192, K=6, D=5120, 128-row tiles: the compiled kernels against the torch references (slot, tile_expert,
    counts, the exact count, codes and scales of every real tile's rows), both groups."""
    t, k, d, bm = 8192, 6, 5120, 128
    idx = routing(t, k, e, "spread", seed=e).cuda()
    x = (torch.randn(t, d, device="cuda") * torch.logspace(-8, 8, d, base=2.0, device="cuda")).bfloat16()
    n_tiles = ka._tile_bucket(mr.layout_tile_bound(t * k, e, bm))
    got = mr.triton_contiguous_layout(idx, e, bm, n_tiles)
    want = mr.contiguous_layout_reference(idx, e, bm, n_tiles)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    real_rows = int(want[3]) * bm
    for group in (128, 32):
        a, sa, _ = mr.triton_gather_quant(x, got[0], got[2], group, n_tiles * bm, bm)
        ra, rsa, _ = mr.gather_quant_reference(x, want[0], want[2], group, n_tiles * bm, bm)
        assert torch.equal(a[:real_rows].view(torch.uint8), ra[:real_rows].view(torch.uint8))
        assert torch.equal(sa[:, :real_rows], rsa[:, :real_rows])


@pytest.mark.parametrize("on_triton", [False, True])
def test_layout_x_leaves_the_shared_experts_codes_when_the_groups_match(interpret, monkeypatch, on_triton):
    """_layout_x: the layout rows as gather_quant gives them, and _quant_x's entry (quant_rows' codes and scales of
    x) only where the shared expert quantises per the same group; the interpreter (on_triton) or the torch path."""
    if on_triton:
        monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    t, k, e, bm, d = 70, 6, 48, 16, 256  # T > 64: prefill, _quant_x keeps T rows
    idx, x = routing(t, k, e, "spread", seed=5), _x(t, d, seed=5)
    slot, _, rows, _, _, counts = ka._moe_layout_rows(idx, e, bm)
    for shared_block, kept in ((128, True), (32, False)):
        call = ka.Call("moe_grouped_experts", {"shared_block": shared_block}, [x, None, idx, x], [], [], {})
        a, sa = ka._layout_x(call, slot, counts, 128, rows, bm)
        ra, rsa, _ = mr.gather_quant_reference(x, slot, counts, 128, rows, bm)
        used = slot.long()
        assert torch.equal(a[used].view(torch.uint8), ra[used].view(torch.uint8))
        assert torch.equal(sa[:, used], rsa[:, used])
        assert (("x_quant", 128) in call.memo) == kept
        if kept:
            q, s = ka.quant_rows(x, 128, t)
            xq, xs = call.memo[("x_quant", 128)]
            assert torch.equal(xq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(xs, s)
