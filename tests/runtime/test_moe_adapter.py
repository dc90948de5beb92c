"""MoEGroupedAdapter's decode path (issue 6/8): the swap-AB masked program with the fused SwiGLU epilogue, W4A8 for
FP4 experts, the contiguous paths at prefill. CPU: the adapter's layout work runs against stand-ins written from
the program's docstring (kernel_adapters.emulated_kernel) and, at small shapes, against the real programs built
for TileLang's `c` target; the oracle is the node's own torch reference (fp32, no activation quantisation)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir import dtypes as dt
from deepinfer.ir.registry import get_op
from deepinfer.models.checkpoint import _quant_fp4_rows
from deepinfer.runtime import kernel_adapters as ka

# one e4m3 step on the activations and the SwiGLU output; a wrong row, expert or tile is O(1)
TOL = 0.08


def _fp8_weight(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) / k**0.5
    s = dt.pow2_scale(w.view(n // 32, 32, k // 32, 32).abs().amax(dim=(1, 3)), dt.FP8_MAX)
    q = (w / s.repeat_interleave(32, 0).repeat_interleave(32, 1)).to(torch.float8_e4m3fn)
    return q, dt.float_to_e8m0(s)


def _fp4_weight(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    return _quant_fp4_rows(torch.randn(n, k, generator=gen) / k**0.5, 32)


def moe_call(t: int, d: int, inter: int, e: int, k: int, *, fmt: str = "fp8", shared: bool = False,
             layout: str = "auto", dup: bool = False, seed: int = 0) -> ka.Call:  # fmt: skip
    """A moe_grouped_experts call as the executor builds it (parameters named, V4.1's 32-blocks, limit 10)."""
    gen = torch.Generator().manual_seed(seed)
    make = _fp4_weight if fmt == "fp4" else _fp8_weight
    x = torch.randn(t, d, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if dup:  # hash routing can list an expert twice for one token
        idx[0, 1] = idx[0, 0]
    weights = torch.rand(t, k, generator=gen)
    experts = []
    for _ in range(e):
        w1, w2, w3 = make(inter, d, gen), make(d, inter, gen), make(inter, d, gen)
        experts += [w1[0], w1[1], w2[0], w2[1], w3[0], w3[1]]
    sh = [None] * 6
    if shared:
        (a, sa), (b, sb), (c, sc) = _fp8_weight(128, d, gen), _fp8_weight(128, d, gen), _fp8_weight(d, 128, gen)
        sh = [a, b, c, sa, sb, sc]
    args = [x, weights, idx, *sh, *experts]
    names = ["x", "w", "idx"] + [f"p{i}" for i in range(len(args) - 3)]
    is_param = [False, False, False] + [a is not None for a in args[3:]]
    attrs = {"n_experts": e, "fmt": fmt, "swiglu_limit": 10.0, "block": 32, "layout": layout, "masked_max_t": 64,
             "shared_limit": 10.0, "shared_block": 32, "shared_mid_group": 32}  # fmt: skip
    return ka.Call("moe_grouped_experts", attrs, args, names, is_param, {}, {})


def run_adapter(call: ka.Call, builder) -> torch.Tensor:
    adapter = ka.MoEGroupedAdapter()
    kernels = [builder(key) for key in adapter.keys(call)]
    return adapter.run(call, kernels)[0]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def reference(call: ka.Call) -> torch.Tensor:
    return get_op("moe_grouped_experts").run(call.args, call.attrs)[0]


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize(
    "fmt,t,layout,path",
    [
        ("fp8", 3, "auto", "swab_masked+swiglu"),  # decode: masked layout, fused SwiGLU epilogue
        ("fp8", 80, "auto", "contiguous"),  # T > masked_max_t: the contiguous grouped main loop
        ("fp4", 3, "auto", "swab_masked+swiglu"),  # W4A8 decode
        ("fp4", 20, "contiguous", "swab_contiguous+swiglu"),  # W4A8 prefill
    ],
)
def test_paths_with_emulated_kernels_match_the_reference(fmt, t, layout, path):
    call = moe_call(t, 256, 128, 8, 2, fmt=fmt, layout=layout, shared=fmt == "fp8")
    assert ka.MoEGroupedAdapter().path(call) == path
    assert rel_err(run_adapter(call, ka.emulated_kernel), reference(call)) < TOL


def test_masked_keys_do_not_depend_on_the_routing():
    """The decode kernels are keyed by T only (max_rows = T rounded to the token tile): a CUDA graph captured
    for one routing replays for any other."""
    keys = [ka.MoEGroupedAdapter().keys(moe_call(5, 256, 128, 8, 2, seed=s)) for s in range(3)]
    assert keys[0] == keys[1] == keys[2]
    (k1, k2) = keys[0]
    assert k1.program == k2.program == "swab_program" and dict(k1.kwargs)["max_rows"] == 16


def test_a_token_listing_an_expert_twice_is_merged_not_dropped():
    call = moe_call(4, 256, 128, 8, 3, dup=True)
    dest, counts, merged = ka.masked_layout(call.args[2], call.args[1], 8, 16)
    assert int(counts.sum()) == 4 * 3 - 1 and dest[0] == dest[1] and merged[0, 1] == 0
    assert merged[0, 0] == call.args[1][0, :2].sum()
    assert rel_err(run_adapter(call, ka.emulated_kernel), reference(call)) < TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_without_room_for_the_interleaved_copy_the_epilogue_reads_the_plain_stack(fmt):
    call = moe_call(3, 256, 128, 8, 2, fmt=fmt)
    call.cache[("moe_glu_ok", call.names[9])] = False
    assert ka.MoEGroupedAdapter().path(call) == "swab_masked+swiglu(split)"
    keys = ka.MoEGroupedAdapter().keys(call)
    assert dict(keys[0].kwargs)["glu_split"] is True and "glu_split" not in dict(keys[1].kwargs)
    assert rel_err(run_adapter(call, ka.emulated_kernel), reference(call)) < TOL


def test_the_torch_policy_runs_the_swiglu_in_torch():
    call = moe_call(3, 256, 128, 8, 2)
    call.cache[ka.GLU_POLICY] = "torch"
    assert ka.MoEGroupedAdapter().path(call) == "swab_masked"
    assert rel_err(run_adapter(call, ka.emulated_kernel), reference(call)) < TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_split_glu_on_the_c_target_program(fmt):
    """The real swab_program(glu_split=True) on TileLang's `c` target behind the adapter (plain stacks passed)."""
    call = moe_call(3, 256, 128, 8, 2, fmt=fmt)
    call.cache[ka.GLU_POLICY] = "split"
    assert ka.MoEGroupedAdapter().path(call) == "swab_masked+swiglu(split)"
    assert rel_err(run_adapter(call, ka.c_target_kernel), reference(call)) < TOL


def test_expert_dims_no_tile_fits_decline_with_the_reason():
    """I = 32: no 64-row swap-AB weight tile, nor the contiguous loop's 128-row tile; the node's reference runs."""
    with pytest.raises(ka.Decline, match="do not tile"):
        ka.MoEGroupedAdapter().keys(moe_call(2, 128, 32, 4, 2))


def test_the_emulation_reads_the_interleaved_stack():
    """The stand-in undoes gate_up_tiles exactly (else it would agree with a wrongly interleaved adapter)."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    w = torch.randn(2, 256, 8)
    assert torch.equal(ka._untile_gate_up(mg.gate_up_tiles(w, 32), 32), w)
    assert not torch.equal(mg.gate_up_tiles(w, 32), w)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_masked_decode_on_the_c_target_programs(fmt):
    """The real swap-AB programs (c target, fp32 data) behind the adapter: operand layouts, the interleaved
    w1|w3 stack, the W4A8 bytes, Counts; agrees with the stand-ins and with the node's reference."""
    pytest.importorskip("tilelang")
    call = moe_call(3, 128, 64, 4, 2, fmt=fmt, seed=1)
    assert ka.MoEGroupedAdapter().path(call) == "swab_masked+swiglu"
    got = run_adapter(call, ka.c_target_kernel)
    emu = run_adapter(moe_call(3, 128, 64, 4, 2, fmt=fmt, seed=1), ka.emulated_kernel)
    assert rel_err(got, emu) < 2e-2  # fp32 vs fp32 sums in other orders; rare e4m3 rounding flips of h
    assert rel_err(got, reference(call)) < TOL


def test_fp4_prefill_on_the_c_target_programs():
    """W4A8 prefill: the contiguous swap-AB program (128-token tiles, tile -> expert map) behind the adapter."""
    pytest.importorskip("tilelang")
    call = moe_call(20, 256, 128, 4, 2, fmt="fp4", layout="contiguous", seed=2)
    assert ka.MoEGroupedAdapter().path(call) == "swab_contiguous+swiglu"
    got = run_adapter(call, ka.c_target_kernel)
    emu = run_adapter(moe_call(20, 256, 128, 4, 2, fmt="fp4", layout="contiguous", seed=2), ka.emulated_kernel)
    assert rel_err(got, emu) < 2e-2
    assert rel_err(got, reference(call)) < TOL


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_the_shared_expert_is_one_swab_pair_at_decode(fmt):
    """T <= 64: the shared expert as a 1-expert swap-AB pair (fused SwiGLU) on the routed path's quantised x;
    above: two dense fp8_gemm launches ([w1; w3], w2). Both against the node's reference."""
    adapter = ka.MoEGroupedAdapter()
    call = moe_call(5, 256, 128, 8, 2, fmt=fmt, shared=True)
    keys = adapter.keys(call)
    assert [k.program for k in keys] == ["swab_program"] * 4
    assert keys[2].args == (16, 256, 256, 1) and dict(keys[2].kwargs)["swiglu_limit"] == 10.0
    assert rel_err(run_adapter(call, ka.emulated_kernel), reference(call)) < TOL
    dense = moe_call(80, 256, 128, 8, 2, shared=True)
    assert [k.family for k in adapter.keys(dense)[2:]] == ["fp8_gemm"] * 2  # [w1; w3] stacked, then w2


def test_the_shared_swab_pair_on_the_c_target_programs():
    call = moe_call(3, 256, 128, 8, 2, shared=True)
    assert rel_err(run_adapter(call, ka.c_target_kernel), reference(call)) < TOL


def _masked_layout_by_sort(idx, weights, n_experts, max_rows):
    """The previous formulation (stable argsort of the kept pairs' experts): the oracle of the one-hot count."""
    t, k = idx.shape
    first = (idx.unsqueeze(2) == idx.unsqueeze(1)).int().argmax(-1)
    keep = first == torch.arange(k)
    merged = torch.zeros(t, k).scatter_add_(1, first, weights.float())
    e_kept = torch.where(keep, idx.long(), torch.full_like(idx.long(), n_experts)).reshape(-1)
    counts = torch.zeros(n_experts + 1, dtype=torch.long).scatter_add_(0, e_kept, torch.ones_like(e_kept))
    order = torch.argsort(e_kept, stable=True)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(e_kept)
    rank[order] = torch.arange(e_kept.numel()) - start[e_kept[order]]
    dest = torch.gather((e_kept * max_rows + rank).view(t, k), 1, first)
    return dest.reshape(-1), counts[:n_experts].to(torch.int32), merged


@pytest.mark.parametrize("t,k,e,dups", [(1, 6, 384, False), (64, 6, 384, False), (7, 4, 8, True), (256, 6, 16, True)])
def test_masked_layout_equals_the_sort_formulation(t, k, e, dups):
    g = torch.Generator().manual_seed(t)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if dups:  # hash routing: repeated experts within a token
        idx[:, -1] = idx[:, 0]
        idx[0] = idx[0, 0]
    w = torch.rand(t, k, generator=g)
    got, want = ka.masked_layout(idx, w, e, 256), _masked_layout_by_sort(idx, w, e, 256)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
