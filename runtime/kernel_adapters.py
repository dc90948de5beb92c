"""Adapters between graph nodes and compiled codegen kernels (the CUDA executor's per-family glue).

A kernel is built for concrete shapes, dtypes and layouts (fp8 codes + fp32 MN-major scales, bf16 activations);
a node carries the op's semantics (f32 activations, e8m0 scales, per-expert weight lists). An adapter bridges
the two for one family:

    keys(call)          -> the kernels it needs: hashable, picklable KernelKeys (so they can be pre-built in
                           other processes); raises Decline(reason) when the family cannot take this call
    run(call, kernels)  -> the node's outputs, in the node's dtypes

Rows are padded to buckets (powers of two, at least one tile) so a prefill of any length reuses a few kernels
instead of compiling one per token count. Weights are re-laid-out once per parameter (``Call.prep`` caches by
parameter name), never per call.

``build_kernel(key)`` compiles with TileLang (``execution_backend="tvm_ffi"``, as benchmarks/kernels_h200.py).
``emulated_kernel(key)`` returns a torch stand-in with the kernel's exact signature (written from the family's
torch reference), so the adapters' layout work is tested on CPU, without a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.ir import dtypes as dt

TILELANG_TARGET = {"kind": "cuda", "arch": "sm_90a"}
MIN_GEMM_ROWS = 64  # one wgmma tile of rows; also keeps the MN-major scale rows 16-byte aligned for TMA


class Decline(Exception):
    """This family cannot run this call; the message is the reason the report shows."""


@dataclass(frozen=True)
class KernelKey:
    family: str  # module in deepinfer.codegen.kernels
    program: str  # factory in that module
    args: tuple  # positional shape arguments
    kwargs: tuple  # sorted (name, value) pairs; "cfg" holds a tuple of Config fields

    def describe(self) -> str:
        kw = ", ".join(f"{k}={v}" for k, v in self.kwargs if k != "cfg")
        return f"{self.family}.{self.program}{self.args} {kw}"


def _key(family: str, program: str, args: tuple, cfg=None, **kwargs) -> KernelKey:
    kw = dict(kwargs)
    if cfg is not None:
        kw["cfg"] = tuple(sorted(vars(cfg).items()))
    return KernelKey(family, program, tuple(args), tuple(sorted(kw.items())))


@dataclass
class Call:
    """One node execution as an adapter sees it."""

    op: str
    attrs: dict
    args: list  # torch tensors (or None), the node's inputs
    names: list  # the inputs' value names (parameters are cached by name)
    is_param: list  # which inputs are parameters (re-laid-out once, cached)
    config: dict  # the binding's tile config for the nearest bucket
    cache: dict = field(default_factory=dict)  # the runner's per-parameter preparation cache
    memo: dict = field(default_factory=dict)  # per call: work keys() did that run() reuses

    def prep(self, tag: str, index: int | tuple, fn: Callable):
        """fn() once per parameter (tag, input names); recomputed every call for non-parameters."""
        idx = index if isinstance(index, tuple) else (index,)
        if not all(self.is_param[i] for i in idx):
            return fn()
        k = (tag, *(self.names[i] for i in idx))
        if k not in self.cache:
            self.cache[k] = fn()
        return self.cache[k]


# ---------------------------------------------------------------------------------------------- helpers


def bucket_rows(m: int, multiple: int) -> int:
    """Rows padded to a power of two, at least ``multiple`` and a multiple of it (few distinct kernels)."""
    p = max(multiple, 1 << max(0, m - 1).bit_length())
    return -(-p // multiple) * multiple


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def scales_f32(s: torch.Tensor) -> torch.Tensor:
    """e8m0 (or float) scales as the fp32 the kernels read."""
    return dt.e8m0_to_float(s) if s.dtype in (torch.float8_e8m0fnu, torch.uint8) else s.float()


def quant_act(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 as the graph's quant_fp8 op does it; returns (codes [M, K], fp32 scales [M, K/g]).

    The same numbers as quant_fp8_groups + e8m0_to_float (the scales are powers of two), without the e8m0
    round trip, whose positivity check is a device -> host synchronisation on every GEMM."""
    g = x.float().unflatten(-1, (-1, group))
    scale = dt.pow2_scale(g.abs().amax(-1, keepdim=True), dt.FP8_MAX)
    q = (g / scale).clamp(-dt.FP8_MAX, dt.FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


ACT_QUANT_ENV = "DEEPINFER_ACT_QUANT"  # "torch": quantise activations with the torch ops, not act_quant's kernel
ACT_QUANT_KERNEL_ON_CPU = False  # tests: the kernel under the Triton interpreter on CPU tensors
_ACT_QUANT_BROKEN: list = []  # the reason the kernel could not run (then every call takes the torch ops)


def _on_act_quant_kernels(x: torch.Tensor, launch):
    """launch(act_quant module, x with unit stride along its last dim) where act_quant's Triton kernels run (CUDA, or
    the interpreter when ACT_QUANT_KERNEL_ON_CPU; not with DEEPINFER_ACT_QUANT=torch), else None. A failure to build
    or launch (no triton, ...) turns them off for the process, said once; the callers' torch paths give the same
    numbers."""
    if not (x.is_cuda or ACT_QUANT_KERNEL_ON_CPU) or os.environ.get(ACT_QUANT_ENV) == "torch" or _ACT_QUANT_BROKEN:
        return None
    try:
        from deepinfer.codegen.kernels import act_quant

        return launch(act_quant, x if x.stride(-1) == 1 else x.contiguous())
    except Exception as e:
        _ACT_QUANT_BROKEN.append(f"{type(e).__name__}: {str(e)[:200]}")
        print(f"act_quant kernels off, torch quantisation instead: {_ACT_QUANT_BROKEN[0]}", flush=True)
        return None


def quant_rows(x2d: torch.Tensor, group: int, rows: int, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_act of x [M, K] as the GEMMs read it: (e4m3 codes [rows, K], MN-major fp32 scales [K/group, rows]),
    rows >= M padded. On CUDA one act_quant launch (codegen/kernels/act_quant.py: the same codes and scales bit for
    bit) instead of ~12 torch launches; padding rows hold zero codes (their scales differ: never read).
    chunks > 1: K in `chunks` column chunks laid out chunk-major ([chunks * rows, K / chunks] codes, row j * rows + t
    = chunk j of token t: the masked layout of a GEMM whose experts are K chunks), the same codes."""
    got = _on_act_quant_kernels(x2d, lambda aq, xc: aq.triton_act_quant(xc, group, rows, chunks=chunks))
    if got is not None:
        q, s = got
        return (q if q.dtype == torch.float8_e4m3fn else q.to(torch.float8_e4m3fn)), s
    if chunks > 1:  # the chunk-major layout by a transposed copy, then the one-chunk path
        m, k = x2d.shape
        xg = x2d.new_zeros(chunks, rows, k // chunks)
        xg[:, :m] = x2d.view(m, chunks, k // chunks).transpose(0, 1)
        return quant_rows(xg.view(chunks * rows, k // chunks), group, chunks * rows)
    a, sa = quant_act(x2d, group)
    return pad_rows(a, rows), pad_rows(sa, rows).T.contiguous()


def scale_bytes(s: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as their uint8 bytes (what the W4A8 kernels read)."""
    return s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else s.to(torch.uint8)


def to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Positive power-of-two fp32 scales as ue8m0 (dt.float_to_e8m0 without its synchronising check)."""
    return (torch.ceil(torch.log2(s.float())).clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (normal fp32) as ue8m0: their exponent byte (to_e8m0's numbers in 2 launches, not 5)."""
    return (s.contiguous().view(torch.int32) >> 23).to(torch.uint8).view(torch.float8_e8m0fnu)


def _cuda_only(call: Call) -> None:
    x = next(a for a in call.args if a is not None)
    if x.device.type != "cuda" and not EMULATE:
        raise Decline("compiled kernels run on CUDA tensors only")


EMULATE = False  # tests set this: emulated kernels stand in for the compiled ones on CPU

ADAPTER_INTERPRET_ENV = "DEEPINFER_ADAPTER_INTERPRET"


def _triton_on(t: torch.Tensor) -> bool:
    """Whether a Triton-launching adapter runs its kernel for tensor t: always on CUDA; on CPU only when a test asks
    for Triton's interpreter for the adapters too (DEEPINFER_ADAPTER_INTERPRET=1 next to TRITON_INTERPRET=1), else
    the op's torch formula. TRITON_INTERPRET alone is not enough: the kernel tests' conftest turns it on for the
    whole CPU suite, and every runtime test's graph would then run its Triton adapters in the interpreter
    (minutes per graph)."""
    return t.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get(ADAPTER_INTERPRET_ENV) == "1")


# ---------------------------------------------------------------------------------------------- fp8_gemm


def _gemm_cfg(call: Call, m: int, n: int, k: int, group: int, tuned: bool):
    from deepinfer.codegen.kernels import fp8_gemm

    if tuned and k % 128 == 0:
        cfg = fp8_gemm.sm90_config(m, n, group)  # the measured-best sm90 formulation (BENCHMARKS.md)
    else:
        fields = {f: call.config[f] for f in vars(fp8_gemm.Config()) if f in call.config}
        cfg = fp8_gemm.Config(**fields)
    if k % cfg.block_k or group % min(cfg.block_k, group):
        raise Decline(f"K={k} is not a multiple of block_k {cfg.block_k}")
    return cfg


DENSE_SWAB_MAX_T = 64  # decode linear_fp8 on the swap-AB program up to this many rows (one pass over the weight)
DENSE_SWAB_ENV = "DEEPINFER_DENSE_SWAB"  # "0": decode linear_fp8 on fp8_gemm as before


@dataclass(frozen=True)
class SwabSplit:
    """The dense swap-AB plan's K split: the weight's K in `splits` chunks, each chunk one 'expert' of the masked
    program over the same token rows; the partial products summed afterwards."""

    splits: int


DENSE_SWAB_CTAS = 2 * 132  # target CTAs of a dense swap-AB launch (two per SM at 64-token tiles)
DENSE_SWAB_MAX_SPLITS = 16  # bf16 partials summed: more splits, more partial traffic and roundings


def dense_swab_splits(n: int, k: int, block_n: int = 64, block_k: int = 128) -> int:
    """K chunks for a dense swap-AB GEMM: N / block_n CTAs alone leave most SMs idle at small N (wkv 512 x 5120:
    8 CTAs each walking K = 5120 serially), so K is split into the most whole block_k chunks that keep the grid
    within DENSE_SWAB_CTAS (at most DENSE_SWAB_MAX_SPLITS)."""
    tiles, steps = n // block_n, k // block_k
    cands = range(1, min(steps, DENSE_SWAB_MAX_SPLITS) + 1)
    return max((d for d in cands if steps % d == 0 and tiles * d <= DENSE_SWAB_CTAS), default=1)


def _dense_swab_plan(call: Call, x2d: torch.Tensor, n: int, group: int, block: int):
    """(key, rows, SwabSplit) of moe_grouped_gemm's swap-AB program for a decode linear_fp8 [T <= 64], or None.
    fp8_gemm tiles M by 128 rows and its decode CTAs stream few weight tiles each (wq_b 64 x 32768 x 1280: 37 us =
    29% of HBM on the H200); the swap-AB program puts the weight rows on the MMA's M side and all T tokens in one
    tile, the MoE's decode program (93-97% of HBM there with wide TMA boxes), with K split over 'experts' where N
    alone gives too few CTAs (dense_swab_splits). Off with DEEPINFER_DENSE_SWAB=0 and in batch-invariant mode (it
    sums K in another order than fp8_gemm above 64 rows)."""
    from deepinfer.passes.select_kernels import batch_invariant_mode

    t, k = x2d.shape
    if t > DENSE_SWAB_MAX_T or os.environ.get(DENSE_SWAB_ENV) == "0" or batch_invariant_mode():
        return None
    if call.args[1].dtype != torch.float8_e4m3fn or block % 32:
        return None
    cfg = dense_swab_config(t)
    if _swab_unfit(n, k, "fp8", cfg, block, group, False):
        return None
    bt, splits = cfg.block_t, dense_swab_splits(n, k, cfg.block_n, cfg.block_k)
    return _key("moe_grouped_gemm", "swab_program", (splits * bt, n, k // splits, splits), cfg, act_group=group,
                swiglu_limit=None, fmt="fp8", weight_block=block, max_rows=bt), bt, SwabSplit(splits)  # fmt: skip


def dense_swab_config(t: int):
    """The swap-AB tile of a decode linear_fp8: every token in one tile (16, 32 or 64 rows: the weight read once),
    64 weight rows, wide TMA boxes (swab_config's fp8 decode default: 93-97% of HBM for the MoE)."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    bt = _shared_rows(min(t, DENSE_SWAB_MAX_T))
    return mg.SwabConfig(64, bt, 128, 4, {16: 4, 32: 3}.get(bt, 2), wide_tma=True)


def _split_k_stack(w: torch.Tensor, s: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] and its fp32 block scales [N/b, K/b] as `splits` experts of K/splits columns ([S, N, K/S] and
    [S, N/b, K/(S b)]; views for one split, one copy per weight otherwise)."""
    if splits == 1:
        return w.unsqueeze(0), s.unsqueeze(0).contiguous()
    n, k = w.shape
    ws = w.view(n, splits, k // splits).transpose(0, 1).contiguous()
    ss = s.view(s.shape[0], splits, s.shape[1] // splits).transpose(0, 1).contiguous()
    return ws, ss


def _dense_swab(call: Call, kernel, x2d: torch.Tensor, wi: int, si: int, group: int, rows: int, splits: int):
    """x2d [T, K] @ W^T on the swap-AB program with K in `splits` experts -> fp32 [T, N]."""
    t, n = x2d.shape[0], call.args[wi].shape[0]
    w, s = call.prep(f"swab_w{splits}", (wi, si), lambda: _split_k_stack(call.args[wi], scales_f32(call.args[si]),
                                                                          splits))  # fmt: skip
    # chunk c of every token in the rows of expert c, quantised in place (K chunks are whole act groups: the same
    # codes as unsplit); the quantiser pads each chunk's token tile itself
    a, sa_t = quant_rows(x2d, group, rows, chunks=splits)
    c = torch.empty(splits * rows, n, dtype=torch.bfloat16, device=x2d.device)
    kernel(a, sa_t, w, s, _const_counts(call, splits, t, x2d.device), c)
    part = c.view(splits, rows, n)[:, :t]
    return part[0].float() if splits == 1 else part.sum(0, dtype=torch.float32)


@dataclass(frozen=True)
class SkipTiles:
    """A prefill linear_fp8 on the MoE's persistent grouped program as ONE expert (moe_grouped_gemm.program, E = 1):
    the row bucket's tiles wholly past M are marked -1, which that program skips (no MMA), where fp8_gemm's program
    computes every row of the power-of-two bucket -- up to twice the work for M just above a power of two (a
    prompt's last prefill chunk). Same warp-specialised main loop (H200, session 7: the grouped form of wo_a at
    47.3% of the FP8 peak vs 46.8% for dense launches)."""

    n: int
    block_m: int


SKIP_TILES_ENV = "DEEPINFER_DENSE_SKIP_TILES"  # "0": fp8_gemm's program over the whole row bucket, as before
SKIP_TILES_MIN_WASTE = 8  # the grouped form when at least 1/8 of the bucket's tiles are wholly padding


def _skip_tiles_plan(call: Call, m: int, rows: int, n: int, k: int, group: int, block: int, tuned: bool):
    """(key, rows, SkipTiles) of a prefill linear_fp8 whose row bucket is mostly padding, or None. Not in
    batch-invariant mode (the program, so the summation order, would depend on M)."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg
    from deepinfer.passes.select_kernels import batch_invariant_mode

    if not tuned or os.environ.get(SKIP_TILES_ENV) == "0" or batch_invariant_mode():
        return None
    if n % 256 or k % 128 or 128 % min(group, block):
        return None
    cfg = mg.sm90_config(0, n, k_group=group)
    tiles = rows // cfg.block_m
    skipped = tiles - -(-m // cfg.block_m)  # whole tiles past M: what the grouped program saves
    if rows % cfg.block_m or skipped < 1 or skipped * SKIP_TILES_MIN_WASTE < tiles:
        return None
    key = _key("moe_grouped_gemm", "program", (rows, n, k, 1), cfg, act_group=group, weight_block=block)
    return key, rows, SkipTiles(n, cfg.block_m)


def _gemm_plan(call: Call, x2d: torch.Tensor, n: int, group: int, block: int, tuned: bool):
    """(key, rows, n_pad) of the FP8 GEMM for x2d @ W^T; n_pad a SwabSplit: the swap-AB program (_dense_swab_plan);
    a SkipTiles: the grouped program skipping the bucket's padding tiles (_skip_tiles_plan)."""
    swab = _dense_swab_plan(call, x2d, n, group, block)
    if swab is not None:
        return swab
    m, k = x2d.shape
    rows = bucket_rows(m, MIN_GEMM_ROWS)
    skip = _skip_tiles_plan(call, m, rows, n, k, group, block, tuned)
    if skip is not None:
        return skip
    cfg = _gemm_cfg(call, rows, n, k, min(group, block), tuned)
    n_pad = -(-n // cfg.block_n) * cfg.block_n
    key = _key("fp8_gemm", "program", (rows, n_pad, k), cfg, act_group=group, weight_block=block)
    return key, rows, n_pad


def _gemm_weight(call: Call, wi: int, si: int, n_pad: int, block: int):
    def make():
        w, s = call.args[wi], scales_f32(call.args[si])
        return pad_rows(w, n_pad), pad_rows(s, -(-n_pad // block)).contiguous()

    return call.prep(f"gemm_w{n_pad}", (wi, si), make)


def fp8_linear(call: Call, kernel, x: torch.Tensor, wi: int, si: int, group: int, block: int, key_info) -> torch.Tensor:
    """x [..., K] @ W^T through the FP8 kernel: quantise x per group, pad rows and N, crop."""
    _, rows, n_pad = key_info
    n = call.args[wi].shape[0]
    x2d = x.reshape(-1, x.shape[-1])
    if isinstance(n_pad, SwabSplit):  # the swap-AB program (_dense_swab_plan)
        return _dense_swab(call, kernel, x2d, wi, si, group, rows, n_pad.splits).to(x.dtype).reshape(*x.shape[:-1], n)
    a, sa_t = quant_rows(x2d, group, rows)  # the kernel reads MN-major scales
    y = fp8_linear_codes(call, kernel, a, sa_t, x2d.shape[0], wi, si, block, key_info)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_linear_codes(call: Call, kernel, a: torch.Tensor, sa_t: torch.Tensor, m: int, wi: int, si: int, block: int,
                     key_info) -> torch.Tensor:  # fmt: skip
    """fp8_linear on activations already quantised as the fp8_gemm program reads them (e4m3 codes [rows, K], MN-major
    fp32 scales [K/group, rows]; a fused SwiGLU + quant writes them so): bf16 [m, N], a view of the padded output."""
    _, rows, n_pad = key_info
    assert a.shape[0] == rows and sa_t.shape[1] == rows, (a.shape, sa_t.shape, rows)
    if isinstance(n_pad, SkipTiles):  # W as a one-expert stack [1, N, K] (views; the scales made fp32 once)
        w, s = call.prep("gemm_w_expert", (wi, si), lambda: (call.args[wi].unsqueeze(0),
                                                             scales_f32(call.args[si]).unsqueeze(0).contiguous()))
        c = torch.empty(rows, n_pad.n, dtype=torch.bfloat16, device=a.device)
        kernel(a, sa_t, w, s, _group_tiles(call, 1, m, rows, n_pad.block_m, a.device), c)  # one group: W
        return c[:m]
    b, sb = _gemm_weight(call, wi, si, n_pad, block)
    c = torch.empty(rows, n_pad, dtype=torch.bfloat16, device=a.device)
    kernel(a, sa_t, b, sb, c)
    return c[:m, : call.args[wi].shape[0]]


class LinearFP8Adapter:
    """linear_fp8: activations quantised per group here (act_group, or the weight block when the graph
    multiplies unquantised activations: the kernel only takes FP8), one fp8_gemm launch, bf16 out."""

    family = "fp8_gemm"
    ops = ("linear_fp8",)
    tuned = True

    def _plan(self, call: Call):
        _cuda_only(call)
        x, w = call.args[0], call.args[1]
        block = call.attrs["block"]
        group = call.attrs["act_group"] or block
        return _gemm_plan(call, x.reshape(-1, x.shape[-1]), w.shape[0], group, block, self.tuned), group, block

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)[0][0]]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        info, group, block = self._plan(call)
        return [fp8_linear(call, kernels[0], call.args[0], 1, 2, group, block, info)]


# grouped_out_proj: wo_a on the contiguous grouped program from this many tokens (H200, session 7 call 2, the node at
# V4.1 dims vs swap-AB: 1.36x at T 256, 1.91x at 512, 2.32x at 8192; below 256 not measured)
OUT_PROJ_CONTIGUOUS_MIN_T = 256
OUT_PROJ_PREFILL_ENV = "DEEPINFER_OUT_PROJ_PREFILL"  # "swab": the swap-AB program at every T (A/B runs)


@dataclass(frozen=True)
class _OutProjPlan:
    """How one grouped_out_proj call runs (decided once per call, memoised)."""

    path: str  # "swab" (decode: masked swap-AB wo_a) | "contiguous" (prefill: the persistent grouped program)
    wo_a: KernelKey
    rows: int  # rows per group in wo_a's A / C (swab: T to the token tile; contiguous: T's bucket of tiles)
    wo_b: tuple  # the dense plan of wo_b (LinearFP8Adapter._plan(...)[0]: key, rows, n_pad)
    tile: int = 0  # contiguous: wo_a's block_m (TileExpert's tile)


class GroupedOutProjAdapter:
    """grouped_out_proj (the attention's wo_a per group, then wo_b), both GEMMs compiled. x arrives dequantised
    from the attention's FP8 epilogue: its re-quantisation per block_a reproduces those codes exactly
    (power-of-two scales, same group), so the first GEMM sees the reference's operands; the intermediate is the
    kernel's bf16 (the reference keeps fp32), quantised per mid_group (the op's Q/DQ) for fp8_gemm's wo_b.

    wo_a is G groups of [T, K] x [R, K]^T: a group is an "expert" that takes all T rows. x [T, G, K] is [T, G*K]
    with the groups as K chunks, quantised chunk-major ([G*rows, K] codes) straight from x, and wo_a [G*R, K] is
    the [G, R, K] expert stack as a view. Two programs:
      * decode (T < contiguous_min_t): moe_grouped_gemm.swab_program over the masked layout, the weight rows on
        the MMA's M side and the few tokens on its N side (one pass over the 32 MB of wo_a);
      * prefill: the swap-AB program re-reads wo_a once per token tile (13-15 ms a V4.1 layer at T = 8192,
        BENCHMARKS.md session 6), so wo_a runs on the MoE prefill's persistent grouped program (fp8_gemm's
        warp-specialised loop, group g = expert g, TileExpert = g for its T rows bucketed to 128-row tiles, the
        bucket's tiles past T skipped as padding: -1), and the intermediate is quantised chunk-major straight from
        its output (mid_group divides R: no group straddles two wo_a groups) with only the codes and scales moved
        to wo_b's token-major layout (bytes, not the fp32 [T, G*R] transposed copy of the swap-AB path).
    Both produce the same numbers up to fp32 summation order in wo_a."""

    family = "fp8_gemm"
    ops = ("grouped_out_proj",)
    dense = LinearFP8Adapter()
    contiguous_min_t = OUT_PROJ_CONTIGUOUS_MIN_T  # (tests and benchmarks set it per instance)
    tuned = True  # prefill: the persistent sm90 program where [R, K] tile by 256 x 128 (tests may turn it off)

    def _plan(self, call: Call) -> _OutProjPlan:
        if "out_proj_plan" not in call.memo:
            call.memo["out_proj_plan"] = self._make_plan(call)
        return call.memo["out_proj_plan"]

    def _make_plan(self, call: Call) -> _OutProjPlan:
        _cuda_only(call)
        x, wa, wb, sa, sb = call.args[:5]
        if sa is None or sb is None or wa.dtype != torch.float8_e4m3fn or wb.dtype != torch.float8_e4m3fn:
            raise Decline("the compiled grouped_out_proj takes block-scaled FP8 wo_a and wo_b")
        t, g, k = x.shape
        r, block = wa.shape[0] // g, call.attrs["block_a"]
        if r % block or k % block:
            raise Decline(f"wo_a's groups of R={r} x K={k} do not split into {block}-blocks")
        # wo_b's plan from a stand-in u of the right shape (an expanded scalar: no [T, G*R] allocation)
        u_like = torch.empty((), device=x.device)  # (f32: x may be the attention's FP8 codes)
        wo_b = self.dense._plan(self._wo_b_call(call, u_like.expand(t, g * r)))[0]
        cfg = self._contiguous_cfg(call, t, r, k)
        if cfg is not None:
            rows = bucket_rows(t, cfg.block_m)
            key = _key("moe_grouped_gemm", "program", (g * rows, r, k, g), cfg, act_group=block, weight_block=block)
            return _OutProjPlan("contiguous", key, rows, wo_b, cfg.block_m)
        key, rows = self._swab_key(call, t, g, r, k, block)
        return _OutProjPlan("swab", key, rows, wo_b)

    def _contiguous_cfg(self, call: Call, t: int, r: int, k: int):
        """wo_a's config on the contiguous grouped program at this T, or None (then the swap-AB program): from
        contiguous_min_t tokens (above the dense swap-AB range, so wo_b is fp8_gemm's program and takes the codes
        made here), where R and K tile by the persistent program (else the portable loop's 128 x 128) and R
        splits into mid_group groups."""
        from deepinfer.codegen.kernels import fp8_gemm
        from deepinfer.codegen.kernels import moe_grouped_gemm as mg

        a = call.attrs
        block, group = a["block_a"], a["mid_group"] or a["block_b"]
        if t < max(self.contiguous_min_t, DENSE_SWAB_MAX_T + 1) or os.environ.get(OUT_PROJ_PREFILL_ENV) == "swab":
            return None
        if r % group or 128 % block:
            return None
        if self.tuned and r % 256 == 0 and k % 128 == 0:
            return mg.sm90_config(0, r, k_group=block)
        cfg = fp8_gemm.default_config(block)
        return cfg if r % cfg.block_n == 0 and k % cfg.block_k == 0 else None

    @staticmethod
    def _swab_key(call: Call, t: int, g: int, r: int, k: int, block: int) -> tuple[KernelKey, int]:
        from deepinfer.codegen.kernels import moe_grouped_gemm as mg

        fields = {f: call.config[f] for f in vars(mg.SwabConfig()) if f in call.config}
        cfg = mg.SwabConfig(**fields) if fields else mg.swab_config(t, "fp8")
        why = _swab_unfit(r, k, "fp8", cfg, block, block, False)
        if why is not None:
            raise Decline(f"grouped wo_a (R={r}, K={k}): {why}")
        max_rows = -(-t // cfg.block_t) * cfg.block_t
        key = _key("moe_grouped_gemm", "swab_program", (g * max_rows, r, k, g), cfg, act_group=block,
                   swiglu_limit=None, fmt="fp8", weight_block=block, max_rows=max_rows)  # fmt: skip
        return key, max_rows

    def _wo_b_call(self, call: Call, u: torch.Tensor) -> Call:
        a = call.attrs
        attrs = {"block": a["block_b"], "act_group": a["mid_group"]}
        n, p = call.names, call.is_param
        # no config: the binding's is the grouped GEMM's (fp8_gemm takes its tuned sm90 one)
        return Call("linear_fp8", attrs, [u, call.args[2], call.args[4]], [f"{n[0]}.u", n[2], n[4]],
                    [False, p[2], p[4]], {}, call.cache)  # fmt: skip

    def path(self, call: Call) -> str:
        """Which wo_a program this call takes (tests and reports): "swab" or "contiguous"."""
        return self._plan(call).path

    def keys(self, call: Call) -> list[KernelKey]:
        p = self._plan(call)
        return [p.wo_a, p.wo_b[0]]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        p = self._plan(call)
        x, wa, _, sa, _ = call.args[:5]
        xs = call.args[5] if len(call.args) > 5 else None
        t, g, k = x.shape
        r, block = wa.shape[0] // g, call.attrs["block_a"]
        w, s = call.prep("wo_a_stack", (1, 3), lambda: (wa.view(g, r, k), scales_f32(sa).view(g, r // block, -1)))
        # the groups' rows: group g's T rows at g*rows ..., quantised chunk-major straight from x (no transposed
        # copy), or x's own codes moved there (x is FP8 already)
        if xs is None:
            a_m, sa_m = quant_rows(x.reshape(t, g * k), block, p.rows, chunks=g)
        else:
            a_m, sa_m = _codes_chunk_major(x, xs, p.rows)
        out_dtype = torch.float32 if xs is not None else x.dtype
        c = torch.empty(g * p.rows, r, dtype=torch.bfloat16, device=x.device)
        if p.path == "contiguous":
            kernels[0](a_m, sa_m, w, s, _group_tiles(call, g, t, p.rows, p.tile, x.device), c)
            return [self._wo_b_from_groups(call, p, kernels[1], c).to(out_dtype)]
        kernels[0](a_m, sa_m, w, s, _const_counts(call, g, t, x.device), c)
        u = c.view(g, p.rows, r)[:, :t].transpose(0, 1).reshape(t, g * r).float()
        sub = self._wo_b_call(call, u)
        a = call.attrs
        group = a["mid_group"] or a["block_b"]
        return [fp8_linear(sub, kernels[1], u, 1, 2, group, a["block_b"], p.wo_b).to(out_dtype)]

    def _wo_b_from_groups(self, call: Call, p: _OutProjPlan, kernel, c: torch.Tensor) -> torch.Tensor:
        """wo_b on fp8_gemm's program from wo_a's chunk-major bf16 output c [G*rows, R]: quantised per mid_group as
        it lies (the codes and scales quant_rows gives u [T, G*R]: the same groups), then moved token-major."""
        a = call.attrs
        group, block_b = a["mid_group"] or a["block_b"], a["block_b"]
        t, g = call.args[0].shape[:2]
        q, sq = quant_rows(c, group, c.shape[0])
        a_u, sa_u = _token_major(q, sq, g, p.rows, t, p.wo_b[1])
        return fp8_linear_codes(self._wo_b_call(call, a_u), kernel, a_u, sa_u, t, 1, 2, block_b, p.wo_b)


def _codes_chunk_major(xc: torch.Tensor, xs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 x (e4m3 codes [T, G, K], ue8m0 scales [T, G, K/block]) in quant_rows(..., chunks=G)'s layout: codes
    [G*rows, K] (row j*rows + i = group j of token i; padding rows zero) and MN-major fp32 scales [K/block, G*rows]
    (padding columns 1: never read). The same operand values as quantising dequant_fp8(xc, xs) again (that can
    pick a code twice as large at half the scale where rounding brought a group's maximum down to 448 x the
    smaller scale: the same products, scaled exactly by powers of two); bytes moved, nothing computed. On CUDA one
    Triton launch (act_quant.triton_codes_chunk_major); these torch copies are its CPU reference."""
    got = _on_act_quant_kernels(xc, lambda aq, c: aq.triton_codes_chunk_major(c, xs, rows))
    if got is not None:
        return got[0].view(torch.float8_e4m3fn), got[1]
    t, g, k = xc.shape
    kb = xs.shape[-1]
    a = torch.empty(g, rows, k, dtype=xc.dtype, device=xc.device)
    a.view(torch.uint8)[:, :t].copy_(xc.view(torch.uint8).transpose(0, 1))
    a.view(torch.uint8)[:, t:] = 0
    sa = torch.ones(kb, g, rows, device=xc.device)
    sa[:, :, :t] = scales_f32(xs).permute(2, 1, 0)
    return a.view(g * rows, k), sa.view(kb, g * rows)


def _group_tiles(call: Call, g: int, t: int, rows: int, block_m: int, device) -> torch.Tensor:
    """TileExpert of G groups of T rows each padded to `rows` (grouped_out_proj's contiguous wo_a; G = 1: a dense
    GEMM's SkipTiles): group j's rows/block_m tiles are j's, those wholly past T padding (-1: skipped, no MMA); made
    once per (G, T, rows, tile, device) like _const_counts (no launch a step)."""
    k = ("out_proj_tiles", g, t, rows, block_m, str(device))
    if k not in call.cache:  # made on the device (no host copy: capturable)
        tiles = torch.arange(g, dtype=torch.int32, device=device).view(g, 1).expand(g, rows // block_m).contiguous()
        tiles[:, -(-t // block_m) :] = -1
        call.cache[k] = tiles.flatten()
    return call.cache[k]


def _token_major(q: torch.Tensor, sq: torch.Tensor, g: int, rows: int, t: int, rows_b: int):
    """Chunk-major codes q [G*rows, R] and scales sq [R/gr, G*rows] (row j*rows + i = group j of token i) as the
    token-major [rows_b, G*R] codes and [G*R/gr, rows_b] MN-major scales of u [T, G*R] (rows past T: zero codes
    and scales)."""
    r, gs = q.shape[1], sq.shape[0]
    a = torch.empty(rows_b, g * r, dtype=q.dtype, device=q.device)
    sa = torch.empty(g * gs, rows_b, dtype=sq.dtype, device=q.device)
    a.view(torch.uint8)[:t].view(t, g, r).copy_(q.view(torch.uint8).view(g, rows, r)[:, :t].transpose(0, 1))
    sa[:, :t].unflatten(0, (g, gs)).copy_(sq.view(gs, g, rows)[:, :, :t].transpose(0, 1))
    if rows_b > t:
        a.view(torch.uint8)[t:] = 0
        sa[:, t:] = 0
    return a, sa


class FakeQuantAdapter:
    """fake_quant_fp8 (a folded Q/DQ pair, e.g. the MoE's input): act_quant's codes times their power-of-two
    scales -- fake_quant_fp8's numbers exactly (the e4m3 -> fp32 conversion and the power-of-two product are
    exact). Where Triton runs: one launch (act_quant.triton_fake_quant: x read once, y written once); else
    quant_rows + two torch launches. No TileLang kernel (keys: none)."""

    family = "act_quant"
    ops = ("fake_quant_fp8",)

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        x = call.args[0]
        if x.dtype != torch.float32 or x.shape[-1] % call.attrs["group"]:
            raise Decline("fake_quant_fp8 through act_quant takes f32 rows that split into groups")
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        x, g = call.args[0], call.attrs["group"]
        x2d = x.reshape(-1, x.shape[-1])
        y = _on_act_quant_kernels(x2d, lambda aq, xc: aq.triton_fake_quant(xc, g))
        if y is not None:
            return [y.view(x.shape)]
        q, s_t = quant_rows(x2d, g, x2d.shape[0])
        y = (q.float().unflatten(-1, (-1, g)) * s_t.T.unsqueeze(-1)).flatten(-2)
        return [y.view(x.shape)]


class DequantAdapter:
    """dequant_fp8 (the attention's FP8 output widened for grouped_out_proj) in one Triton launch
    (act_quant.triton_dequant: code x 2^(byte - 127), dequant_fp8_groups' numbers bit for bit; ~5 torch launches
    before). No TileLang kernel (keys: none). On CPU tensors (the emulated tests) the kernel runs under Triton's
    interpreter when it is on, else the op's torch formula stands in."""

    family = "act_quant"
    ops = ("dequant_fp8",)

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        q, s = call.args
        a = call.attrs
        if a.get("dtype", dt.f32) != dt.f32 or s.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise Decline("the dequant kernel writes fp32 from ue8m0 scales")
        if q.shape[-1] % a["group"]:
            raise Decline(f"K={q.shape[-1]} does not split into groups of {a['group']}")
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import act_quant

        q, s = call.args
        if not _triton_on(q):
            from deepinfer.ir.ops.quant import dequant_fp8_groups

            return [dequant_fp8_groups(q, s, call.attrs["group"]).float()]
        codes = q if q.is_cuda else q.float()  # (the interpreter takes no fp8 tensors: their exact values)
        return [act_quant.triton_dequant(codes, s, call.attrs["group"])]


class ScatterRowsAdapter:
    """scatter_rows (KV ring / compressed-KV / index-key writes): the cache copied, the rows written by one Triton
    launch (cache_rows.triton_scatter_rows), the reference's result exactly; ~5 launches in the sync-free torch
    form a decode graph used. No TileLang kernel (keys: none). On CPU tensors (the emulated tests) the kernel runs
    under Triton's interpreter when it is on, else the op's torch formula stands in."""

    family = "cache_rows"
    ops = ("scatter_rows",)

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        cache, index, rows = call.args
        if index.dim() != 1 or rows.shape[0] != index.shape[0] or rows.shape[1:] != cache.shape[1:]:
            raise Decline("scatter_rows takes cache [N, ...], index [M] and rows [M, ...]")
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import cache_rows

        cache, index, rows = call.args
        if not _triton_on(cache):
            from deepinfer.runtime import cuda_graphs as cg

            return [cg.scatter_rows(cache, index, rows)]  # (the sync-free reference: the same rows)
        return [cache_rows.triton_scatter_rows(cache, index, rows)]


class CandidateBlocksAdapter:
    """candidate_blocks (V4.1 layer 20's candidate level) through codegen/kernels/candidate_blocks: two Triton
    launches (the visible blocks' maxima, one sort a row), the reference's ids exactly and no host read (capturable;
    the sync-free torch form a decode graph used before: a [T, C] pad, amax and a full sort). The config is the rule's
    for the tensors it runs (the cache's columns decide the sort's size). No TileLang kernel (keys: none). On CPU
    tensors the kernel runs under Triton's interpreter when it is on, else the sync-free torch form stands in."""

    family = "candidate_blocks"
    ops = ("candidate_blocks",)

    @staticmethod
    def _config(call: Call):
        from deepinfer.codegen.kernels import candidate_blocks as cb

        scores, pos = call.args
        if scores.dim() != 2 or pos.shape != scores.shape[:1]:
            raise Decline("candidate_blocks takes scores [T, C] and positions [T]")
        t, c = scores.shape
        k, block = int(call.attrs["topk_blocks"]), int(call.attrs["block"])
        cfg = cb.default_config(t, c, block, k)
        try:
            cb.check_config(c, block, k, cfg)
        except ValueError as e:
            raise Decline(str(e)) from None
        return cfg

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        self._config(call)
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import candidate_blocks as cb

        scores, pos = call.args
        a = {n: int(call.attrs[n]) for n in ("ratio", "topk_blocks", "block")}
        if not _triton_on(scores):
            from deepinfer.runtime import cuda_graphs as cg

            return [cg.candidate_blocks(scores, pos, **a)]  # (the sync-free reference: the same ids)
        return [cb.triton_candidate_blocks(scores, pos, cfg=self._config(call), **a)]


# ---------------------------------------------------------------------------------------------- rmsnorm


class RMSNormAdapter:
    """rmsnorm / rmsnorm_quant_fp8: bf16 activations in the kernel (the graph's f32 is rounded once),
    fp32 weight, MN-major fp32 scales back to the op's e8m0 [M, G]."""

    family = "rmsnorm_quant"
    ops = ("rmsnorm", "rmsnorm_quant_fp8")

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import rmsnorm_quant

        _cuda_only(call)
        x = call.args[0]
        d = x.shape[-1]
        m = x.numel() // d
        quant = call.op == "rmsnorm_quant_fp8"
        group = call.attrs["group"] if quant else 32
        if d % group:
            raise Decline(f"D={d} is not a multiple of the group {group}")
        cfg = rmsnorm_quant.Config(**{f: call.config[f] for f in ("block_m", "threads") if f in call.config})
        width = rmsnorm_quant.row_width(d, group, cfg.block_m, quant)
        cfg = rmsnorm_quant.Config(cfg.block_m, _norm_threads(cfg.block_m * width, cfg.threads))
        rows = bucket_rows(m, max(cfg.block_m, 16))
        io = {"io": "float32"} if x.dtype == torch.float32 else {}  # fp32 in memory, the bf16 kernel's numbers
        key = _key("rmsnorm_quant", "program", (rows, d), cfg, group=group, quant=quant, eps=float(call.attrs["eps"]),
                   **io)  # fmt: skip
        return key, rows, group, quant

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)[0]]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        _, rows, group, quant = self._plan(call)
        x = call.args[0]
        d = x.shape[-1]
        x2d = x.reshape(-1, d)
        m = x2d.shape[0]
        w = call.prep("norm_w", 1, lambda: _norm_weight(call.args[1], d, x.device))
        # an fp32 x goes in as it is (the io="float32" program rounds it to bf16 on load: no cast launches)
        xb = pad_rows(x2d if x.dtype == torch.float32 else x2d.to(torch.bfloat16), rows)
        if not quant:
            y = torch.empty_like(xb)
            kernels[0](xb, w, y)
            return [y[:m].to(x.dtype).reshape(x.shape)]
        q = torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(d // group, rows, dtype=torch.float32, device=x.device)
        kernels[0](xb, w, q, s)
        scales = to_e8m0(s[:, :m].T.contiguous())
        return [q[:m].reshape(x.shape), scales.reshape(*x.shape[:-1], d // group)]


def _norm_threads(elems: int, threads: int) -> int:
    """The most threads, up to the binding's, that split a block's row fragments (rmsnorm_quant.row_width wide)
    evenly: D for one row a CTA (every such count that divides it lays out and reduces, D=1280 included), a
    power-of-two group count for the quantising program's multi-row blocks."""
    while threads > 32 and elems % threads:
        threads //= 2
    return threads


def _norm_weight(w: torch.Tensor | None, d: int, device) -> torch.Tensor:
    return torch.ones(d, device=device) if w is None else w.float().contiguous()


# ---------------------------------------------------------------------------------------------- mHC


class HCPostAdapter:
    """hc_post: X' = post*y + comb^T X in one pass (bf16 streams in the kernel)."""

    family = "hyper_connection"
    ops = ("hc_post",)

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import hyper_connection as hc

        _cuda_only(call)
        t, n, d = call.args[1].shape
        bd = call.config.get("block_d", 512)
        bd = bd if d % bd == 0 else math.gcd(d, bd)
        if n != hc.N_HC or bd < 32:
            raise Decline(f"hc_post kernel needs {hc.N_HC} streams and D a multiple of 32 (n={n}, D={d})")
        rows = bucket_rows(t, 16)
        io = {"io": "float32"} if call.args[1].dtype == torch.float32 else {}  # fp32 streams: no cast launches
        key = _key("hyper_connection", "post_program", (rows, d), block_m=1, block_d=bd, threads=128, **io)
        return key, rows

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)[0]]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        key, rows = self._plan(call)
        y, x, post, comb = call.args
        t = x.shape[0]
        pb, cb = pad_rows(post.float(), rows), pad_rows(comb.float().reshape(t, -1), rows)
        if dict(key.kwargs).get("io") == "float32":  # the program rounds X and y to bf16 itself, writes fp32
            out = torch.empty(rows, *x.shape[1:], device=x.device)
            kernels[0](pad_rows(x.float(), rows), pad_rows(y.float(), rows), pb, cb, out)
            return [out[:t]]
        xb, yb = pad_rows(x.to(torch.bfloat16), rows), pad_rows(y.to(torch.bfloat16), rows)
        out = torch.empty_like(xb)
        kernels[0](xb, yb, pb, cb, out)
        return [out[:t].to(x.dtype)] if not call.memo.get("bf16_out") else [out[:t]]


HC_PRE_SPLIT_MAX_ROWS = 256
HC_PRE_SPLITS = 40  # the default D split at <= 256 tokens (5120 channels: 128 per CTA)


def _hc_pre_splits(t: int, d: int) -> int:
    """The D split of hc_pre at <= 256 tokens (pre_split_programs: D over S CTAs per 16 tokens + a finish kernel;
    pre_program walks all of D in one CTA per block of tokens: 230 us at 64 tokens on the H200, the split pair
    67 us at S=20 with its first finish kernel). The default: the largest S <= HC_PRE_SPLITS whose chunks are
    whole 64-channel blocks (at least 2), else 0 (pre_program). DEEPINFER_HC_PRE_SPLIT=S forces S (when D splits
    into S chunks of 64); 0 turns the split off."""
    env = os.environ.get("DEEPINFER_HC_PRE_SPLIT", "")
    if t > HC_PRE_SPLIT_MAX_ROWS:
        return 0
    if env != "":
        splits = int(env)
        return splits if splits > 0 and d % (splits * 64) == 0 else 0
    return next((s for s in range(HC_PRE_SPLITS, 1, -1) if d % (s * 64) == 0), 0)


class HCPreCollapseAdapter:
    """hc_pre_collapse: mixes + RMS + Sinkhorn + collapse with the previous pre, from one read of X."""

    family = "hyper_connection"
    ops = ("hc_pre_collapse",)

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import hyper_connection as hc

        _cuda_only(call)
        t, n, d = call.args[0].shape
        cfg = hc.Config(**{f: call.config[f] for f in ("block_m", "block_k", "threads") if f in call.config})
        if n != hc.N_HC or d % cfg.block_k:
            raise Decline(f"hc_pre kernel needs {hc.N_HC} streams and D % {cfg.block_k} == 0 (n={n}, D={d})")
        a = call.attrs
        kw = {"eps": float(a["norm_eps"]), "hc_eps": float(a["hc_eps"]), "iters": int(a["sinkhorn_iters"])}
        splits = _hc_pre_splits(t, d)
        if splits:  # few tokens: D split over CTAs + a finish kernel (pre_split_programs)
            scfg = hc.Config(16, 64, 128)
            rows = bucket_rows(t, scfg.block_m)
            kw.update(splits=splits, finish_rows=16)
            if call.args[0].dtype == torch.float32:  # fp32 streams in, fp32 collapse out: no cast launches
                kw["io"] = "float32"
            return [_key("hyper_connection", p, (rows, d), scfg, **kw)
                    for p in ("pre_partial_program", "pre_finish_program")], rows  # fmt: skip
        rows = bucket_rows(t, cfg.block_m)
        return [_key("hyper_connection", "pre_program", (rows, d), cfg, **kw)], rows

    def keys(self, call: Call) -> list[KernelKey]:
        return self._plan(call)[0]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import hyper_connection as hc

        keys, rows = self._plan(call)
        x, fn, base, scale, prev = call.args
        t, n, d = x.shape
        fn_p = call.prep("hc_fn", 1, lambda: hc.pad_fn(fn.float()).contiguous())
        io = dict(keys[0].kwargs).get("io") == "float32"  # the split pair reading fp32 streams (see _plan)
        xb = pad_rows((x.float() if io else x.to(torch.bfloat16)).reshape(t, n * d), rows)
        outs = (
            torch.empty(rows, d, dtype=torch.float32 if io else torch.bfloat16, device=x.device),
            *(torch.empty(rows, k, device=x.device) for k in (n, n, n * n)),
        )
        base_f, scale_f, prev_p = base.float().contiguous(), scale.float().contiguous(), pad_rows(prev.float(), rows)
        if len(keys) == 2:  # the split form: partial mixes / sums of squares per split, then the finish kernel
            splits = dict(keys[0].kwargs)["splits"]
            pm = torch.empty(splits, rows, hc.MIX_PAD, device=x.device)
            psq = torch.empty(splits, rows, device=x.device)
            kernels[0](xb, fn_p, prev_p, outs[0], pm, psq)
            kernels[1](pm, psq, base_f, scale_f, *outs[1:])
        else:
            kernels[0](xb, fn_p, base_f, scale_f, prev_p, *outs)
        y, pre, post, comb = (o[:t] for o in outs)
        return [y.to(x.dtype), pre, post, comb.reshape(t, n, n)]


class HCStatsAdapter:
    """hc_stats (the model's first sublayer: coefficients without a collapse) through pre_program, which computes
    the same mixes, RMS and Sinkhorn from one read of X; its collapse output (with a zero previous pre) is
    dropped. ~135 small torch launches (20 Sinkhorn iterations) become one kernel."""

    family = "hyper_connection"
    ops = ("hc_stats",)
    pre = HCPreCollapseAdapter()

    def _call(self, call: Call) -> Call:
        x = call.args[0]
        t, n, _ = x.shape
        k = ("hc_zero_pre", t, n, str(x.device))
        if k not in call.cache:
            call.cache[k] = torch.zeros(t, n, device=x.device)
        return Call("hc_pre_collapse", call.attrs, [*call.args, call.cache[k]], [*call.names, "zero_pre"],
                    [*call.is_param, False], call.config, call.cache)  # fmt: skip

    def keys(self, call: Call) -> list[KernelKey]:
        return self.pre.keys(self._call(call))

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        return self.pre.run(self._call(call), kernels)[1:]


class HCPostPreCollapseAdapter:
    """hc_post_pre_collapse (V4.1: a sublayer's mHC post and the next sublayer's single-pass pre): the two
    hyper_connection kernels back to back, post_program (X' = post*y + comb^T X) then pre_program on X' (mixes,
    RMS, Sinkhorn, collapse with the previous pre). One more pass over X' than a fused kernel would make, but
    the Sinkhorn iterations leave torch (the reference launches ~3 small ops per iteration)."""

    family = "hyper_connection"
    ops = ("hc_post_pre_collapse",)
    post = HCPostAdapter()
    pre = HCPreCollapseAdapter()

    def _calls(self, call: Call, xn: torch.Tensor | None = None) -> tuple[Call, Call]:
        y, x, post, comb, fn, base, scale, prev = call.args
        n, p = call.names, call.is_param
        post_call = Call("hc_post", {}, [y, x, post, comb], n[:4], p[:4], {"block_d": 512}, call.cache)
        pre_call = Call("hc_pre_collapse", call.attrs, [x if xn is None else xn, fn, base, scale, prev],
                        [n[1], *n[4:]], [False, *p[4:]], call.config, call.cache)  # fmt: skip
        return post_call, pre_call

    def keys(self, call: Call) -> list[KernelKey]:
        post_call, pre_call = self._calls(call)
        return self.post.keys(post_call) + self.pre.keys(pre_call)

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        post_call, _ = self._calls(call)
        post_call.memo["bf16_out"] = True  # X' as the kernel wrote it: the pre kernel reads it without a round trip
        xn_b = self.post.run(post_call, kernels[:1])[0]
        _, pre_call = self._calls(call, xn_b)
        y, pre, post, comb = self.pre.run(pre_call, kernels[1:])
        dtype = call.args[1].dtype  # the node's (the pre adapter returned the collapse in its bf16 input's dtype)
        return [xn_b.to(dtype), y.to(dtype), pre, post, comb]


class MoERoutingAdapter:
    """moe_gate_route / moe_route with score routing (sqrtsoftplus, bias, normalised): the gate GEMM in torch
    (fp32 logits, as the op), then moe_routing's kernel (k rounds of row max over the E scores, ties to the
    lowest expert id, the reference's rule). Hash routing is a table lookup and stays in torch. The kernel's token
    count is symbolic: one build for every T (the key has no row count; no padding)."""

    family = "moe_routing"
    ops = ("moe_gate_route", "moe_route")

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import moe_routing

        _cuda_only(call)
        a = call.attrs
        fused = call.op == "moe_gate_route"
        bias, tid2eid = (call.args[2], call.args[3]) if fused else (call.args[1], call.args[2])
        if tid2eid is not None or a["scoring"] != "sqrtsoftplus" or not a["normalize"] or bias is None:
            raise Decline("the routing kernel covers score routing (sqrtsoftplus, bias, normalised)")
        e = call.args[1].shape[0] if fused else call.args[0].shape[1]
        cfg = moe_routing.Config(**{f: call.config[f] for f in ("block_m", "threads") if f in call.config})
        threads = cfg.threads
        while threads > 32 and (cfg.block_m * e) % threads:  # the scores must split evenly over the threads
            threads //= 2
        cfg = moe_routing.Config(cfg.block_m, threads)
        return _key("moe_routing", "program", (None, e), cfg, topk=int(a["topk"]), route_scale=float(a["route_scale"]))

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.ir.ops.core import Linear

        self._plan(call)  # the same checks as keys()
        if call.op == "moe_gate_route":
            logits, bias = Linear.reference(call.args[0], call.args[1], None).float(), call.args[2]
        else:
            logits, bias = call.args[0].float(), call.args[1]
        t, k = logits.shape[0], call.attrs["topk"]
        idx = torch.empty(t, k, dtype=torch.int32, device=logits.device)
        w = torch.empty(t, k, device=logits.device)
        if t:  # no launch of an empty grid
            kernels[0](logits.contiguous(), bias.float().contiguous(), idx, w)
        return [w, idx.long()]


# ---------------------------------------------------------------------------------------------- MoE


MOE_LAYOUT_ENV = "DEEPINFER_MOE_LAYOUT"  # "torch": the prefill layout and x gather by the torch references (A/B runs)
# "1": the fp8 prefill's grouped GEMMs run an expert's last tile with <= 64 pairs as a 64-row half tile (issue 8;
# fp8_gemm._program_sm90_ws half_tiles; same bits on every real row). Measured slower (H200 session 8: layer 2's MoE
# part 9.17 vs 7.72 ms; moe_grouped_gemm.py's "Half tiles" says why): off. The program's second version (no wgmma
# under a thread-dependent branch) is not timed yet: kernels_h200 --only "moe halftiles".
MOE_HALF_TILES_ENV = "DEEPINFER_MOE_HALF_TILES"


def _half_tiles_on(persistent_prefill: bool, *cfgs) -> bool:
    """Whether the fp8 prefill takes half tiles: asked for (MOE_HALF_TILES_ENV), on the persistent program, with
    tiles the option supports (128 rows, 2 consumer warpgroups, 2 N slices; fp8_gemm.WSPlan.check)."""
    if os.environ.get(MOE_HALF_TILES_ENV) != "1" or not persistent_prefill:
        return False
    return all(c.block_m == 128 and c.threads == 256 and c.n_split == 2 and not (c.overlap or c.direct_store)
               and c.cluster == 1 for c in cfgs)  # fmt: skip


def _layout_on_triton(t: torch.Tensor) -> bool:
    return _triton_on(t) and os.environ.get(MOE_LAYOUT_ENV) != "torch"


def _moe_layout_rows(idx: torch.Tensor, n_experts: int, block_m: int, read_back: bool = True,
                     half_tiles: bool = False):  # fmt: skip
    """Contiguous layout: (slot of each (token, k) pair, tile experts, padded rows, rows of the tiles that hold
    pairs -- exact where the count is read back, the bound otherwise; the tiles past it are padding --, the
    device's exact tile count [1], the experts' pair counts [E]). read_back=False: the bound at every size, no host
    read (for kernels that skip padding tiles: the persistent program; the bound exceeds the count by at most E
    tiles). Two Triton launches where Triton runs (moe_routing.triton_contiguous_layout), else its torch reference
    (~15 launches: counts, a stable argsort, gathers, searchsorted) -- the same tensors bit for bit.

    The tile count is bucketed (1, 2, 3, 4, 6, 8, 12, ...) so few kernel shapes serve every routing. With few
    pairs (T*k <= E/2: decode) the count is the routing-independent bound min(E, T*k) + T*k // block_m (tight
    there: almost every pair has its own expert), so the layout needs no device -> host synchronisation;
    otherwise the exact count is read back (one synchronisation) to keep padding tiles few. tile_expert is made
    for the bound's bucket (before any read) and cut to the count's. half_tiles: tile_expert flags the last tiles
    holding <= block_m / 2 pairs (the persistent program's half_tiles option; moe_routing)."""
    from deepinfer.codegen.kernels import moe_routing as mr

    pairs = idx.numel()
    bound = mr.layout_tile_bound(pairs, n_experts, block_m)
    make = mr.triton_contiguous_layout if _layout_on_triton(idx) else mr.contiguous_layout_reference
    extra = {"half_tiles": True} if half_tiles else {}
    slot, tile_expert, counts, total = make(idx, n_experts, block_m, _tile_bucket(max(bound, 1)), **extra)
    n_tiles = bound if 2 * pairs <= n_experts or not read_back else int(total)
    n_bucket = _tile_bucket(max(n_tiles, 1))
    return slot, tile_expert[:n_bucket], n_bucket * block_m, n_tiles * block_m, total, counts


def _moe_layout(idx: torch.Tensor, n_experts: int, block_m: int):
    """(slot, tile_expert, padded rows) of _moe_layout_rows."""
    return _moe_layout_rows(idx, n_experts, block_m)[:3]


def _tile_bucket(n: int) -> int:
    p = 1 << max(0, n - 1).bit_length()
    return p * 3 // 4 if n <= p * 3 // 4 and p >= 4 else p


@dataclass
class _MoEPlan:
    """How one moe_grouped_experts call runs its routed experts (decided once per call, memoised)."""

    path: str  # "swab_masked" (decode, swap-AB over the masked layout) | "swab_contiguous" (fp4 prefill)
    #            | "contiguous" (fp8 prefill, the 2-warpgroup grouped main loop; also the fallback)
    fmt: str
    rows: int  # M: rows of the kernels' A / C
    glu: bool  # the w1|w3 kernel writes the clamped SwiGLU as FP8 codes + per-32 scales (fused epilogue)
    half: int  # gate rows per tile of the interleaved w1|w3 stack (glu only)
    keys: list
    layout: tuple  # masked: (dest, slot_expert_meta [2E+1], merged weights); contiguous: (slot, tile_expert, m_rows)
    #                contiguous fp8: + the rows of the tiles that hold pairs (the kernels skip the tiles after them)
    #                and the experts' pair counts [E]
    split: bool = False  # glu from the plain w1|w3 stack (swab_program glu_split): no interleaved copy
    act_group: int = 0  # contiguous fp8: the experts' activation group (x and the SwiGLU output); 0: the block


SWAB_DOWN_ACT_GROUP = 32  # the SwiGLU output is quantised per 32 columns (what the fused epilogue writes)
# Call.cache key: the plan's graph.meta["moe_act_groups"] (passes/convert_fp4_to_fp8.py: {"decode", "prefill",
# "weight_block"}), put there by the runner (moe_act_cache_entries). Absent: the weight block at every bucket.
MOE_ACT_POLICY = "moe_act_groups"
# Call.cache key a runner may set to a dict (benchmarks): each fp8 prefill call records there, under its first expert
# parameter's name, {"pairs", "tile_rows" (rows of tiles holding an expert's pairs), "rows" (the launch's bucket)}
# -- one host read, prefill only
MOE_TILE_STATS = "moe_tile_stats"


def moe_act_cache_entries(meta: dict) -> dict:
    """The Call.cache entries a runner sets from its plan's graph.meta so the MoE adapter quantises the experts'
    activations with the groups the plan was compiled for (empty when the plan records none)."""
    rec = meta.get(MOE_ACT_POLICY)
    return {MOE_ACT_POLICY: dict(rec)} if rec else {}


def moe_act_groups(call: Call) -> tuple[int, int]:
    """(decode, prefill) activation groups of an fp8 moe_grouped_experts call. The plan's record when it names
    this node's weight block -- V4.1's experts converted to 128x128 blocks keep the model's 1x32 activations
    (exact) and take 1x128 at prefill only with the convert pass's prefill_act_group=128 option --, else the
    weight block at both (the experts converted at the model's block, or natively FP8)."""
    block = call.attrs["block"]
    rec = call.cache.get(MOE_ACT_POLICY)
    if rec and rec.get("weight_block") == block and call.attrs["fmt"] == "fp8":
        return int(rec["decode"]), int(rec["prefill"])
    return block, block


def _swab_block(call: Call) -> int:
    """The weight-scale grid the decode (swap-AB) programs read: fp8 weights in blocks coarser than the decode
    activation group (128x128 with 1x32) are read through their scales expanded to the group's grid
    (_expand_block_scales), so the measured decode kernels and their fused SwiGLU tiles run unchanged."""
    if call.attrs["fmt"] != "fp8":
        return call.attrs["block"]
    dec = moe_act_groups(call)[0]
    return dec if call.attrs["block"] % dec == 0 else call.attrs["block"]


def _expand_block_scales(s: torch.Tensor, block: int, fine: int, n: int, k: int) -> torch.Tensor:
    """[E, ceil(n/block), ceil(k/block)] block scales -> [E, ceil(n/fine), ceil(k/fine)], each repeated over the
    fine blocks it covers. Exact: a GEMM reading these computes the same products (the codes of a fine block
    are the coarse block's codes; the promotion multiplies the same scale)."""
    r = block // fine
    return s.repeat_interleave(r, 1)[:, : -(-n // fine)].repeat_interleave(r, 2)[:, :, : -(-k // fine)].contiguous()
# the interleaved w1|w3 copy is made only if it takes at most this share of the free memory and leaves this much
GLU_COPY_HEADROOM = 0.25
GLU_COPY_LEAVE_BYTES = 24 << 30
# Call.cache key (benchmarks): "auto" (the interleaved copy where it fits, else glu_split), "on" / "off" force the
# copy / no copy (then glu_split), "split" always glu_split, "torch" the SwiGLU in torch (no fused epilogue)
GLU_POLICY = "moe_glu_policy"
GLU_POLICY_ENV = "DEEPINFER_MOE_GLU"  # the same values, where the runner sets no policy (checks of the split path)


def masked_layout(idx: torch.Tensor, weights: torch.Tensor, n_experts: int, max_rows: int, consts: dict | None = None,
                  with_meta: bool = False):  # fmt: skip
    """The masked (decode) layout without a device -> host read: expert e's pairs in rows e*max_rows + rank.

    A token that lists one expert twice (hash routing can) would need more than T rows for that expert: such
    pairs are merged into their first occurrence (the weights summed, the duplicate's weight 0, its row the
    first one's), so every count is at most T <= max_rows. Returns (dest [T*K] row of every pair, counts [E]
    int32 -- with_meta: swab_program's slot map slot_expert_meta [2E+1] instead --, merged weights [T, K] fp32).
    A pair's rank among its expert's pairs (in flat pair order), the counts and the slot map come from one Triton
    launch on CUDA (moe_grouped_gemm.masked_rows; its torch formulation, a running count of a one-hot [T*K, E+1]
    table, took ~0.1 ms a layer on the H200 at T=64 in a scan and a sort) -- bit for bit the same. ``consts``: the
    aranges (layout_consts), made once by the caller instead of two launches per call."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    t, k = idx.shape
    c = consts or layout_consts(t, k, n_experts, idx.device)
    idx = idx.long()
    first = (idx.unsqueeze(2) == idx.unsqueeze(1)).int().argmax(-1)  # first slot with the same expert
    keep = first == c["slots"]
    merged = torch.zeros(t, k, device=idx.device).scatter_add_(1, first, weights.float())
    e_kept = torch.where(keep, idx, n_experts).reshape(-1)  # a merged duplicate goes to the spare expert E
    on_triton = _triton_on(e_kept)
    rows, meta = (mg.masked_rows if on_triton else mg.masked_rows_reference)(e_kept, n_experts, max_rows)
    dest = torch.gather(rows.view(t, k), 1, first)  # a merged duplicate reads (and writes the same data to) its 1st row
    return dest.reshape(-1), meta if with_meta else meta[:n_experts], merged


def layout_consts(t: int, k: int, n_experts: int, device) -> dict:
    """The masked layout's constant index tensors: slot ids [K], expert ids [E+1], the token of every pair [T*K]."""
    return {"slots": torch.arange(k, device=device), "experts": torch.arange(n_experts + 1, device=device),
            "tok": torch.arange(t, device=device).repeat_interleave(k)}  # fmt: skip


def _layout_consts(call: Call, t: int, k: int, e: int, device) -> dict:
    key = ("moe_layout_consts", t, k, e, str(device))
    if key not in call.cache:
        call.cache[key] = layout_consts(t, k, e, device)
    return call.cache[key]


# Call.cache key a runner may set to a list (benchmarks): the fp8 prefill path appends (stage, event) after each of
# its stages (runtime/cuda_executor.mark: a CUDA event, or the clock on CPU), so its time splits by stage
MOE_STAGES = "moe_stages"


def _stage(call: Call, name: str) -> None:
    marks = call.cache.get(MOE_STAGES)
    if marks is not None:
        from deepinfer.runtime.cuda_executor import mark

        marks.append((name, mark()))


def _layout_x(call: Call, slot: torch.Tensor, counts: torch.Tensor, group: int, rows: int, block_m: int):
    """x [T, D] quantised per `group` columns (quant_rows' codes and scales) into the contiguous layout: (e4m3 codes
    [rows, D], MN-major fp32 scales [D/group, rows]); pair t*K + j's row slot[t*K + j] holds token t, the rows that
    pad each expert's last tile zero codes with the floor's scale; rows past the experts' tiles are not written
    where Triton runs (the GEMMs skip tiles of expert -1). One Triton launch (moe_routing.triton_gather_quant: x read
    once, no [T, D] codes, index map or gathers in between), else its torch reference. Where the shared expert
    quantises x per the same group, the launch also writes the un-permuted codes as _quant_x's (one quantisation)."""
    from deepinfer.codegen.kernels import moe_routing as mr

    x = call.args[0]
    memo_key = ("x_quant", group)
    with_x = call.args[3] is not None and call.attrs.get("shared_block") == group and memo_key not in call.memo
    with_x = with_x and _shared_rows(x.shape[0]) == x.shape[0]  # decode pads _quant_x's rows to the token tile
    if _layout_on_triton(x):
        xc = x if x.stride(-1) == 1 else x.contiguous()
        a, sa, xq = mr.triton_gather_quant(xc, slot, counts, group, rows, block_m, with_x=with_x)
    else:
        a, sa, xq = mr.gather_quant_reference(x, slot, counts, group, rows, block_m, with_x=with_x)
    if xq is not None:
        call.memo[memo_key] = (_as_e4m3(xq[0]), xq[1])
    return _as_e4m3(a), sa


def _as_e4m3(q: torch.Tensor) -> torch.Tensor:
    """Codes as e4m3 (the CPU interpreter's kernels store their values as fp32: the cast is exact)."""
    return q if q.dtype == torch.float8_e4m3fn else q.to(torch.float8_e4m3fn)


def _combine(c: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor, base: torch.Tensor | None = None):
    """The prefill un-permute y[t] = base[t] + sum_j weights[t, j] c[slot[t K + j]] in fp32 (base: the shared expert's
    output, or None): one Triton launch where Triton runs (moe_grouped_gemm.combine_rows), else its torch
    formulation."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    if base is not None:  # read in its own dtype (the kernel adds it in fp32): no fp32 copy of the bf16 [T, D]
        base = base.contiguous()
    return (mg.combine_rows if _triton_on(c) else mg.combine_rows_reference)(c, slot, weights, base)


def swiglu_quant_rows(c: torch.Tensor, limit: float, group: int, rows: int | None = None,
                      tiles: torch.Tensor | None = None):  # fmt: skip
    """The clamped SwiGLU of a w1|w3 GEMM output c [M, 2I] (gate columns, then up) quantised per `group` columns:
    (e4m3 codes [rows, I], MN-major fp32 scales [I/group, rows]; rows >= M, default M; the rows past M are left
    unwritten by the kernel -- zero in the torch path) -- what the prefill w2 GEMM reads. One Triton launch
    (act_quant.triton_swiglu_quant) where Triton runs (_triton_on), else torch's SwiGLU in fp32 (ir/ops/moe.py
    swiglu) and quant_rows (the same scales; a code may differ by one E4M3 step where silu's last ulp differs).
    tiles: the half-tile TileExpert of 128-row tiles (the kernel then skips the rows the GEMMs skip)."""
    from deepinfer.ir.ops.moe import swiglu

    rows = c.shape[0] if rows is None else rows
    if _triton_on(c) and os.environ.get(ACT_QUANT_ENV) != "torch":
        from deepinfer.codegen.kernels import act_quant

        q, s = act_quant.triton_swiglu_quant(c if c.stride(1) == 1 else c.contiguous(), limit, group, rows=rows,
                                             tiles=tiles, block_m=rows // tiles.numel() if tiles is not None else 128)
        return (q if q.dtype == torch.float8_e4m3fn else q.to(torch.float8_e4m3fn)), s
    inter = c.shape[1] // 2
    return quant_rows(swiglu(c[:, :inter], c[:, inter:], limit), group, rows)


def _scatter_rows(rows: int, src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """[rows, ...] with src[i] at row dest[i]; other rows are left unwritten (the kernels never read them
    into a real row's result). FP8 rows move as bytes."""
    out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=src.device)
    if src.dtype == torch.float8_e4m3fn:
        out.view(torch.uint8)[dest] = src.view(torch.uint8)
    else:
        out[dest] = src
    return out


def _scatter_cols(cols: int, src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """MN-major scales: [G, cols] with src[i] (a row of G scales) in column dest[i]."""
    out = torch.empty((src.shape[1], cols), dtype=src.dtype, device=src.device)
    out[:, dest] = src.T
    return out


def _swab_unfit(n: int, k: int, fmt: str, cfg, wb: int, ag: int, glu: bool) -> str | None:
    """Why the swap-AB program cannot take an [N, K] expert GEMM with this tile (its asserts), or None."""
    if k % cfg.block_k or cfg.block_k % 32 or cfg.block_k % ag:
        return f"K={k} does not tile by block_k {cfg.block_k} (act group {ag})"
    if n % cfg.block_n or cfg.block_n % 64:
        return f"N={n} does not tile by block_n {cfg.block_n}"
    if fmt == "fp8" and (wb % 32 or (cfg.block_n % wb and wb % cfg.block_n)):
        return f"weight block {wb} does not align with block_n {cfg.block_n}"
    if glu and ((cfg.block_n // 2) % 32 or (fmt == "fp8" and (cfg.block_n // 2) % wb)):
        return f"the fused SwiGLU needs {cfg.block_n // 2}-row gate/up tiles aligned to the weight block {wb}"
    return None


def _split_glu_unfit(inter: int, fmt: str, cfg, wb: int) -> str | None:
    """Why swab_program(glu_split=True) cannot take I = inter with this tile (its asserts), or None."""
    if inter % cfg.block_n or cfg.block_n % 32:
        return f"I={inter} does not split into {cfg.block_n}-row gate/up tiles"
    if fmt == "fp8" and cfg.block_n % wb and wb % cfg.block_n:
        return f"weight block {wb} does not align with block_n {cfg.block_n}"
    return None


def _swab_decode_cfg(call: Call, t: int, k: int, e: int, fmt: str, dims: tuple):
    """The binding's swap-AB config when it has one, else moe_grouped_gemm.swab_config for the expected busiest
    expert (mean + 3 sigma of T*K/E pairs per expert: a config choice, not a bound); block_k narrowed when the
    expert dims do not tile by it."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    fields = {f: call.config[f] for f in ("block_n", "block_t", "block_k", "stages", "min_blocks") if f in call.config}
    if "block_t" in fields:
        cfg = mg.SwabConfig(**fields)
    else:
        mean = t * k / max(e, 1)
        cfg = mg.swab_config(min(t, math.ceil(mean + 3 * math.sqrt(mean) + 1)), fmt)
    for bk in (cfg.block_k, 128, 64):
        if all(kk % bk == 0 for kk in dims):
            cfg = mg.SwabConfig(cfg.block_n, cfg.block_t, bk, cfg.stages, cfg.min_blocks)
            break
    opts = swab_decode_opts() if fmt == "fp8" else {"narrow"}
    # fp8: wide TMA tiles (swab_config's decode default) wherever block_k holds whole 128-byte rows
    wide = call.config.get("wide_tma", "narrow" not in opts) and cfg.block_k % 128 == 0
    return dataclasses.replace(cfg, wide_tma=bool(wide), stage_scales="staged" in opts)


# swap-AB decode program options (fp8) for A/B runs of the real graph: a comma list of "narrow" (wide_tma off: the
# 32-byte TMA boxes of before), "staged" (stage_scales), "persistent" (SMs x CTAs per SM walk the items); "wide" is
# the default (accepted, no effect)
SWAB_DECODE_ENV = "DEEPINFER_SWAB_DECODE"


def swab_decode_opts() -> set:
    opts = {o.strip() for o in os.environ.get(SWAB_DECODE_ENV, "").split(",") if o.strip()}
    unknown = opts - {"wide", "narrow", "staged", "persistent"}
    if unknown:
        raise ValueError(f"{SWAB_DECODE_ENV}: unknown option(s) {sorted(unknown)} (narrow, staged, persistent)")
    return opts


class MoEGroupedAdapter:
    """moe_grouped_experts (fmt fp8 or fp4): the routed experts as two grouped GEMMs (w1|w3, then w2), the
    shared expert through the dense FP8 GEMM.

    Decode (the node's layout "masked", or "auto" with T <= masked_max_t): the swap-AB program
    (moe_grouped_gemm.swab_program) over the masked layout, built without a host read (max_rows = T rounded to
    the token tile: an expert sees each token at most once), so a decode step can be captured. Where the tiles
    allow it the w1|w3 GEMM ends in the fused clamped-SwiGLU epilogue (FP8 codes + per-32 scales, read directly
    by the w2 GEMM); its interleaved w1|w3 copy is made only while memory allows (the per-expert parameters must
    stay the plain stacks: the references read them), else the epilogue reads the plain stack (glu_split: two
    weight tiles per CTA, no copy); the SwiGLU runs in torch on the T*K real rows only where neither fits.
    fmt "fp4" (V4.1's routed experts kept FP4, the convert pass off) runs W4A8 (FP4 dequantised in registers):
    masked at decode, the contiguous swap-AB program at prefill. fp8 prefill: fp8_gemm's persistent program on the
    contiguous layout (the layout two launches, x quantised straight into its rows, the SwiGLU + quant and the
    un-permute one launch each; the binding's loop where the dims do not tile by 256 x 128). Activation groups: the
    plan's record (moe_act_groups) -- V4.1's experts converted to 128x128 blocks keep 1x32 at decode (read on the
    32-grid) and at prefill, or take 1x128 at prefill with the convert pass's prefill_act_group=128 option.
    The experts' weights are stacked once ([E, 2I, K] and [E, D, I]); the runner rebinds the per-expert
    parameters to views of the stack, so the memory is not doubled."""

    family = "moe_grouped_gemm"
    ops = ("moe_grouped_experts",)
    dense = LinearFP8Adapter()

    # -- which path --------------------------------------------------------------------------------------
    def _shapes(self, call: Call):
        a = call.attrs
        if a["fmt"] not in ("fp8", "fp4"):
            raise Decline(f"{a['fmt']} experts: the grouped GEMMs take FP8 or FP4 experts")
        x, idx = call.args[0], call.args[2]
        w1 = call.args[9]
        inter, d = w1.shape[0], w1.shape[1] * (2 if a["fmt"] == "fp4" else 1)
        return x.shape[0], d, inter, a["n_experts"], a["block"], idx

    @staticmethod
    def _decode(call: Call, t: int) -> bool:
        a = call.attrs
        return a.get("layout") == "masked" or (a.get("layout") == "auto" and t <= a.get("masked_max_t", 64))

    def _plan(self, call: Call) -> _MoEPlan:
        if "moe_plan" not in call.memo:
            call.memo["moe_plan"] = self._make_plan(call)
        return call.memo["moe_plan"]

    def _make_plan(self, call: Call) -> _MoEPlan:
        t, d, inter, e, block, idx = self._shapes(call)
        fmt = call.attrs["fmt"]
        why = "prefill"
        if self._decode(call, t):
            cfg = _swab_decode_cfg(call, t, idx.shape[1], e, fmt, (d, inter))
            why = self._swab_unfit(call, cfg, d, inter, fmt, _swab_block(call))
            if why is None:
                return self._swab_plan(call, cfg, t, d, inter, e, _swab_block(call), idx, masked=True)
        if fmt == "fp4":
            from deepinfer.codegen.kernels import moe_grouped_gemm as mg

            cfg = mg.swab_config(0, fmt, contiguous=True)
            unfit = self._swab_unfit(call, cfg, d, inter, fmt, block)
            if unfit is not None:
                raise Decline(f"fp4 experts ({why}): {unfit}")
            return self._swab_plan(call, cfg, t, d, inter, e, block, idx, masked=False)
        return self._contiguous_plan(call, t, d, inter, e, block, idx)

    @staticmethod
    def _swab_unfit(call, cfg, d, inter, fmt, block) -> str | None:
        ag = 32 if fmt == "fp4" else block
        return _swab_unfit(2 * inter, d, fmt, cfg, block, ag, False) or _swab_unfit(
            d, inter, fmt, cfg, block, SWAB_DOWN_ACT_GROUP, False
        )

    def _swab_plan(self, call, cfg, t, d, inter, e, block, idx, masked: bool) -> _MoEPlan:
        fmt = call.attrs["fmt"]
        ag = 32 if fmt == "fp4" else block
        limit = float(call.attrs["swiglu_limit"])
        mode = self._glu_mode(call, cfg, fmt, inter, d, block, ag)
        glu, split = mode != "", mode == "split"
        # glu_split reads two weight tiles per CTA: half the CTAs per SM keep the same weight bytes in flight
        cfg1 = dataclasses.replace(cfg, min_blocks=max(1, cfg.min_blocks // 2)) if split else cfg
        if masked:
            max_rows = -(-t // cfg.block_t) * cfg.block_t
            rows = e * max_rows
            pairs = t * idx.shape[1]
            # Meta = slot_expert_meta: each CTA finds its expert with one load, not a scan of the E counts; at most
            # T*K experts have tokens, so fewer pairs than experts trim the grid to T*K slots (keyed on T only)
            layout = masked_layout(idx, call.args[1], e, max_rows, _layout_consts(call, t, idx.shape[1], e, idx.device),
                                   with_meta=True)  # fmt: skip
            extra = {"max_rows": max_rows, "slot_map": True, "slots": pairs if pairs < e else 0}
            if fmt == "fp8" and "persistent" in swab_decode_opts():  # each kernel: SMs x its CTAs per SM
                sms = torch.cuda.get_device_properties(idx.device).multi_processor_count if idx.is_cuda else 132
                cfg1 = dataclasses.replace(cfg1, persistent=sms * cfg1.min_blocks)
                cfg = dataclasses.replace(cfg, persistent=sms * cfg.min_blocks)
        else:
            slot, tile_expert, rows = _moe_layout(idx, e, cfg.block_t)
            layout, extra = (slot, tile_expert, rows), {}
        common = {"fmt": fmt, "weight_block": block, **extra}
        common1 = {**common, "glu_split": True} if split else common
        k1 = _key("moe_grouped_gemm", "swab_program", (rows, 2 * inter, d, e), cfg1, act_group=ag,
                  swiglu_limit=limit if glu else None, **common1)  # fmt: skip
        k2 = _key("moe_grouped_gemm", "swab_program", (rows, d, inter, e), cfg, act_group=SWAB_DOWN_ACT_GROUP,
                  swiglu_limit=None, **common)  # fmt: skip
        path = "swab_masked" if masked else "swab_contiguous"
        return _MoEPlan(path, fmt, rows, glu, cfg.block_n // 2, [k1, k2], layout, split)

    def _glu_mode(self, call: Call, cfg, fmt: str, inter: int, d: int, block: int, ag: int) -> str:
        """How the w1|w3 GEMM ends: "tiles" (fused SwiGLU on the tile-interleaved copy, where it fits), "split"
        (fused SwiGLU on the plain stack, two weight tiles per CTA: no copy), "" (bf16 out, SwiGLU in torch)."""
        policy = call.cache.get(GLU_POLICY) or os.environ.get(GLU_POLICY_ENV, "auto")
        if policy == "torch":
            return ""
        tiles_fit = _swab_unfit(2 * inter, d, fmt, cfg, block, ag, True) is None
        if policy != "split" and tiles_fit and self._glu_copy_ok(call, fmt, inter, d):
            return "tiles"
        return "split" if _split_glu_unfit(inter, fmt, cfg, block) is None else ""

    def _glu_copy_ok(self, call: Call, fmt: str, inter: int, d: int) -> bool:
        """The fused epilogue reads w1|w3 interleaved in tiles (a copy of the stack): only while it fits."""
        k = ("moe_glu_ok", call.names[9])
        if k not in call.cache:
            policy = call.cache.get(GLU_POLICY) or os.environ.get(GLU_POLICY_ENV, "auto")
            x = call.args[0]
            nbytes = call.attrs["n_experts"] * 2 * inter * d // (2 if fmt == "fp4" else 1)
            free = torch.cuda.mem_get_info(x.device)[0] if x.device.type == "cuda" else float("inf")
            fits = nbytes <= GLU_COPY_HEADROOM * free and free - nbytes >= GLU_COPY_LEAVE_BYTES
            call.cache[k] = policy == "on" or (policy == "auto" and fits)
        return call.cache[k]

    def _contiguous_plan(self, call, t, d, inter, e, block, idx) -> _MoEPlan:
        """fp8 prefill: both GEMMs on the contiguous layout, activations (x and the SwiGLU output) per the
        prefill group (moe_act_groups: the model's, or 128 with the plan's g128 option)."""
        ag = moe_act_groups(call)[1]
        cfg13, cfg2 = self._prefill_cfg(call, 2 * inter, d, ag), self._prefill_cfg(call, d, inter, ag)
        # no host read of the tile count on the persistent program (it skips the padding tiles: the bound costs
        # no MMA; the host read would idle the GPU while this call's launches are issued)
        # nor at decode sizes (a model whose experts the swap-AB program declines): a CUDA graph captures those steps
        persistent = cfg13.persistent and cfg2.persistent
        decode = t <= call.attrs.get("masked_max_t", 64)
        half = _half_tiles_on(persistent and not decode, cfg13, cfg2)
        slot, tile_expert, rows, real, n_tiles, counts = _moe_layout_rows(idx, e, cfg13.block_m,
                                                                          read_back=not (persistent or decode),
                                                                          half_tiles=half)  # fmt: skip
        stats = call.cache.get(MOE_TILE_STATS)
        if stats is not None:  # the exact count stays on the device until the runner reads it (bench_slice)
            stats[call.names[9]] = {"pairs": idx.numel(), "tile_rows": n_tiles * cfg13.block_m, "rows": rows}
        extra = {"half_tiles": True} if half else {}  # (absent when off: the default kernels' keys unchanged)
        k1 = _key("moe_grouped_gemm", "program", (rows, 2 * inter, d, e), cfg13, act_group=ag, weight_block=block,
                  **extra)  # fmt: skip
        k2 = _key("moe_grouped_gemm", "program", (rows, d, inter, e), cfg2, act_group=ag, weight_block=block, **extra)
        layout = (slot, tile_expert, rows, real, counts)
        return _MoEPlan("contiguous", "fp8", rows, False, 0, [k1, k2], layout, act_group=ag)

    tuned = True  # prefill: the measured sm90 persistent program where the dims tile by it (tests may turn it off)

    def _prefill_cfg(self, call: Call, n: int, k: int, ag: int):
        """One prefill GEMM's config: fp8_gemm's persistent warp-specialised program (moe_grouped_gemm.sm90_config
        with k_group = ag; H200: 40% of the FP8 peak with 1x32 groups, 65-69% with 1x128 -- BENCHMARKS.md
        sessions 3-4) where [N, K] tiles by 256 x 128, else the binding's config (_cfg). 128-row tiles either way
        (the layout pads every expert to them)."""
        from deepinfer.codegen.kernels import moe_grouped_gemm

        group = min(ag, call.attrs["block"])
        if self.tuned and n % 256 == 0 and k % 128 == 0 and 128 % group == 0:
            return moe_grouped_gemm.sm90_config(0, n, k_group=ag)
        cfg = self._cfg(call, group)
        if n % cfg.block_n or k % cfg.block_k:
            raise Decline(f"expert dims D={call.args[0].shape[1]}, I={call.args[9].shape[0]} do not tile by "
                          f"{cfg.block_n}x{cfg.block_k}")  # fmt: skip
        return cfg

    def _cfg(self, call: Call, group: int):
        """The binding's config, else the sm90 grouped main loop (moe_grouped_gemm.sm90_config: fp8_gemm's
        2-warpgroup overlapped loop); the portable plain loop where the expert dims do not tile by it. group: the
        finer of the activation group and the weight block (the promotion step)."""
        from deepinfer.codegen.kernels import fp8_gemm, moe_grouped_gemm

        fields = {f: call.config[f] for f in vars(fp8_gemm.Config()) if f in call.config}
        cfg = fp8_gemm.Config(**fields) if fields else moe_grouped_gemm.sm90_config(0, 0)
        block = call.attrs["block"]
        w1 = call.args[9]
        inter, d = w1.shape if w1 is not None and w1.dim() == 2 else (0, 0)
        sm90_loop = moe_grouped_gemm._is_sm90_cfg(cfg)
        fits = (
            cfg.block_m == 128
            and cfg.n_split == 1
            and not cfg.persistent
            and all(n % cfg.block_n == 0 and n % block == 0 for n in (2 * inter, d))
            and all(k % cfg.block_k == 0 for k in (d, inter))
            and (cfg.block_k % group == 0 if sm90_loop else group % cfg.block_k == 0)
        )
        return cfg if fits else fp8_gemm.default_config(group)

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        return self._plan(call).keys + self._shared_keys(call)

    def path(self, call: Call) -> str:
        """Which routed path this call takes (tests and reports); "[act128]": activations per 1x128 where the
        experts' block is coarser than the model's group (the plan's g128 prefill option)."""
        p = self._plan(call)
        act = f"[act{p.act_group}]" if p.act_group and p.act_group != moe_act_groups(call)[0] else ""
        return p.path + ("+swiglu" if p.glu else "") + ("(split)" if p.split else "") + act

    # -- running -----------------------------------------------------------------------------------------
    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        _stage(call, "start")
        p = self._plan(call)
        _stage(call, "layout (plan)")
        x = call.args[0]
        if p.path == "contiguous":  # fp8 prefill: the shared expert is added inside the un-permute launch
            shared = (lambda: self._shared(call, kernels[2:])) if call.args[3] is not None else None
            return [self._run_contiguous_fp8(call, p, kernels[:2], shared).to(x.dtype)]
        y = self._run_swab(call, p, kernels[:2])
        if call.args[3] is not None:
            y = y + self._shared(call, kernels[2:])
        return [y.to(x.dtype)]

    def _run_swab(self, call: Call, p: _MoEPlan, kernels: list) -> torch.Tensor:
        from deepinfer.ir.ops.moe import swiglu

        t, d, inter, e, block, idx = self._shapes(call)
        x, k = call.args[0], idx.shape[1]
        w13, s13, w2, s2 = self._swab_weights(call, p, e)
        if p.path == "swab_masked":
            dest, meta, w = p.layout
            a, sa_t = _quant_x(call, 32 if p.fmt == "fp4" else _swab_block(call))  # [R >= T, K] codes, [K/g, R]
            tok = _layout_consts(call, t, k, e, x.device)["tok"]
            a_m = _scatter_rows(p.rows, a[tok], dest)
            sa_m = torch.empty(sa_t.shape[0], p.rows, device=x.device)
            sa_m[:, dest] = sa_t[:, tok]
        else:
            dest, meta, _ = p.layout
            w = call.args[1].float()
            a_rows = torch.zeros(p.rows, d, device=x.device, dtype=torch.float32)
            a_rows[dest] = x.float().repeat_interleave(k, 0)
            a_m, sa_rows = quant_act(a_rows, 32 if p.fmt == "fp4" else _swab_block(call))
            sa_m = sa_rows.T.contiguous()
        if p.glu:
            hq = torch.empty(p.rows, inter, dtype=torch.float8_e4m3fn, device=x.device)
            hs = torch.empty(inter // 32, p.rows, dtype=torch.float32, device=x.device)
            kernels[0](a_m, sa_m, w13, s13, meta, hq, hs)
        else:
            c1 = torch.empty(p.rows, 2 * inter, dtype=torch.bfloat16, device=x.device)
            kernels[0](a_m, sa_m, w13, s13, meta, c1)
            h13 = c1[dest].float()  # only the T*K real rows go through the torch SwiGLU
            q, s = quant_act(swiglu(h13[:, :inter], h13[:, inter:], call.attrs["swiglu_limit"]), SWAB_DOWN_ACT_GROUP)
            hq, hs = _scatter_rows(p.rows, q, dest), _scatter_cols(p.rows, s, dest)
        c2 = torch.empty(p.rows, d, dtype=torch.bfloat16, device=x.device)
        kernels[1](hq, hs, w2, s2, meta, c2)
        return (c2[dest].float().view(t, k, d) * w.unsqueeze(-1)).sum(1)

    def _swab_weights(self, call: Call, p: _MoEPlan, e: int):
        """The swap-AB operands, once per layer: fp8 stacks with fp32 block scales, or (W4A8) the packed FP4
        codes as int16 words with MN-major ue8m0 bytes; w1|w3 tile-interleaved for the fused epilogue (not with
        glu_split: the plain stack)."""
        from deepinfer.codegen.kernels import moe_grouped_gemm as mg

        params = tuple(range(9, len(call.args)))
        if p.fmt == "fp8":
            b13, s13, b2, s2 = call.prep("moe_stack", params, lambda: stack_experts(call, e))
            block, wb = call.attrs["block"], _swab_block(call)
            if wb != block:  # 128x128 weights read on the decode group's grid (_swab_block)
                d, inter = call.args[0].shape[1], b2.shape[2]
                s13, s2 = call.prep(f"moe_scales{wb}", params, lambda: (_expand_block_scales(
                    s13, block, wb, 2 * inter, d), _expand_block_scales(s2, block, wb, d, inter)))  # fmt: skip
            if p.glu and not p.split:
                b13, s13 = call.prep(f"moe_glu{p.half}_{wb}", params, lambda: (
                    mg.gate_up_tiles(b13, p.half), mg.gate_up_tiles(s13, p.half // wb)))  # fmt: skip
            return b13, s13, b2, s2

        def fp4_operands():
            b13, s13, b2, s2 = stack_experts(call, e, scales_as=scale_bytes)
            if p.glu and not p.split:
                b13, s13 = mg.gate_up_tiles(b13, p.half), mg.gate_up_tiles(s13, p.half)
            return (*mg.w4a8_weights(b13, s13), *mg.w4a8_weights(b2, s2))

        return call.prep(f"moe_w4a8_{p.half if p.glu and not p.split else 0}", params, fp4_operands)

    def _run_contiguous_fp8(self, call: Call, p: _MoEPlan, kernels: list, shared: Callable | None = None):
        """The routed experts on the contiguous layout; shared(): the shared expert's output, issued right after the
        w1|w3 launch so that its host work (its GEMM plans and quantisations) runs while that GEMM does (issued
        first, the GPU idled between its small launches: H200 EP8 stage split, session 6), then added to the
        un-permute's sums."""
        t, d, inter, e, block, idx = self._shapes(call)
        x, weights = call.args[0], call.args[1]
        slot, tile_expert, m_rows, real, counts = p.layout
        b13, s13, b2, s2 = call.prep("moe_stack", tuple(range(9, len(call.args))), lambda: stack_experts(call, e))
        ag = p.act_group or block
        a, sa = _layout_x(call, slot, counts, ag, m_rows, m_rows // tile_expert.numel())  # block_m: rows per tile
        _stage(call, "x quant + gather")
        c1 = torch.empty(m_rows, 2 * inter, dtype=torch.bfloat16, device=x.device)
        kernels[0](a, sa, b13, s13, tile_expert, c1)
        _stage(call, "w1|w3 GEMM")
        base = shared() if shared is not None else None
        _stage(call, "shared expert")
        half = dict(p.keys[0].kwargs).get("half_tiles", False)  # then the rows the GEMMs skip are skipped here too
        hq, hs = swiglu_quant_rows(c1[:real], call.attrs["swiglu_limit"], ag, rows=m_rows,
                                   tiles=tile_expert if half else None)  # fmt: skip
        _stage(call, "SwiGLU + quant")
        c2 = torch.empty(m_rows, d, dtype=torch.bfloat16, device=x.device)
        kernels[1](hq, hs, b2, s2, tile_expert, c2)
        _stage(call, "w2 GEMM")
        y = _combine(c2, slot, weights, base)
        _stage(call, "un-permute (+ shared)")
        return y

    # -- the shared expert ---------------------------------------------------------------------------------
    # Decode: one more swap-AB pair, the shared expert as a 1-expert stack with all T rows (fused clamped SwiGLU
    # + per-32 quant, then w2), reusing the routed path's quantised x: 2 launches instead of 3 dense GEMMs with
    # their own activation quantisation and a torch SwiGLU (~40 small launches). Prefill, or dims / groups the
    # swap-AB program does not take: the dense fp8_gemm path.

    def _shared_swab(self, call: Call):
        """(config, max_rows) of the shared expert's swap-AB pair, or None (then the dense path)."""
        if "shared_swab" not in call.memo:
            call.memo["shared_swab"] = self._make_shared_swab(call)
        return call.memo["shared_swab"]

    def _make_shared_swab(self, call: Call):
        from deepinfer.codegen.kernels import moe_grouped_gemm as mg

        a = call.attrs
        x, sw1 = call.args[0], call.args[3]
        t, d = x.shape
        inter, wb = sw1.shape[0], a["shared_block"]
        if t > SHARED_SWAB_MAX_T or a["shared_mid_group"] not in (0, SWAB_DOWN_ACT_GROUP) or wb % 32:
            return None
        bt = _shared_rows(t)  # 16, 32 or 64 tokens per tile: one pass over the weights at T <= 64
        cfg = mg.SwabConfig(64, bt, 128, 4, 4 if bt == 16 else 3 if bt == 32 else 2)
        if _swab_unfit(2 * inter, d, "fp8", cfg, wb, wb, True) or _swab_unfit(d, inter, "fp8", cfg, wb, 32, False):
            return None
        return cfg, bt

    def _shared_keys(self, call: Call) -> list[KernelKey]:
        if call.args[3] is None:
            return []
        sw = self._shared_swab(call)
        if sw is not None:
            cfg, rows = sw
            a = call.attrs
            d, inter = call.args[0].shape[1], call.args[3].shape[0]
            common = {"fmt": "fp8", "weight_block": a["shared_block"], "max_rows": rows}
            return [_key("moe_grouped_gemm", "swab_program", (rows, 2 * inter, d, 1), cfg,
                         act_group=a["shared_block"], swiglu_limit=float(a["shared_limit"]), **common),
                    _key("moe_grouped_gemm", "swab_program", (rows, d, inter, 1), cfg, act_group=SWAB_DOWN_ACT_GROUP,
                         swiglu_limit=None, **common)]  # fmt: skip
        return [plan[0] for plan in self._shared_dense_plans(call)]

    def _shared_dense_plans(self, call: Call) -> tuple:
        """_gemm_plan's (key, rows, n_pad) of the dense shared expert's two GEMMs, once per call: x [T, D] @ [w1; w3]^T
        (x per shared_block) and h [T, I] @ w2^T (h per the mid group)."""
        if "shared_dense" not in call.memo:
            call.memo["shared_dense"] = self._make_shared_dense_plans(call)
        return call.memo["shared_dense"]

    def _make_shared_dense_plans(self, call: Call) -> tuple:
        a = call.attrs
        x, w1 = call.args[0], call.args[3]
        (inter, d), block = w1.shape, a["shared_block"]
        if call.args[6] is None:
            raise Decline("shared expert weights without FP8 scales: the dense path runs FP8 GEMMs")
        if inter % block:  # the stacked scales would put a w1 row and a w3 row under one block scale
            raise Decline(f"shared expert I={inter} is not a multiple of its weight block {block} (w1 and w3 stacked)")
        h = torch.empty((x.shape[0], inter), device="meta")  # the down GEMM's A: the SwiGLU output (only its shape)
        group = a["shared_mid_group"] or block
        gate_up = _gemm_plan(self._shared_gate_up_call(call), x, 2 * inter, block, block, self.dense.tuned)
        return gate_up, _gemm_plan(self._shared_down_call(call), h, d, group, block, self.dense.tuned)

    def _shared_linear(self, call: Call, w, s, names: list, is_param: bool) -> Call:
        """A linear_fp8 call on the shared expert's weights w, s (the call's x as its input; the GEMMs here are given
        their activation groups explicitly)."""
        attrs = {"block": call.attrs["shared_block"], "act_group": 0}
        return Call("linear_fp8", attrs, [call.args[0], w, s], [call.names[0], *names], [False, is_param, is_param],
                    call.config, call.cache)  # fmt: skip

    def _shared_gate_up_call(self, call: Call, stacked: tuple | None = None) -> Call:
        """linear_fp8 over [w1; w3] ([2I, D] with the block scales stacked alike: output columns gate, then up, as
        swiglu_quant_rows reads them); stacked None: a meta stand-in of that shape (plans only)."""
        w1 = call.args[3]
        if stacked is None:
            stacked = (torch.empty((2 * w1.shape[0], w1.shape[1]), dtype=w1.dtype, device="meta"), None)
        names = [f"{call.names[3]}|{call.names[4]}", f"{call.names[6]}|{call.names[7]}"]
        return self._shared_linear(call, *stacked, names, all(call.is_param[i] for i in (3, 4, 6, 7)))

    def _shared_down_call(self, call: Call) -> Call:
        return self._shared_linear(call, call.args[5], call.args[8], [call.names[5], call.names[8]],
                                   call.is_param[5] and call.is_param[8])  # fmt: skip

    def _shared(self, call: Call, kernels: list) -> torch.Tensor:
        if self._shared_swab(call) is not None:
            return self._shared_by_swab(call, kernels)
        return self._shared_dense(call, kernels)

    def _shared_by_swab(self, call: Call, kernels: list) -> torch.Tensor:
        from deepinfer.codegen.kernels import moe_grouped_gemm as mg

        cfg, rows = self._shared_swab(call)
        a = call.attrs
        x = call.args[0]
        t, d = x.shape
        inter = call.args[3].shape[0]

        def stack():  # [1, 2I, D] w1|w3 tile-interleaved for the fused epilogue (a 2I x D copy), w2 as [1, D, I]
            half, wb = cfg.block_n // 2, a["shared_block"]
            b13, s13 = (x.unsqueeze(0) for x in _stack_gate_up(call))
            w2, s2 = call.args[5].unsqueeze(0), scales_f32(call.args[8]).unsqueeze(0).contiguous()
            return mg.gate_up_tiles(b13, half), mg.gate_up_tiles(s13, half // wb), w2, s2

        w13, s13, w2, s2 = call.prep(f"moe_shared_swab{cfg.block_n}", (3, 4, 5, 6, 7, 8), stack)
        a_m, sa_m = _quant_x(call, a["shared_block"])  # rows = the token tile (>= T): as the quantiser padded them
        assert a_m.shape[0] == rows, (a_m.shape, rows)
        counts = _const_counts(call, 1, t, x.device)
        hq = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=x.device)
        hs = torch.empty(inter // SWAB_DOWN_ACT_GROUP, rows, device=x.device)
        kernels[0](a_m, sa_m, w13, s13, counts, hq, hs)
        c = torch.empty(rows, d, dtype=torch.bfloat16, device=x.device)
        kernels[1](hq, hs, w2, s2, counts, c)
        return c[:t].float()

    def _shared_dense(self, call: Call, kernels: list) -> torch.Tensor:
        """The shared expert on dense GEMMs (prefill; decode where the swap-AB pair does not fit, e.g. V4's 128
        groups): ONE GEMM over [w1; w3], the clamped SwiGLU quantised per the mid group, the w2 GEMM. On fp8_gemm
        (prefill) x is quantised once (_x_codes), the SwiGLU + quant is one Triton launch (swiglu_quant_rows) and
        w2 reads its codes directly: 3 launches + 1 quant, where two x quantisations, three GEMMs and an fp32 torch
        SwiGLU ran (H200, EP8 prefill 8192: 1.66 ms, its GEMMs 0.975). A GEMM on the dense swap-AB program (decode)
        quantises its own input in its chunk-major layout, the SwiGLU then in torch. [T, D] out: bf16 from fp8_gemm
        (the un-permute and the decode sum read it as fp32), fp32 from the swap-AB program."""
        from deepinfer.ir.ops.moe import swiglu

        a = call.attrs
        x = call.args[0]
        t, inter, block = x.shape[0], call.args[3].shape[0], a["shared_block"]
        group = a["shared_mid_group"] or block
        gate_up, down = self._shared_dense_plans(call)
        stacked = call.prep("shared_w13", (3, 4, 6, 7), lambda: _stack_gate_up(call))
        sc13, sc2 = self._shared_gate_up_call(call, stacked), self._shared_down_call(call)
        if isinstance(gate_up[2], SwabSplit):
            c13 = fp8_linear(sc13, kernels[0], x, 1, 2, block, block, gate_up)
        else:
            xq, xs = _x_codes(call, block, gate_up[1])
            c13 = fp8_linear_codes(sc13, kernels[0], xq, xs, t, 1, 2, block, gate_up)
        if isinstance(down[2], SwabSplit):
            h = swiglu(c13[:, :inter], c13[:, inter:], a["shared_limit"])
            return fp8_linear(sc2, kernels[1], h, 1, 2, group, block, down)
        hq, hs = swiglu_quant_rows(c13, a["shared_limit"], group, rows=down[1])
        return fp8_linear_codes(sc2, kernels[1], hq, hs, t, 1, 2, block, down)


SHARED_SWAB_MAX_T = 64  # above this the shared expert runs the dense fp8_gemm path (tiles of all T rows)


def _quant_x(call: Call, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_rows of the call's x, once per call and group (the routed and the shared GEMMs read the same codes),
    padded to the shared expert's token tile at decode (_shared_rows) so its swap-AB pair reads them as they are."""
    k = ("x_quant", group)
    if k not in call.memo:
        x = call.args[0]
        call.memo[k] = quant_rows(x, group, _shared_rows(x.shape[0]))
    return call.memo[k]


def _x_codes(call: Call, group: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's x quantised per group with `rows` rows (a GEMM's M): _quant_x's codes (one quantisation per call
    and group, shared with the routed path) where they have those rows, else quantised here."""
    x = call.args[0]
    return _quant_x(call, group) if _shared_rows(x.shape[0]) == rows else quant_rows(x, group, rows)


def _stack_gate_up(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """[w1; w3] [2I, D] of the shared expert and their fp32 block scales stacked alike, made once per layer by
    call.prep: a view where w3 already follows w1 in one storage (a runner that lays them out so), else a copy of
    the gate/up weights (2 I D bytes a layer)."""
    a = call.args
    adjacent = _stacked_view([a[3]], [a[4]])
    w13 = adjacent[0] if adjacent is not None else torch.cat([a[3], a[4]])
    return w13, torch.cat([scales_f32(a[6]), scales_f32(a[7])])


def _shared_rows(t: int) -> int:
    """The shared expert's token tile at decode (16, 32 or 64 rows: one pass over its weights), else T."""
    if t > SHARED_SWAB_MAX_T:
        return t
    bt = min(64, -(-t // 16) * 16)
    return 1 << (bt - 1).bit_length()


def _const_counts(call: Call, n: int, t: int, device) -> torch.Tensor:
    """Counts [n] int32 all equal to t (every expert takes all T rows): made once per (n, t, device) and reused,
    so a step adds no fill launch and a captured graph reads a tensor that outlives it."""
    k = ("const_counts", n, t, str(device))
    if k not in call.cache:
        call.cache[k] = torch.full((n,), t, dtype=torch.int32, device=device)
    return call.cache[k]


def stack_experts(call: Call, n_experts: int, scales_as: Callable = scales_f32):
    """([E, 2I, K] w1|w3 codes, [E, 2I/b, K/b] scales, [E, D, I] w2, its scales), the scales through
    `scales_as` (fp32 for the fp8 kernels; fp4 keeps the ue8m0 bytes); the per-expert tensors of the call are
    views of the stacks afterwards (see CudaRunner._rebind)."""
    ex = call.args[9:]
    w1 = [ex[6 * i] for i in range(n_experts)]
    s1 = [ex[6 * i + 1] for i in range(n_experts)]
    w2 = [ex[6 * i + 2] for i in range(n_experts)]
    s2 = [ex[6 * i + 3] for i in range(n_experts)]
    w3 = [ex[6 * i + 4] for i in range(n_experts)]
    s3 = [ex[6 * i + 5] for i in range(n_experts)]
    b13 = _stacked_view(w1, w3)
    if b13 is None:
        b13 = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])
    b2 = _stacked_view(w2, None)
    if b2 is None:
        b2 = torch.stack(w2)
    s13 = torch.stack([torch.cat([scales_as(a), scales_as(b)]) for a, b in zip(s1, s3)])
    return b13, s13, b2, torch.stack([scales_as(s) for s in s2])


def _stacked_view(first: list, second: list | None):
    """A zero-copy [E, rows, K] view when the experts already lie stacked in one storage (the benchmark
    generates them that way), else None."""
    w0 = first[0]
    per = w0.shape[0] * (2 if second is not None else 1)
    k = w0.shape[1]
    if not all(w.is_contiguous() and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
               for w in first + (second or [])):  # fmt: skip
        return None
    base = w0.storage_offset()
    for e, w in enumerate(first):
        if w.storage_offset() != base + e * per * k:
            return None
        if second is not None and second[e].storage_offset() != base + e * per * k + w0.numel():
            return None
    return torch.as_strided(w0, (len(first), per, k), (per * k, k, 1), base)


# ---------------------------------------------------------------------------------------------- sparse attention


def _two_pool_program() -> bool:
    """sparse_attn_decode.program takes two pools (n_win=...): the runtime then never concatenates them."""
    import inspect

    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    return "n_win" in inspect.signature(sad.program).parameters


def _pad_idx(idx: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 indices padded with rows of -1 (a query with no entry: output 0)."""
    if idx.shape[0] == rows:  # nothing to pad: one conversion, not a fill and a copy
        return idx.to(torch.int32).contiguous()
    out = torch.full((rows, idx.shape[1]), -1, dtype=torch.int32, device=idx.device)
    out[: idx.shape[0]] = idx
    return out


def _symbolic_rows(cfg, h: int, d: int) -> bool:
    """The ws single-pass program's batch is symbolic: it runs on the real query count (the key keeps the bucket)."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    return cfg.ws and cfg.num_split == 1 and sad.ws_supported(h, d, "sm90")


def _ws_pools(cfg, h: int, d: int) -> bool:
    """The ws program (its pool sizes symbolic on sm90; the c-target mirror is built for the key's S_cmp)."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    return cfg.ws and sad.ws_supported(h, d, "sm90")


def _bf16_pool(kv: torch.Tensor) -> torch.Tensor:
    """The kernel's bf16 pool: a cache stored in bf16 (passes/cache_storage.py) as it is, no copy; else converted."""
    return kv.to(torch.bfloat16).contiguous()


def _selected_rows(kv: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 pool, indices) for the ws program's compressed pool: a bf16 pool read in place where the program's pool
    size is symbolic (its sm90 build; the CPU mirror is built for the key's S_cmp) and its int32 offsets reach every
    row; else the pool converted whole, or -- where the queries select fewer rows than it holds (the compressed cache
    of many requests at decode: converting all of it every step costs more than the attention) -- only the selected
    rows, in the queries' entry order, with indices 0 .. T*K - 1 (-1 kept). The same rows in the same order: the
    same result."""
    n = idx.numel()
    if kv.dtype == torch.bfloat16 and kv.is_cuda and kv.numel() < 2**31:
        return kv.contiguous(), idx
    if n >= kv.shape[0]:
        return _bf16_pool(kv), idx
    rows = kv.index_select(0, idx.reshape(-1).clamp_min(0).long()).to(torch.bfloat16)
    local = torch.arange(n, device=idx.device, dtype=torch.int32).view(idx.shape)
    return rows, torch.where(idx >= 0, local, torch.full_like(local, -1))


def _launch_rows(kernel, cfg, q, kv: tuple, idx: tuple, sink, o) -> None:
    """The single pass over q's rows: one launch, or pieces of MAX_LAUNCH_ROWS rows (its grid's y is the request
    count, at most 65535) for a long prefill chunk; the persistent grid takes any count in one launch."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    n = q.shape[0]
    step = n if getattr(cfg, "persist", 0) or n <= sad.MAX_LAUNCH_ROWS else sad.MAX_LAUNCH_ROWS
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        kernel(q[lo:hi], *kv, *(i[lo:hi] for i in idx), sink, o[lo:hi])


ATTN_Q_OPERAND_ENV = "DEEPINFER_ATTN_Q_OPERAND"  # "torch": fused_attention's q prologue by the torch ops, not Triton
ATTN_O_EPILOGUE_ENV = "DEEPINFER_ATTN_O_EPILOGUE"  # "triton": the output's inverse RoPE + FP8 in one launch (opt-in)


class SparseAttnAdapter:
    """sparse_attention / fused_attention at decode: the attention core through sparse_attn_decode (the sm90
    warp-specialised program where H = 64 and D % 128 == 0, the portable program elsewhere; split-K plus the
    combine kernel where the binding splits). Two pools, as the graph holds them: the window rows (SWA ring +
    this step's rows) with win_idx and the compressed rows with cmp_idx, passed as they are (program(n_win=Kw));
    only where the kernel module has no two-pool form are they concatenated (cmp indices offset by the window
    rows). Pools and q go to bf16 (the graph's activations are f32); the op's scale is folded into q when it is
    not D^-0.5. fused_attention's other steps (q RMSNorm, RoPE, inverse RoPE, the out-group reshape, the FP8
    quant epilogue) run in torch around the kernel with the op's own formulas (the binding lists them)."""

    family = "sparse_attn_decode"
    ops = ("sparse_attention", "fused_attention")

    @staticmethod
    def _operands(call: Call):
        """(q, sink, win_kv, win_idx, cmp_kv, cmp_idx) of either op."""
        a = call.args
        return (a[0], a[2], a[3], a[4], a[5], a[6]) if call.op == "fused_attention" else tuple(a)

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import sparse_attn_decode as sad

        _cuda_only(call)
        q, _, win_kv, win_idx, cmp_kv, cmp_idx = self._operands(call)
        t, h, d = q.shape
        n_win = win_idx.shape[1]
        topk = n_win + (cmp_idx.shape[1] if cmp_kv is not None else 0)
        # the in-kernel merge form (Config.merge) takes an arrival-counter scratch: the adapter runs its chunking
        # as split-K + the combine kernel instead
        names = [f for f in ("block_n", "threads", "num_split", "stages", "ws", "lookahead", "dsplit", "l2_prefetch",
                             "persist", "partial_bf16", "o_smem", "evict_first", "q_regs")
                 if f in vars(sad.Config())]  # fmt: skip
        fields = {f: call.config[f] for f in names if f in call.config}
        cfg = sad.Config(**fields) if fields else sad.sm90_config(t, topk)
        if topk % (cfg.block_n * cfg.num_split):
            # the binding saw the cache lengths at its default size: an HCA layer's top-k (every visible compressed
            # entry) differs at run time, so choose for the real one
            cfg = sad.sm90_config(t, topk)
        if getattr(cfg, "merge", False):
            cfg = sad.Config(**{f: getattr(cfg, f) for f in names})
        if topk % (cfg.block_n * cfg.num_split):
            raise Decline(f"top-k {topk} is not a multiple of the KV chunk {cfg.block_n} x {cfg.num_split}")
        if getattr(cfg, "persist", 0) and not sad.persist_fits(cfg, topk):
            cfg = sad.Config(**{f: getattr(cfg, f) for f in names if f != "persist"})  # whole rounds only
        two = cmp_kv is not None and _two_pool_program()
        if two and cfg.ws and sad.ws_supported(h, d, "sm90") and n_win % 4:
            two = False  # the ws program copies row ids 4 at a time: concatenate instead
        rows = win_kv.shape[0] + (cmp_kv.shape[0] if cmp_kv is not None and not two else 0)
        kw = {"kv_fp8": False}
        if two:  # (the compressed pool the kernel gets: _selected_rows')
            s_cmp = min(cmp_idx.numel(), cmp_kv.shape[0]) if _ws_pools(cfg, h, d) else cmp_kv.shape[0]
            kw.update(n_win=n_win, S_cmp=s_cmp)
        b = bucket_rows(t, 1)  # queries padded to a power of two (rows of -1 entries give 0): few kernels
        keys = [_key("sparse_attn_decode", "program", (b, h, d, rows, topk), cfg, **kw)]
        if cfg.num_split > 1:
            keys.append(_key("sparse_attn_decode", sad.combine_name(b), (b, h, d, cfg.num_split),
                             **sad.combine_kwargs(cfg, h, d)))  # fmt: skip
        if _symbolic_rows(cfg, h, d):  # the ws single pass: one build takes any B (prefill: no padded CTAs)
            b = t
        return keys, cfg, two, b

    def _o_rope(self, call: Call, o: torch.Tensor) -> Call | None:
        """fused_attention's inverse RoPE of the output on the rope kernel (o is the kernel's bf16 already, so
        only the rotated values take one more bf16 rounding before the FP8 epilogue); None without the runner's
        position bound (then the torch rotation)."""
        if call.op != "fused_attention" or MAX_POSITIONS not in call.cache or self._o_fused(call):
            return None
        attrs = {**self._rope_attrs(call), "inverse": True}
        return Call("rope", attrs, [o, call.args[1]], ["", ""], [False, False], {}, call.cache)

    @staticmethod
    def _o_fused(call: Call) -> bool:
        """The output's inverse RoPE and FP8 quantisation in one Triton launch (sparse_attn_decode.triton_o_epilogue):
        opt-in (DEEPINFER_ATTN_O_EPILOGUE=triton) until an H200 row measures it, with the position bound."""
        return (call.op == "fused_attention" and MAX_POSITIONS in call.cache and bool(call.attrs["quant_group"])
                and os.environ.get(ATTN_O_EPILOGUE_ENV) == "triton" and _triton_on(call.args[0]))  # fmt: skip

    def keys(self, call: Call) -> list[KernelKey]:
        keys = self._plan(call)[0]
        q = self._operands(call)[0]
        rc = self._o_rope(call, q.new_empty(q.shape, dtype=torch.bfloat16))
        return keys + ([ADAPTERS["rope"].keys(rc)[0]] if rc is not None else [])

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import sparse_attn_decode as sad

        _, cfg, two, b = self._plan(call)
        q, sink, win_kv, win_idx, cmp_kv, cmp_idx = self._operands(call)
        fused = call.op == "fused_attention"
        t, h, d = q.shape
        ratio = float(call.attrs["scale"]) * d**0.5  # the kernel scales the logits by D^-0.5
        qb = self._q_operand(call, q, ratio, b)
        if two:
            # the ws program's pools are symbolic: it can read the selected rows alone (_selected_rows)
            cmp_pool, cmp_sel = _selected_rows(cmp_kv, cmp_idx) if _ws_pools(cfg, h, d) else (
                _bf16_pool(cmp_kv), cmp_idx)
            kv = (_bf16_pool(win_kv), cmp_pool)
            idx = (_pad_idx(win_idx, b), _pad_idx(cmp_sel, b))
        elif cmp_kv is not None:
            kv = (torch.cat([win_kv, cmp_kv]).to(torch.bfloat16),)
            off = torch.where(cmp_idx >= 0, cmp_idx + win_kv.shape[0], torch.full_like(cmp_idx, -1))
            idx = (_pad_idx(torch.cat([win_idx, off], dim=1), b),)
        else:
            kv, idx = (_bf16_pool(win_kv),), (_pad_idx(win_idx, b),)
        sink = sink.float().contiguous()
        o = torch.empty(b, h, d, dtype=torch.bfloat16, device=q.device)
        if cfg.num_split == 1:
            _launch_rows(kernels[0], cfg, qb, kv, idx, sink, o)
        else:
            ns = cfg.num_split
            op = torch.empty(b, ns, h, d, device=q.device, dtype=sad.partial_dtype(cfg, h, d))
            mp, lp = torch.empty(b, ns, h, device=q.device), torch.empty(b, ns, h, device=q.device)
            kernels[0](qb, *kv, *idx, op, mp, lp)
            kernels[1](op, mp, lp, sink, o)
        if fused and self._o_fused(call):
            return self._o_epilogue_fused(call, o[:t], sad)
        rc = self._o_rope(call, o[:t]) if fused else None
        if rc is not None:  # bf16 o: the FP8 epilogue reads it as is (its codes from the bf16 values, exact)
            return self._epilogue(call, ADAPTERS["rope"].run(rc, kernels[-1:])[0], rotated=True)
        o = o[:t].to(call.args[0].dtype)
        return self._epilogue(call, o) if fused else [o]

    def _o_epilogue_fused(self, call: Call, o: torch.Tensor, sad) -> list[torch.Tensor]:
        """_o_fused's path: the codes and ue8m0 scales in the op's [T, groups, K] (or [T, H, D]) layout."""
        t, h, d = o.shape
        table = rope_table(call, self._rope_attrs(call), o.device)
        codes, exps = sad.triton_o_epilogue(o, call.args[1], table, call.attrs["rope_dim"], call.attrs["quant_group"])
        shape = (t, call.attrs["out_groups"], h * d // call.attrs["out_groups"]) if call.attrs["out_groups"] else (
            t, h, d)  # fmt: skip
        codes = codes if codes.dtype == torch.float8_e4m3fn else codes.to(torch.float8_e4m3fn)  # (interpreter)
        return [codes.view(shape), exps.view(torch.float8_e8m0fnu).reshape(*shape[:-1], -1)]

    @staticmethod
    def _rope_attrs(call: Call) -> dict:
        from deepinfer.ir.ops.attention import ROPE_ATTRS

        return {k: call.attrs[k] for k in ROPE_ATTRS}

    def _q_operand(self, call: Call, q: torch.Tensor, ratio: float, rows: int) -> torch.Tensor:
        """The kernel's bf16 q [rows, H, D] (rows > T: zero rows), fused_attention's prologue (q RMSNorm, RoPE of the
        last rope_dim channels: the op's formulas) and the scale ratio applied on the way into it -- the values of
        the reference's rotated f32 copy cast to bf16, without that copy (1 GB written and read again at an
        8192-token prefill chunk)."""
        from deepinfer.ir.ops.attention import apply_rope
        from deepinfer.ir.ops.core import RMSNorm

        t = q.shape[0]
        out = (torch.empty if rows == t else torch.zeros)((rows, *q.shape[1:]), dtype=torch.bfloat16, device=q.device)
        if call.op != "fused_attention":
            out[:t] = q if ratio == 1.0 else q * ratio
            return out
        if call.attrs["q_norm"]:
            q = RMSNorm.reference(q, None, eps=call.attrs["eps"])
        r = call.attrs["rope_dim"]
        if (MAX_POSITIONS in call.cache and _triton_on(q) and q.dtype == torch.float32
                and os.environ.get(ATTN_Q_OPERAND_ENV) != "torch"):  # fmt: skip
            # one launch (the runner's position bound sizes the cos | sin table: no host read of the positions)
            from deepinfer.codegen.kernels import sparse_attn_decode as sad

            table = rope_table(call, self._rope_attrs(call), q.device)
            return sad.triton_q_operand(q, call.args[1], table, ratio, r, rows)
        rot = apply_rope(q[..., -r:], call.args[1], **self._rope_attrs(call))  # the last r channels alone
        out[:t, ..., :-r] = q[..., :-r] if ratio == 1.0 else q[..., :-r] * ratio
        out[:t, ..., -r:] = rot if ratio == 1.0 else rot * ratio
        return out

    def _epilogue(self, call: Call, o: torch.Tensor, rotated: bool = False) -> list[torch.Tensor]:
        from deepinfer.ir.ops.attention import Rope

        if not rotated:
            o = Rope.reference(o, call.args[1], inverse=True, **self._rope_attrs(call))
        if call.attrs["out_groups"]:
            o = o.reshape(o.shape[0], call.attrs["out_groups"], -1)
        group = call.attrs["quant_group"]
        if not group:
            return [o.to(call.args[0].dtype) if rotated else o]
        o2 = o.reshape(-1, o.shape[-1])  # (rotated: the rope kernel's bf16, read without an f32 copy)
        codes, scale_t = quant_rows(o2, group, o2.shape[0])  # quant_fp8_groups' numbers, no synchronising check
        return [codes.view(o.shape), _pow2_to_e8m0(scale_t.T).reshape(*o.shape[:-1], -1)]


# ---------------------------------------------------------------------------------------------- top-k select


class TopKEntriesAdapter:
    """topk_entries through topk_select's exact program: f32 scores in, the top-k SET out in ascending column order;
    the set is put back in the op's order (score descending, ties to the lower column: a stable sort of the set's
    scores, which is already in ascending column order; on CUDA one launch, indexer_topk.triton_set_order) -- the
    reference's indices exactly. With the op's positions
    the program reads a row's columns j < (p+1)//ratio only (has_pos: a decode step's top-k follows the sequence's
    length, not max_model_len / ratio columns; the scores past that limit need not even be written); without them
    -inf marks the invisible entries and every column is read. Two-level (candidate blocks): when the blocks hold
    fewer columns than the row (V4.1: 2048 blocks of 8 = 16384 of max_model_len / ratio), the program selects from
    the blocks' columns gathered in ascending order (_candidate_columns; the invisible and padding ones -inf) and
    the set is mapped back; else from the whole row with the columns outside the blocks -inf.
    Rows are padded to a power of two (-inf rows, position -1: no entry, all -1), columns to topk_cols(C) (a few
    kernels for every C; a multiple of 4 for the kernel's float4 rows: the indexer's C = compressed count + 1 is
    odd) with -inf columns (never taken); the scratch (arrival counters the kernel leaves zeroed) is made once per
    kernel and reused."""

    family = "topk_select"
    ops = ("topk_entries",)

    @staticmethod
    def _operands(call: Call) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(scores, blocks, positions); a call of a graph written before the positions input has two args."""
        args = [*call.args, None, None]
        return args[0], args[1], args[2]

    @staticmethod
    def _selected(call: Call) -> tuple[int, bool]:
        """(columns the program selects from, gathered?): topk_select.selected_columns, the binding's rule."""
        from deepinfer.codegen.kernels import topk_select as ts

        scores, blocks, _ = TopKEntriesAdapter._operands(call)
        n_blocks = blocks.shape[1] if blocks is not None else None
        return ts.selected_columns(scores.shape[1], n_blocks, int(call.attrs["block"]))

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import topk_select as ts

        _cuda_only(call)
        scores, blocks, pos = self._operands(call)
        if blocks is None and call.attrs["block"] != 1:
            raise Decline("topk_entries with a block size but no candidate blocks")
        t = scores.shape[0]
        c, gathers = self._selected(call)
        k = int(call.attrs["topk"])
        if c < k:
            raise Decline(f"topk_select needs C >= k (C={c}, k={k})")
        cp = topk_cols(c)
        rows = bucket_rows(t, 1)
        cfg = ts.default_config(rows, cp, k)
        try:
            ts.check_config(cp, k, cfg)
        except AssertionError as e:
            raise Decline(f"topk_select config for C={cp}: {e}") from None
        prog = "hist_program" if isinstance(cfg, ts.HistConfig) else "program"
        has_pos = pos is not None and not gathers  # (gathered: the invisible columns are -inf already)
        ratio = int(call.attrs.get("ratio", 1)) if has_pos else 1
        # `program` is built row-symbolic (T_ None): one build serves every row count of the same config (the
        # 40-layer compile built it per row bucket); the hist program keeps its rows
        args = (None, cp) if prog == "program" else (rows, cp)
        return _key("topk_select", prog, args, cfg, k=k, ratio=ratio, has_pos=has_pos), rows, cfg

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)[0]]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import topk_select as ts
        from deepinfer.ir.ops.v41 import block_mask

        key, rows, cfg = self._plan(call)
        scores, blocks, pos = self._operands(call)
        scores, block = scores.float(), int(call.attrs["block"])
        cols = None  # gathered: the score columns of the program's columns (-1: none)
        if self._selected(call)[1]:
            s, cols = _candidate_columns(scores, blocks, block, pos, int(call.attrs.get("ratio", 1)))
        elif blocks is not None:
            s = scores.masked_fill(~block_mask(scores, blocks, block), float("-inf"))
        else:
            s = scores
        t, c = s.shape
        cp = key.args[1]
        k = int(call.attrs["topk"])
        dev = scores.device
        sk = ("topk_scratch", key, rows)  # (a row-symbolic program's scratch is per row count)
        if sk not in call.cache:
            call.cache[sk] = (torch.zeros(rows, dtype=torch.int32, device=dev), *ts.make_scratch(rows, cp, k, cfg, dev))
        no_pos, *scratch = call.cache[sk]
        if (rows, cp) != (t, c):  # padded with -inf (never taken) to rows x cp: the set is the same, every index < c
            s = torch.nn.functional.pad(s, (0, cp - c, 0, rows - t), value=float("-inf"))
        idx = torch.empty(rows, k, dtype=torch.int32, device=dev)
        has_pos = dict(key.kwargs)["has_pos"]
        kernels[0](s.contiguous(), _row_positions(pos, rows) if has_pos else no_pos, idx, *scratch)
        if _triton_on(scores) and os.environ.get(TOPK_ORDER_ENV) != "torch":
            from deepinfer.codegen.kernels import indexer_topk as it

            return [it.triton_set_order(scores if scores.stride(1) == 1 else scores.contiguous(), idx, t, cols)]
        picked = idx[:t].long()
        if cols is not None:  # still ascending: the candidate columns are gathered in ascending order
            picked = torch.where(picked >= 0, torch.gather(cols, 1, picked.clamp(min=0)), -1)
        return [_score_order(scores, picked)]


TOPK_ORDER_ENV = "DEEPINFER_TOPK_ORDER"  # "torch": the set put in the op's order by torch ops, not one Triton launch


def _candidate_columns(scores: torch.Tensor, blocks: torch.Tensor, block: int, pos: torch.Tensor | None,
                       ratio: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The columns of a row's candidate blocks in ascending order and their scores: ([T, nb*block] f32 scores,
    -inf where a column is no candidate; [T, nb*block] i64 columns, -1 there). No candidate: a block id -1, out of
    range or repeated, a column past C or (with positions) j >= (p+1)//ratio. All on the device (no host read)."""
    t, c = scores.shape
    n = -(-c // block)
    b = blocks.long()
    b = torch.where((b >= 0) & (b < n), b, n).sort(dim=-1).values  # none -> n, sorted last
    repeat = torch.zeros_like(b, dtype=torch.bool)
    repeat[:, 1:] = b[:, 1:] == b[:, :-1]
    b = torch.where(repeat, n, b)  # (a repeated block's columns once: the valid ids stay ascending)
    cols = (b[:, :, None] * block + torch.arange(block, device=b.device)).reshape(t, -1)
    ok = (cols < c) & (b < n).repeat_interleave(block, dim=1)
    if pos is not None:
        ok &= cols < ((pos.long() + 1) // ratio)[:, None]
    vals = torch.gather(scores, 1, cols.clamp(max=c - 1)).masked_fill(~ok, float("-inf"))
    return vals, torch.where(ok, cols, -1)


def _row_positions(pos: torch.Tensor, rows: int) -> torch.Tensor:
    """The kernel's int32 positions [rows]: padding rows at -1 (no visible column: (p+1)//ratio = 0)."""
    if pos.shape[0] == rows:
        return pos.to(torch.int32)
    out = torch.full((rows,), -1, dtype=torch.int32, device=pos.device)
    out[: pos.shape[0]] = pos
    return out


TOPK_COLS_POW2_MAX = 8192  # up to here the programs hold a row as one power-of-two chunk whatever C is


def topk_cols(c: int) -> int:
    """The kernel's column count for C score columns (the rest -inf, never taken): a power of two up to
    TOPK_COLS_POW2_MAX, a multiple of 4096 above. C grows by one every `ratio` tokens at decode and differs with
    every prompt length at prefill: keyed on C itself, every few decoded tokens built a new kernel (H200, session 7
    call 1: 13 serial topk_select builds of ~10 s each in the tiny V4.1 e2e). Up to 8192 columns the row is one
    power-of-two chunk in the kernel anyway (topk_select.default_config), so the padding costs only its copy; above,
    at most one 4096-column chunk more (long-context decode: a new kernel every 16k tokens at ratio 4)."""
    if c <= TOPK_COLS_POW2_MAX:
        return max(4, 1 << max(c - 1, 1).bit_length())
    return -(-c // 4096) * 4096


def _score_order(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A top-k set in ascending column order (-1 padding last) -> score descending, ties to the lower column."""
    picked = torch.where(idx >= 0, torch.gather(scores, 1, idx.clamp(min=0)), float("-inf"))
    order = torch.sort(picked, dim=-1, descending=True, stable=True).indices
    return torch.gather(idx, 1, order)


# ---------------------------------------------------------------------------------------------- linear (bf16 weight)


class LinearBF16Adapter:
    """linear with fp32 x and a bf16 weight at decode: linear_bf16's Triton kernel (the weight read once as
    stored, x as three exact bf16 terms, K split over CTAs and the splits summed in order) instead of the
    reference's per-call fp32 copy of the weight and FFMA GEMM. No TileLang kernel (keys: none). On CPU tensors
    (the emulated tests) the kernel runs under Triton's interpreter when it is on, else the op's torch formula."""

    family = "linear_bf16"
    ops = ("linear",)

    def keys(self, call: Call) -> list[KernelKey]:
        from deepinfer.codegen.kernels import linear_bf16

        _cuda_only(call)
        x, w, bias = call.args
        if x.dtype != torch.float32 or w.dtype != torch.bfloat16 or bias is not None:
            raise Decline(f"linear_bf16 takes f32 x and a bf16 weight without bias (x {x.dtype}, w {w.dtype})")
        try:
            linear_bf16.check_config(w.shape[0], w.shape[1], self._cfg(call))
        except AssertionError as e:
            raise Decline(f"linear_bf16 config does not split K={w.shape[1]}: {e}") from None
        return []

    @staticmethod
    def _cfg(call: Call):
        from deepinfer.codegen.kernels import linear_bf16

        x, w, _ = call.args
        base = linear_bf16.default_config(x.numel() // max(1, x.shape[-1]), w.shape[0], w.shape[1])
        fields = {f.name for f in dataclasses.fields(linear_bf16.Config)}
        return dataclasses.replace(base, **{k: v for k, v in call.config.items() if k in fields})

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import linear_bf16

        x, w, _ = call.args
        if not _triton_on(x):
            return [linear_bf16.reference(x, w)]
        return [linear_bf16.triton_linear(x, w, self._cfg(call))]


# ---------------------------------------------------------------------------------------------- indexer scores


def scores_check_view(call: Call, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a first-call check compares of an index scores call: its output as is, or -- bound with "fill": False,
    the columns past a row's live key tiles left unwritten (whatever the buffer held; only positions-aware top-ks
    read them) -- a copy with the op's -inf there (j >= (p+1)//ratio), so the check sees the visible columns."""
    if call.config.get("fill", True):
        return outs
    s, pos = outs[0], call.args[3]
    dead = torch.arange(s.shape[1], device=s.device)[None, :] >= ((pos.long() + 1) // int(call.attrs["ratio"]))[:, None]
    return [s.masked_fill(dead, float("-inf")), *outs[1:]]


class IndexScoresAdapter:
    """index_scores (f32 q [T, Hi, di] and keys [C, di]) at decode: one Triton launch (indexer_topk.triton_scores:
    each dot as three TF32 products, ~fp32 accuracy; ReLU, scale, head weights, head sum and the causal mask in
    registers) instead of the reference's [T, Hi, C] fp32 temporaries. No TileLang kernel (keys: none). On CPU
    tensors (the emulated tests) the kernel runs under Triton's interpreter when it is on, else the op's torch
    formula stands in. The one-query decode step takes indexer_topk's decode form (DECODE_CTAS_PER_SM); a binding's
    config "fill": False (only where every consumer of S reads up to the positions' limit, e.g. a top-k with
    positions) leaves the columns past the live key tiles unwritten."""

    family = "indexer_topk"
    ops = ("index_scores",)
    check_view = staticmethod(scores_check_view)

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        _f32_scores_operands(call, "T")
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import indexer_topk as it

        q, w, keys, pos = call.args
        a = call.attrs
        if not _triton_on(q):
            from deepinfer.ir.ops.attention import indexer_scores

            return [indexer_scores(q, w, keys, pos, ratio=int(a["ratio"]), scale=float(a["scale"]))[0]]
        fields = {f.name for f in dataclasses.fields(it.F32ScoresConfig)}
        cfg = dataclasses.replace(it.f32_scores_config(q.shape[0], keys.shape[0], q.shape[1]),
                                  **{k: v for k, v in call.config.items() if k in fields})  # fmt: skip
        return [it.triton_scores(q, w, keys, pos, ratio=int(a["ratio"]), scale=float(a["scale"]), cfg=cfg,
                                 fill=bool(call.config.get("fill", True)))]  # fmt: skip


def _f32_scores_operands(call: Call, rows: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, keys) of an index_scores call the f32 scores kernel takes, else Decline naming what does not fit."""
    q, _, keys, _ = call.args
    di = q.shape[-1]
    if q.dim() != 3 or di & (di - 1) or di < 16 or q.dtype != torch.float32 or keys.dtype != torch.float32:
        raise Decline(f"the f32 scores kernel takes f32 q [{rows}, H, di] and keys with di a power of two >= 16 "
                      f"(q {tuple(q.shape)} {q.dtype}, keys {keys.dtype})")  # fmt: skip
    return q, keys


class BatchedIndexScoresAdapter:
    """batched_index_scores (the batched decode graph: f32 q [B, Hi, di], keys [B*C, di], sequence b's at rows
    b*C..) on the same f32 Triton kernel with per-query keys (indexer_topk.triton_batched_scores: one query a CTA)
    instead of the reference's bmm and [B, Hi, C] fp32 temporaries (H200, B64 at 4k: 74.8 us vs 210 us). The node
    keeps the one-sequence index_scores binding (batch_decode keeps node names) or gets select_kernels'
    bind_batched_index_scores; either way only its precision (and "fill", as IndexScoresAdapter's) applies (the
    tile: see run; decode_form when DECODE_CTAS_PER_SM is on). CPU tensors: as IndexScoresAdapter (the
    interpreter when asked, else the op's torch formula)."""

    family = "indexer_topk"
    ops = ("batched_index_scores",)
    check_view = staticmethod(scores_check_view)

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        q, keys = _f32_scores_operands(call, "B")
        if q.shape[0] and keys.shape[0] % q.shape[0]:
            raise Decline(f"keys {tuple(keys.shape)} is not B*C rows for B={q.shape[0]} sequences")
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import indexer_topk as it

        q, w, keys, pos = call.args
        ratio, scale = int(call.attrs["ratio"]), float(call.attrs["scale"])
        if not _triton_on(q):
            from deepinfer.ir.ops.batched import batched_indexer_scores

            return [batched_indexer_scores(q, w, keys, pos, ratio=ratio, scale=scale)[0]]
        b = q.shape[0]
        # the tile is the batched config's whatever the binding's bucket: the inherited one-sequence binding hands
        # B > 256 the prefill tile (128 x 8), slower here (H200: 305 vs 242 us at B256 C4097), and one tile for
        # every B keeps a sequence's scores (the head sum's layout) independent of the batch size
        cfg = it.f32_batched_scores_config(b, keys.shape[0] // max(1, b), q.shape[1])
        if "precision" in call.config:
            cfg = dataclasses.replace(cfg, precision=call.config["precision"])
        return [it.triton_batched_scores(q, w, keys, pos, ratio=ratio, scale=scale, cfg=cfg,
                                         fill=bool(call.config.get("fill", True)))]  # fmt: skip


# ---------------------------------------------------------------------------------------------- rope / engram


MAX_POSITIONS = "max_positions"  # Call.cache key: positions stay below this (set by the runner)


class RopeAdapter:
    """rope: x [T, ..., D] as [T, H, D] bf16; cos/sin from one fp32 table per (attrs, positions bucket), built
    with the op's own frequencies (cached, so the kernel computes the reference's exact products). The kernel's
    token count is symbolic: one build for every T (the key has no row count; no padding)."""

    family = "rope"
    ops = ("rope",)

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import rope

        _cuda_only(call)
        x, pos = call.args
        t, d = x.shape[0], x.shape[-1]
        h = x[0].numel() // d if t else 1
        # the table covers max_positions when the runner knows it (the engine's max_model_len: no host read of
        # the positions, so a decode step can be a CUDA graph), else the batch's largest position (a host read)
        bound = call.cache.get(MAX_POSITIONS)
        p = bucket_rows(bound or (int(pos.max()) + 1 if pos.numel() else 1), 1024)
        cfg = rope.Config(**{f: call.config[f] for f in ("block_t", "threads") if f in call.config})
        io = {"io": "float32"} if x.dtype == torch.float32 else {}  # fp32 in memory, the bf16 kernel's numbers
        key = _key("rope", "program", (None, h, d, p), cfg, rope_dim=call.attrs["rope_dim"],
                   inverse=bool(call.attrs["inverse"]), **io)  # fmt: skip
        return key, h, p

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)[0]]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        _, h, p = self._plan(call)
        x, pos = call.args
        t, d = x.shape[0], x.shape[-1]
        x3 = x.reshape(t, h, d)
        xb = (x3 if x.dtype == torch.float32 else x3.to(torch.bfloat16)).contiguous()  # (see _plan's io)
        y = torch.empty_like(xb)
        if t:  # no launch of an empty grid
            kernels[0](xb, pos.to(torch.int32).contiguous(), rope_table(call, call.attrs, x.device, p), y)
        return [y.to(x.dtype).reshape(x.shape)]


COMPRESSOR_KEYS_ENV = "DEEPINFER_COMPRESSOR_KEYS"  # "kernels": the rmsnorm / rope TileLang kernels + torch pooling


def rope_table(call: Call, a: dict, device, rows: int | None = None) -> torch.Tensor:
    """The fp32 cos | sin table [rows, rope_dim] of the rope attrs `a` (rope.cos_sin_table: the reference's
    angles), made once per (rows, attrs) in the runner's cache; rows default: the runner's position bound
    (MAX_POSITIONS) in buckets of 1024."""
    from deepinfer.codegen.kernels import rope
    from deepinfer.ir.ops.attention import ROPE_ATTRS, rope_inv_freq

    rows = rows or bucket_rows(call.cache[MAX_POSITIONS], 1024)
    tkey = ("rope_table", rows, tuple(sorted((k, a[k]) for k in ROPE_ATTRS)))
    if tkey not in call.cache:
        freq_args = tuple(a[k] for k in ("rope_dim", "theta", "yarn_factor", "yarn_orig_len", "beta_fast", "beta_slow"))
        call.cache[tkey] = rope.cos_sin_table(rows, rope_inv_freq(*freq_args)).to(device)
    return call.cache[tkey]


class CompressorKeysAdapter:
    """pair_compressor_keys / compressor_keys. Default: ONE Triton launch (compressor.triton_compressor_keys: the
    pair pooling with the start parity read on the device, both RMSNorms, both RoPEs and the wk product, fp32 as
    the references; ~55 launches before). DEEPINFER_COMPRESSOR_KEYS=kernels: the previous path -- the pooling
    and the small wk GEMM as the op's torch formulas, the two RMSNorms and two RoPEs on the compiled rmsnorm and
    rope kernels. The compressor family's TileLang kernel (pooling + norm) needs the batch's first position parity
    at build time (a host read), so it is not used here. Both need the runner's position bound (MAX_POSITIONS):
    without it the rope tables would read the positions on the host."""

    family = "compressor"
    ops = ("pair_compressor_keys", "compressor_keys")
    norm = RMSNormAdapter()
    rope = RopeAdapter()

    def _sub(self, call: Call, op: str, x, w_index: int | None, pos=None) -> Call:
        from deepinfer.ir.ops.attention import ROPE_ATTRS

        if op == "rmsnorm":
            w = call.args[w_index]
            return Call("rmsnorm", {"eps": call.attrs["eps"]}, [x, w], ["", call.names[w_index]],
                        [False, call.is_param[w_index]], {}, call.cache)  # fmt: skip
        attrs = {**{k: call.attrs[k] for k in ROPE_ATTRS}, "inverse": False}
        return Call("rope", attrs, [x, pos], ["", ""], [False, False], {}, call.cache)

    @staticmethod
    def _layout(call: Call) -> tuple[int, int, int]:
        """The input indices of (the latent's norm weight, wk, k_norm) in either op."""
        if call.op == "pair_compressor_keys":
            return 5, 6, 7
        return 2, 3, 4

    @staticmethod
    def _triton(call: Call) -> bool:
        d, di = call.args[0].shape[-1], call.args[CompressorKeysAdapter._layout(call)[1]].shape[0]
        pow2 = not (d & (d - 1) or di & (di - 1))
        return pow2 and os.environ.get(COMPRESSOR_KEYS_ENV) != "kernels"

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        if MAX_POSITIONS not in call.cache:
            raise Decline("the compressor's RoPE kernels need the runner's position bound (max_positions)")
        if self._triton(call):
            return []
        kv = call.args[0]
        n = (kv.shape[0] + 1) // 2 if call.op == "pair_compressor_keys" else kv.shape[0]
        ni, wi, ki = self._layout(call)
        di = call.args[wi].shape[0]
        latent, keys = kv.new_empty((n, kv.shape[1])), kv.new_empty((n, di))
        pos = kv.new_empty((n,), dtype=torch.long)
        return [self.norm.keys(self._sub(call, "rmsnorm", latent, ni))[0],
                self.rope.keys(self._sub(call, "rope", latent, None, pos))[0],
                self.norm.keys(self._sub(call, "rmsnorm", keys, ki))[0],
                self.rope.keys(self._sub(call, "rope", keys, None, pos))[0]]  # fmt: skip

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.ir.ops.core import Linear
        from deepinfer.ir.ops.v41 import PairCompressor

        ni, wi, ki = self._layout(call)
        if self._triton(call):
            return self._run_triton(call)
        if call.op == "pair_compressor_keys":
            pooled, entry_pos, entry_idx, new_kv, new_score = PairCompressor.reference(*call.args[:5])
            extra = [entry_idx, new_kv, new_score]
        else:
            pooled, entry_pos, extra = call.args[0], call.args[1], []
        latent = self.norm.run(self._sub(call, "rmsnorm", pooled, ni), kernels[:1])[0]
        entry = self.rope.run(self._sub(call, "rope", latent, None, entry_pos), kernels[1:2])[0]
        keys = Linear.reference(latent, call.args[wi], None)
        keys = self.norm.run(self._sub(call, "rmsnorm", keys, ki), kernels[2:3])[0]
        keys = self.rope.run(self._sub(call, "rope", keys, None, entry_pos), kernels[3:4])[0]
        return [entry, keys, *extra]

    def _run_triton(self, call: Call) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import compressor

        ni, wi, ki = self._layout(call)
        kv = call.args[0]
        pos = call.args[4] if call.op == "pair_compressor_keys" else call.args[1]
        table = rope_table(call, call.attrs, kv.device)
        kw = {"eps": float(call.attrs["eps"]), "rope_dim": int(call.attrs["rope_dim"])}
        if not _triton_on(kv):  # CPU tests without the interpreter
            from deepinfer.ir.registry import get_op

            return get_op(call.op).run(call.args, call.attrs)
        if call.op == "pair_compressor_keys":
            score, state_kv, state_score = call.args[1:4]
            out = compressor.triton_compressor_keys(kv, pos, call.args[ni], call.args[wi], call.args[ki], table,
                                                    score=score, state_kv=state_kv, state_score=state_score, **kw)
            entry, keys, idx, new_kv, new_score = out
            return [entry, keys, idx, new_kv.to(state_kv.dtype), new_score.to(state_score.dtype)]
        return list(compressor.triton_compressor_keys(kv, pos, call.args[ni], call.args[wi], call.args[ki], table,
                                                      **kw))  # fmt: skip


class BatchedPairCompressorAdapter:
    """batched_pair_compressor_keys (batched decode: B sequences, each its own pending row and position): ONE Triton
    launch (pair_compressor.triton_batched_pair_keys: the pair pooling, both RMSNorms, both RoPEs, the wk product,
    the new states; fp32 as the op's reference) instead of its ~25 torch launches. No TileLang kernel (keys:
    none). The batched graph keeps the one-sequence node's "compressor" binding (same node name), so the adapter
    is listed under that family too. On CPU tensors the kernel runs under Triton's interpreter when the adapters'
    interpreter is on, else the op's torch formula. Needs the runner's position bound (the rope table's rows)."""

    family = "pair_compressor"
    ops = ("batched_pair_compressor_keys",)

    def keys(self, call: Call) -> list[KernelKey]:
        from deepinfer.codegen.kernels import pair_compressor

        _cuda_only(call)
        if MAX_POSITIONS not in call.cache:
            raise Decline("the batched compressor's RoPE table needs the runner's position bound (max_positions)")
        kv, wk = call.args[0], call.args[6]
        try:
            pair_compressor.check_shapes(kv.shape[-1], wk.shape[0], int(call.attrs["rope_dim"]), self._cfg(call))
        except AssertionError as e:
            raise Decline(f"batched pair compressor kernel: {e}") from None
        return []

    @staticmethod
    def _cfg(call: Call):
        from deepinfer.codegen.kernels import pair_compressor

        base = pair_compressor.default_config(call.args[0].shape[0], call.args[0].shape[-1], call.args[6].shape[0])
        fields = {f.name for f in dataclasses.fields(pair_compressor.Config)}
        return dataclasses.replace(base, **{k: v for k, v in call.config.items() if k in fields})

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import pair_compressor
        from deepinfer.ir.registry import get_op

        kv, score, state_kv, state_score, pos, norm_w, wk, k_norm = call.args
        if not _triton_on(kv):
            return get_op(call.op).run(call.args, call.attrs)
        table = rope_table(call, call.attrs, kv.device)
        entry, keys, idx, new_kv, new_sc = pair_compressor.triton_batched_pair_keys(
            kv, score, state_kv, state_score, pos, norm_w, wk, k_norm, table, eps=float(call.attrs["eps"]),
            rope_dim=int(call.attrs["rope_dim"]), cfg=self._cfg(call))  # fmt: skip
        return [entry.to(kv.dtype), keys.to(kv.dtype), idx, new_kv.to(state_kv.dtype), new_sc.to(state_score.dtype)]


class EngramEmbedAdapter:
    """engram_embed: the FP8 table and its e8m0 scales as the kernel's exponent bytes (a view), int32 ids. The
    token count and the table's rows are symbolic in the kernel: one build for every T and every table of the
    model (the key has neither)."""

    family = "engram"
    ops = ("engram_embed",)

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import engram

        _cuda_only(call)
        table, scale, ids = call.args
        if scale is None or table.dtype != torch.float8_e4m3fn:
            raise Decline("the embed kernel reads an FP8 table with ue8m0 scales")
        cfg = engram.EmbedConfig(**{f: call.config[f] for f in ("block_t", "threads") if f in call.config})
        return _key("engram", "embed_program", (None, ids.shape[1], None), cfg, hd=table.shape[1])

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        self._plan(call)  # the same checks as keys()
        table, scale, ids = call.args
        s = call.prep("engram_s", 1, lambda: scale.contiguous().view(torch.uint8))
        t, k = ids.shape
        out = torch.empty(t, k * table.shape[1], device=ids.device)
        if t:  # no launch of an empty grid
            kernels[0](table, s, ids.to(torch.int32).contiguous(), out)
        return [out]


class EngramGateAdapter:
    """engram_gate: X bf16 in the kernel, kv fp32, QK = q_weight * k_weight folded once (per parameter). The
    kernel's token count is symbolic: one build for every T (the key has no row count; no padding)."""

    family = "engram"
    ops = ("engram_gate",)

    def _plan(self, call: Call):
        from deepinfer.codegen.kernels import engram

        _cuda_only(call)
        t, n, d = call.args[0].shape
        cfg = engram.GateConfig(**{f: call.config[f] for f in ("block_d", "threads") if f in call.config})
        if d % min(cfg.block_d, d):
            raise Decline(f"D={d} is not a multiple of block_d {cfg.block_d}")
        a = call.attrs
        return _key("engram", "gate_program", (None, n, d), cfg, eps=float(a["eps"]), clamp=float(a["clamp"]),
                    image_token_id=int(a["image_token_id"]))  # fmt: skip

    def keys(self, call: Call) -> list[KernelKey]:
        return [self._plan(call)]

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        self._plan(call)  # the same checks as keys()
        x, kv, qw, kw, tokens = call.args
        qk = call.prep("engram_qk", (2, 3), lambda: (qw.float() * kw.float()).contiguous())
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.empty_like(xb)
        if x.shape[0]:  # no launch of an empty grid
            kernels[0](xb, kv.float().contiguous(), qk, tokens.to(torch.int32).contiguous(), y)
        return [y.to(x.dtype)]


class EngramHashAdapter:
    """engram_hash / batched_engram_hash through codegen/kernels/engram_hash: one Triton launch instead of ~75 small
    int64 torch ones. Its tables (the compressed token map and the multipliers | primes | offsets) are made once per
    attribute set into the call cache, before any capture (a decode graph's warm-up runs first): no host -> device
    copy in a step. No TileLang kernel (keys: none). On CPU tensors the kernel runs under Triton's interpreter when
    it is on for the adapters, else the op's reference."""

    family = "engram_hash"
    ops = ("engram_hash", "batched_engram_hash")

    def keys(self, call: Call) -> list[KernelKey]:
        _cuda_only(call)
        return []

    def run(self, call: Call, kernels: list) -> list[torch.Tensor]:
        from deepinfer.codegen.kernels import engram_hash
        from deepinfer.ir.registry import get_op

        tokens, history = call.args
        a = call.attrs
        if not _triton_on(tokens):
            return get_op(call.op).run([tokens, history], a)
        k = ("engram_hash_tables", tuple(a["multipliers"]), tuple(a["primes"]), a["vocab"], a["compressed_vocab"],
             a["pad_id"], str(tokens.device))  # fmt: skip
        if k not in call.cache:
            call.cache[k] = engram_hash.device_tables(a, tokens.device)
        cmap, consts, pad_class = call.cache[k]
        return [engram_hash.triton_engram_hash(tokens, history, cmap, consts, n_heads=int(a["n_heads"]),
                                               pad_class=pad_class, image_token_id=int(a["image_token_id"]),
                                               batched=call.op == "batched_engram_hash")]  # fmt: skip


BATCHED_PAIR_COMPRESSOR = BatchedPairCompressorAdapter()

ADAPTERS: dict[str, object] = {
    "fp8_gemm": (LinearFP8Adapter(), GroupedOutProjAdapter()),
    "rmsnorm_quant": RMSNormAdapter(),
    "hyper_connection": (HCPostAdapter(), HCPreCollapseAdapter(), HCPostPreCollapseAdapter(), HCStatsAdapter()),
    "moe_routing": MoERoutingAdapter(),
    "moe_grouped_gemm": MoEGroupedAdapter(),
    "rope": RopeAdapter(),
    "engram": (EngramEmbedAdapter(), EngramGateAdapter()),
    "sparse_attn_decode": SparseAttnAdapter(),
    "topk_select": TopKEntriesAdapter(),
    "compressor": (CompressorKeysAdapter(), BATCHED_PAIR_COMPRESSOR),  # the batched graph keeps this binding
    "pair_compressor": BATCHED_PAIR_COMPRESSOR,
    "act_quant": (FakeQuantAdapter(), DequantAdapter()),
    "cache_rows": ScatterRowsAdapter(),
    "candidate_blocks": CandidateBlocksAdapter(),
    "engram_hash": EngramHashAdapter(),
    "indexer_topk": (IndexScoresAdapter(), BatchedIndexScoresAdapter()),
    "linear_bf16": LinearBF16Adapter(),
}


def adapter_for(family: str, op: str):
    """The adapter of ``family`` for ``op``, or None."""
    cands = ADAPTERS.get(family)
    for a in cands if isinstance(cands, tuple) else (cands,) if cands else ():
        if op in a.ops:
            return a
    return None


# ---------------------------------------------------------------------------------------------- building


def _config_class(mod, fn):
    """The program's own config class: its cfg default's type (engram has one per program), else the class its
    annotation names (swab_program: SwabConfig | None), else the module's Config (moe_grouped_gemm.program runs
    fp8_gemm's main loop with fp8_gemm.Config)."""
    import inspect

    param = inspect.signature(fn).parameters["cfg"]
    if param.default not in (None, inspect.Parameter.empty):
        return type(param.default)
    for t in getattr(param.annotation, "__args__", (param.annotation,)):
        if isinstance(t, type) and t is not type(None):
            return t
    from deepinfer.codegen.kernels.fp8_gemm import Config

    return getattr(mod, "Config", Config)


def _factory(key: KernelKey, target: str = "sm90"):
    import importlib

    mod = importlib.import_module(f"deepinfer.codegen.kernels.{key.family}")
    fn = getattr(mod, key.program)
    kw = dict(key.kwargs)
    if "cfg" in kw:
        kw["cfg"] = _config_class(mod, fn)(**dict(kw["cfg"]))
    return fn(*key.args, target=target, **kw)


def build_kernel(key: KernelKey):
    """Lower and compile one kernel for the H200 (TileLang caches the result on disk)."""
    import tilelang

    return tilelang.compile(_factory(key), target=TILELANG_TARGET, execution_backend="tvm_ffi")


def c_target_kernel(key: KernelKey) -> Callable:
    """The same program built for TileLang's `c` target (fp32 data), behind the sm90 kernel's signature: FP8 and
    bf16 operands go in as fp32 copies, and every converted operand is copied back afterwards (an output takes
    its dtype's rounding there; an input is unchanged, the conversions being exact). For CPU tests of the
    adapters against the real program (its layouts and index arithmetic), at small shapes."""
    from deepinfer.codegen.tilelang_backend import compile_cpu

    kernel = compile_cpu(_factory(key, target="cpu"))
    narrow = (torch.float8_e4m3fn, torch.bfloat16, torch.float16)

    def run(*args):
        wide = [a.float() if isinstance(a, torch.Tensor) and a.dtype in narrow else a for a in args]
        kernel(*wide)
        for a, w in zip(args, wide):
            if w is not a:
                a.copy_(w)

    return run


def prebuild_one(key: KernelKey) -> str:
    """Worker for a process pool: build (to warm TileLang's disk cache); returns '' or the error."""
    try:
        build_kernel(key)
        return ""
    except Exception as e:  # reported by the caller, the kernel then falls back to its reference
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def prebuild(keys: list, jobs: int, timeout_s: float, log: Callable = print) -> dict:
    """Build kernels in `jobs` spawned processes so this process finds them in TileLang's disk cache.
    Returns {kernel: error} for the ones that failed ({"timeout": ...} when the pool ran out of time; the rest
    then compile lazily, or fall back to their references)."""
    import multiprocessing as mp
    import time

    if not keys or jobs <= 0:
        return {}
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(jobs, len(keys))) as pool:
        res = pool.map_async(prebuild_one, keys)
        try:
            out = res.get(timeout=max(5.0, timeout_s))
        except mp.TimeoutError:
            log(f"prebuild: timed out after {timeout_s:.0f} s; the rest compile lazily or fall back")
            pool.terminate()
            return {"timeout": f"after {timeout_s:.0f} s"}
    errors = {k.describe(): e for k, e in zip(keys, out) if e}
    log(f"prebuilt {len(keys)} kernels in {time.time() - t0:.0f} s with {min(jobs, len(keys))} processes, "
        f"{len(errors)} failed")  # fmt: skip
    for k, e in errors.items():
        log(f"  build error: {k}: {e}")
    return errors


def emulated_kernel(key: KernelKey) -> Callable:
    """A torch stand-in with the compiled kernel's signature (outputs written in place), from the family's
    reference: for CPU tests of the adapters."""
    kw = dict(key.kwargs)
    if key.program == "swab_program":
        return _emulated_swab(key)
    if key.family == "sparse_attn_decode":
        return _emulated_attention(key)
    if key.family == "topk_select":
        from deepinfer.codegen.kernels import topk_select

        def select(s, pos, idx, *scratch):
            _check_abi(key, (s, key.args), (pos, key.args[:1]), (idx, (key.args[0], kw["k"])))
            positions = pos if kw.get("has_pos", True) else None  # (the program's default: has_pos=True)
            idx.copy_(topk_select.reference(s, kw["k"], positions, kw.get("ratio", 1)))

        return select
    if key.family == "moe_routing":
        from deepinfer.codegen.kernels import moe_routing

        def route(logits, bias, idx, w):
            _check_abi(key, (logits, key.args), (bias, key.args[1:]), (idx, (key.args[0], kw["topk"])))
            i, wt = moe_routing.reference(logits, bias, kw["topk"], kw["route_scale"])
            idx.copy_(i)
            w.copy_(wt)

        return route
    if key.family == "fp8_gemm":
        from deepinfer.codegen.kernels import fp8_gemm

        def gemm(a, sa_t, b, sb, c):
            _check_abi(key, (a, (key.args[0], key.args[2])), (b, (key.args[1], key.args[2])),
                       (c, (key.args[0], key.args[1])))  # fmt: skip
            c.copy_(fp8_gemm.reference(a, sa_t.T, b, sb, kw["act_group"], kw["weight_block"]))

        return gemm
    if key.family == "moe_grouped_gemm":
        from deepinfer.codegen.kernels import moe_grouped_gemm

        bm = dict(kw["cfg"])["block_m"]

        def grouped(a, sa_t, b, sb, tiles, c):
            m, n, k, e = key.args
            _check_abi(key, (a, (m, k)), (b, (e, n, k)), (tiles, (m // bm,)), (c, (m, n)))
            c.copy_(moe_grouped_gemm.reference(a, sa_t.T, b, sb, tiles, bm, kw["act_group"], kw["weight_block"]))

        return grouped
    if key.family == "rmsnorm_quant":
        from deepinfer.codegen.kernels import rmsnorm_quant

        def norm(x, w, *outs):
            _check_abi(key, (x, key.args), (w, key.args[1:]), *((o, key.args) for o in outs[:1]))
            x = x.bfloat16() if kw.get("io") == "float32" else x  # fp32 in memory, rounded to bf16 on load
            if kw["quant"]:
                q, s = rmsnorm_quant.reference(x, w, kw["eps"], kw["group"])
                outs[0].copy_(q)
                outs[1].copy_(s.T)
            else:
                outs[0].copy_(rmsnorm_quant.reference(x, w, kw["eps"]))

        return norm
    if key.program == "post_program":
        from deepinfer.codegen.kernels import hyper_connection as hc

        def post(x, y, p, c, out):
            if kw.get("io") == "float32":  # fp32 in memory, rounded to bf16 on load and store
                x, y = x.bfloat16(), y.bfloat16()
            out.copy_(hc.post_reference(x, y, p, c.view(-1, hc.N_HC, hc.N_HC)))

        return post
    if key.program == "pre_program":
        from deepinfer.codegen.kernels import hyper_connection as hc

        def pre(x, fn_p, base, scale, prev, y, pre_, post_, comb):
            t = x.shape[0]
            r = hc.pre_reference(x.view(t, hc.N_HC, -1), fn_p[: hc.N_MIX], base, scale, prev, kw["eps"],
                                 kw["hc_eps"], kw["iters"])  # fmt: skip
            for o, v in zip((y, pre_, post_, comb), r):
                o.copy_(v.reshape(o.shape))

        return pre
    if key.program in ("pre_partial_program", "pre_finish_program"):
        return _emulated_hc_split(key)
    if key.family == "rope":
        from deepinfer.codegen.kernels import rope

        def rot(x, pos, table, y):
            _check_abi(key, (x, key.args[:3]), (pos, key.args[:1]), (y, key.args[:3]))
            x = x.bfloat16() if kw.get("io") == "float32" else x  # fp32 in memory, rounded to bf16 on load
            y.copy_(rope.reference(x, pos, table, kw["rope_dim"], kw["inverse"]))

        return rot
    if key.program == "embed_program":
        from deepinfer.codegen.kernels import engram

        def embed(table, s, ids, out):
            _check_abi(key, (ids, key.args[:2]), (table, (key.args[2], kw["hd"])))
            out.copy_(engram.embed_reference(table, s, ids.clamp(min=0)))

        return embed
    if key.program == "gate_program":
        from deepinfer.codegen.kernels import engram

        def gate(x, kv, qk, tok, y):
            _check_abi(key, (x, key.args), (tok, key.args[:1]))
            y.copy_(engram.gate_reference(x, kv, qk, tok, eps=kw["eps"], clamp=kw["clamp"],
                                          image_token_id=kw["image_token_id"]))  # fmt: skip

        return gate
    raise KeyError(f"no emulation for {key.family}.{key.program}")


def _emulated_hc_split(key: KernelKey) -> Callable:
    """hyper_connection's split hc_pre pair from its docstring: per split, the partial mixes and sums of squares of
    its channel range and the (complete) collapse of those channels; the finish sums the partials in split order."""
    from deepinfer.codegen.kernels import hyper_connection as hc

    kw = dict(key.kwargs)
    rows, d = key.args
    splits, per = kw["splits"], d // kw["splits"]

    def partial(x, fn_p, prev, y, pm, psq):
        io = kw.get("io") == "float32"  # fp32 in memory, rounded to bf16 on load and store
        xs = (x.bfloat16() if io else x).float().view(rows, hc.N_HC, d)
        fs = fn_p.view(hc.MIX_PAD, hc.N_HC, d)
        coll = (prev.float().unsqueeze(-1) * xs).sum(1)
        y.copy_(coll.bfloat16() if io else coll)
        for q in range(splits):
            part = slice(q * per, (q + 1) * per)
            pm[q] = xs[:, :, part].flatten(1) @ fs[:, :, part].flatten(1).T
            psq[q] = xs[:, :, part].pow(2).sum((1, 2))

    def finish(pm, psq, base, scale, pre, post, comb):
        mix, sq = pm[0].clone(), psq[0].clone()
        for q in range(1, splits):
            mix, sq = mix + pm[q], sq + psq[q]
        m = mix[:, : hc.N_MIX] * torch.rsqrt(sq / (hc.N_HC * d) + kw["eps"]).unsqueeze(-1)
        p, po, c = hc.coefficients_reference(m, base, scale, kw["hc_eps"], kw["iters"])
        pre.copy_(p)
        post.copy_(po)
        comb.copy_(c.reshape(rows, -1))

    return partial if key.program == "pre_partial_program" else finish


def _emulated_attention(key: KernelKey) -> Callable:
    """sparse_attn_decode's programs from their docstrings: the single pass writes O; the split pass writes each
    chunk's unnormalised output with its running max and sum (natural base; a chunk of only -1 entries: max
    -1e30, sum 0, output 0); the combine folds the chunks with the sink. Two pools: entry j < n_win is row
    IdxW[b, j] of KVw, the rest rows of KVc."""
    from deepinfer.codegen.kernels import sparse_attn_decode as sad

    kw = dict(key.kwargs)
    if key.program in ("combine_program", "combine_program_wide"):  # the same result
        h = key.args[1]

        def combine(op, mp, lp, sink, o):
            mx = torch.maximum(mp.amax(1), sink.view(1, h))
            w = torch.exp(mp - mx.unsqueeze(1))
            den = (lp * w).sum(1) + torch.exp(sink.view(1, h) - mx)
            o.copy_(((op * w.unsqueeze(-1)).sum(1) / den.unsqueeze(-1)).to(o.dtype))

        return combine
    b, h, d, s, topk = key.args
    n_win, ns = kw.get("n_win", 0), dict(kw["cfg"])["num_split"]
    cfg = dict(kw["cfg"])
    symbolic = bool(cfg.get("ws")) and ns == 1 and sad.ws_supported(h, d, "sm90")  # any B, as the ws program

    def attn(q, *rest):
        b = q.shape[0] if symbolic else key.args[0]
        if n_win:
            kvw, kvc, iw, ic, *rest = rest
            _check_abi(key, (iw, (b, n_win)), (ic, (b, topk - n_win)), (kvw, (s, d)))
            kv = torch.cat([kvw, kvc])
            idx = torch.cat([iw, torch.where(ic >= 0, ic + s, -1)], dim=1)
        else:
            kv, idx, *rest = rest
            _check_abi(key, (kv, (s, d)), (idx, (b, topk)))
        _check_abi(key, (q, (b, h, d)))
        if ns == 1:
            sink, o = rest
            o.copy_(sad.reference(q, kv, idx, sink))
            return
        op, mp, lp = rest
        chunk = topk // ns
        for sp in range(ns):
            ids = idx[:, sp * chunk : (sp + 1) * chunk]
            rows = kv[ids.clamp_min(0).long()].float()
            logits = torch.einsum("bhd,bjd->bhj", q.float(), rows) * d**-0.5
            valid = (ids >= 0).unsqueeze(1)
            m = torch.where(valid, logits, torch.full_like(logits, -1e30)).amax(-1)
            p = torch.where(valid, torch.exp(logits - m.unsqueeze(-1)), torch.zeros_like(logits))
            op[:, sp] = torch.einsum("bhj,bjd->bhd", p, rows)
            mp[:, sp], lp[:, sp] = m, p.sum(-1)

    return attn


def _untile_gate_up(w: torch.Tensor, half: int, dim: int = 1) -> torch.Tensor:
    """The inverse of moe_grouped_gemm.gate_up_tiles: gate rows then up rows again."""
    shape = list(w.shape)
    n = shape[dim]
    v = w.reshape(shape[:dim] + [n // (2 * half), 2, half] + shape[dim + 1 :])
    return v.transpose(dim, dim + 1).reshape(shape).contiguous()


def swab_rows(key: KernelKey, meta: torch.Tensor) -> torch.Tensor:
    """swab_program's expert of each of its M rows, -1 for the rows it need not compute (its docstring: rows past an
    expert's count in the masked layout, or of an expert no grid slot reaches, hold junk or are not written): the
    rows its emulation writes, and the only ones a kernel-vs-emulation check may compare (gpu_e2e.PairedKernels)."""
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    kw = dict(key.kwargs)
    e, max_rows = key.args[3], kw.get("max_rows", 0)
    counts = meta[:e] if max_rows else meta
    rows = mg.row_experts(counts, max_rows or dict(kw["cfg"])["block_t"], masked=bool(max_rows)).to(meta.device)
    if max_rows:  # the experts the grid's slots reach (slot s: SlotExpert[s], or the s-th expert with tokens)
        n_slots = kw.get("slots") or e
        named = meta[e:][:n_slots] if kw.get("slot_map", False) else torch.nonzero(counts > 0).flatten()[:n_slots]
        reached = torch.zeros(e + 1, dtype=torch.bool, device=rows.device)
        reached[named.long().to(rows.device)] = True
        rows = torch.where(reached[rows], rows, -1)
    return rows


def _emulated_swab(key: KernelKey) -> Callable:
    """swab_program's contract from its docstring: C = A @ B[e(row)]^T per row (masked: Counts, or with slot_map
    Counts ++ SlotExpert, and only the experts the grid's slots name; contiguous: TileExpert per block_t rows),
    rows past an expert's count untouched; with swiglu_limit, B is w1|w3 tile-interleaved and the outputs are the
    clamped SwiGLU's e4m3 codes + MN-major per-32 scales."""
    from deepinfer.codegen.kernels import fp8_gemm
    from deepinfer.codegen.kernels import moe_grouped_gemm as mg

    kw = dict(key.kwargs)
    cfg = dict(kw["cfg"])
    m, n, k, e = key.args
    fmt, ag, wb, max_rows, limit = kw["fmt"], kw["act_group"], kw["weight_block"], kw.get("max_rows", 0), \
        kw.get("swiglu_limit")  # fmt: skip
    tiled = limit is not None and not kw.get("glu_split", False)  # B (and SB) gate/up tile-interleaved
    half = cfg["block_n"] // 2

    def swab(a, sa_t, b, sb, meta, *outs):
        fp4 = fmt == "fp4"
        b_shape = (e, n, k // 4) if fp4 else (e, n, k)
        slot_map = kw.get("slot_map", False)
        meta_n = (2 * e + 1 if slot_map else e) if max_rows else m // cfg["block_t"]
        out_n = n // 2 if limit is not None else n
        _check_abi(key, (a, (m, k)), (sa_t, (-(-k // ag), m)), (b, b_shape), (meta, (meta_n,)), (outs[0], (m, out_n)))
        rows = swab_rows(key, meta).to(a.device)
        if fp4:
            packed = b.view(torch.uint8).view(e, n, k // 2)
            scale = sb.transpose(1, 2).view(torch.float8_e8m0fnu)
            if tiled:
                packed, scale = _untile_gate_up(packed, half), _untile_gate_up(scale, half)
            h = mg.reference_w4a8(a, sa_t.T, packed, scale, rows, ag)
        else:
            if tiled:
                b, sb = _untile_gate_up(b, half), _untile_gate_up(sb, half // wb)
            h = torch.zeros(m, n, device=a.device)
            for ex in torch.unique(rows[rows >= 0]).tolist():
                sel = rows == ex
                h[sel] = fp8_gemm.reference(a[sel], sa_t.T[sel], b[ex], sb[ex], ag, wb)
        real = rows >= 0
        if limit is None:
            outs[0][real] = h[real].to(outs[0].dtype)
            return
        q, s = mg.swiglu_quant_reference(h, limit)
        outs[0][real] = q[real]
        outs[1][:, real] = s[real].T

    return swab


def _check_abi(key: KernelKey, *pairs) -> None:
    """The compiled kernels reject operands of other shapes (TileLang's packed ABI check); so do the stand-ins.
    None in a key's shape: a symbolic dim (any size)."""
    for i, (t, shape) in enumerate(pairs):
        if len(t.shape) != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
            raise RuntimeError(f"kernel {key.describe()} operand {i}: shape {tuple(t.shape)}, expected {tuple(shape)}")
