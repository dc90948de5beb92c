"""RMSNorm, optionally fused with per-token-group FP8 quantisation (ue8m0 power-of-two scales).

    y = bf16( w ⊙ x · rsqrt(mean(x²) + eps) )             computed in fp32 (MODEL_SPEC §2)
    quant: per group of `group` channels of y (bf16-rounded, as the unfused model would see it)
        s = 2^ceil(log2(amax / 448)),  q = fp8_e4m3(y / s)  (MODEL_SPEC §4.2)

The quantised output feeds fp8_gemm directly: scales are written MN-major, S [D/group, M].
One CTA normalises `block_m` rows held in registers: the kernel reads x once and writes q (+ s) once,
so it is purely bandwidth-bound.
"""

import functools
from dataclasses import dataclass

import torch

try:  # optional: the Triton variant; tl must be a module global so the interpreter can patch it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

from deepinfer.codegen.kernels._common import FP8_MAX, Mem, ceil_div, ue8m0_scale

FAMILY = "rmsnorm_quant"


@dataclass(frozen=True)
class Config:
    block_m: int = 1
    threads: int = 128


def padded_width(D: int, group: int = 32) -> int:
    """D rounded up to a power-of-two number of groups (see row_width: the quantising program at block_m > 1).

    TileLang lays the row fragments out from their shapes, and its cross-thread reduces (XOR butterfly)
    need a power-of-two number of threads per reduced row: with D/group groups not a power of two (D=1280:
    40 groups of 32) some (block_m > 1, threads) pairs of the quantising program got 40-thread group reduces and
    failed to lower. Padding the row with zeros to a power-of-two group count keeps every extent a power of two;
    zeros change neither the sum of squares nor a group's amax, and the padded columns are never stored.
    """
    g = ceil_div(D, group)
    return (1 << (g - 1).bit_length()) * group


def row_width(D: int, group: int, block_m: int, quant: bool) -> int:
    """The row width the CUDA program holds: D itself for one row a CTA or without the quantisation (every such
    config lowers at D = 512..7168, including 40 groups at 1280: session 12's sweep), else `padded_width`.
    The padded program's row loads are scalar and clamped (min(j, D - 1)): at D=5120 (160 groups padded to 256)
    it ran 161.6 us against ~38 us unpadded on the H200 for 4096 rows (session 12 call 1)."""
    return D if block_m == 1 or not quant else padded_width(D, group)


def config_space(M: int, D: int, group: int = 32, quant: bool = True) -> list[Config]:
    """The configs whose row fragments fit (a thread holds at most 160 fp32 elements of each) -- only the unpadded
    ones (row_width == D) when there are any: on the H200 at 4096 x 5120 (session 12 call 2) the quantising
    program's padded multi-row configs took 114-178 us, its one-row ones 37.9-49.5 us."""

    def fits(bm: int, t: int) -> bool:
        w = row_width(D, group, bm, quant)
        return bm * w // t <= 160 and bm * w % t == 0

    space = [Config(bm, t) for bm in (1, 2, 4) for t in (128, 256, 512) if fits(bm, t)]
    unpadded = [c for c in space if row_width(D, group, c.block_m, quant) == D]
    return unpadded or space


def program(M: int, D: int, *, group: int, quant: bool, eps: float, target: str, cfg: Config = Config(),
            io: str = ""):  # fmt: skip
    """prim_func(X [M, D], W [D] fp32, outputs): quant → (Q [M, D] fp8, S [D/group, M] fp32), else Y.

    io "float32": X (and Y) are fp32 in memory, with the bf16 kernel's numbers (X rounded to bf16 on load, Y the
    bf16-rounded value widened): the graph's fp32 activations without a cast launch on either side."""
    import tilelang.language as T

    bm, G = cfg.block_m, D // group
    assert D % group == 0
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"  # activation dtype; fp32 on CPU (numerics check)
    xdt = "float32" if io == "float32" else act  # X's and Y's dtype in memory
    qdt = "float32" if mem.cpu else "float8_e4m3fn"  # = torch.float8_e4m3fn (same DLPack code)
    Dp = row_width(D, group, bm, quant)  # row fragments are Dp wide (see row_width); columns >= D are zeros
    Gp = Dp // group

    @T.macro  # inlined into both prim_funcs below
    def normalise(X, W, bx, xf, rstd):
        """xf <- w ⊙ x · rstd, rounded to the activation dtype (then held in fp32); padding columns stay 0."""
        sq = mem.fragment((bm, Dp), "float32")
        ss = mem.fragment((bm,), "float32")
        for i, j in mem.par(bm, Dp):
            xv = X[bx * bm + i, T.min(j, D - 1)]
            xf[i, j] = T.if_then_else(j < D, T.cast(T.cast(xv, act) if xdt != act else xv, "float32"), 0.0)
            sq[i, j] = xf[i, j] * xf[i, j]
        T.reduce_sum(sq, ss, dim=1)
        for i in mem.par(bm):
            rstd[i] = T.rsqrt(ss[i] / D + eps)
        for i, j in mem.par(bm, Dp):
            xf[i, j] = T.cast(T.cast(xf[i, j] * rstd[i] * W[T.min(j, D - 1)], act), "float32")

    if not quant:

        @T.prim_func
        def rmsnorm(X: T.Tensor((M, D), xdt), W: T.Tensor((D,), "float32"), Y: T.Tensor((M, D), xdt)):
            with T.Kernel(T.ceildiv(M, bm), threads=cfg.threads) as bx:
                xf = mem.fragment((bm, Dp), "float32")
                rstd = mem.fragment((bm,), "float32")
                normalise(X, W, bx, xf, rstd)
                for i, j in mem.par(bm, Dp):
                    if j < D:
                        Y[bx * bm + i, j] = T.cast(xf[i, j], xdt)  # (xf is already act-rounded)

        return rmsnorm

    @T.prim_func
    def rmsnorm_quant(
        X: T.Tensor((M, D), xdt),
        W: T.Tensor((D,), "float32"),
        Q: T.Tensor((M, D), qdt),
        S: T.Tensor((G, M), "float32"),
    ):
        with T.Kernel(T.ceildiv(M, bm), threads=cfg.threads) as bx:
            xf = mem.fragment((bm, Dp), "float32")
            rstd = mem.fragment((bm,), "float32")
            normalise(X, W, bx, xf, rstd)
            xg = mem.fragment((bm, Gp, group), "float32")
            amax = mem.fragment((bm, Gp), "float32")
            for i, g, c in mem.par(bm, Gp, group):
                xg[i, g, c] = xf[i, g * group + c]
            T.reduce_absmax(xg, amax, dim=2)
            for i, g in mem.par(bm, Gp):
                # ue8m0: power-of-two scale so dequantisation is an exponent add
                amax[i, g] = T.exp2(T.ceil(T.log2(T.max(amax[i, g], 1e-30) / FP8_MAX)))
                if g < G:
                    S[g, bx * bm + i] = amax[i, g]
            for i, g, c in mem.par(bm, Gp, group):
                if g < G:
                    v = T.clamp(xg[i, g, c] / amax[i, g], -FP8_MAX, FP8_MAX)
                    Q[bx * bm + i, g * group + c] = T.cast(v, qdt)

    return rmsnorm_quant


# ---------------------------------------------------------------------------------------------- triton


@functools.lru_cache(maxsize=2)
def _triton_kernel(interpret: bool):
    """Built lazily (and per interpreter mode, which triton fixes at decoration time)."""
    if triton is None:
        raise ImportError("triton is not installed (pip install deepinfer[codegen])")

    @triton.jit
    def rmsnorm_quant_kernel(
        x_ptr,
        w_ptr,
        q_ptr,
        s_ptr,
        M,
        D,
        eps,
        ROUND_BF16: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):
        # one program per token; the row is held as [groups, GROUP] so group amax is one axis reduce
        row = tl.program_id(0)
        g = tl.arange(0, BLOCK_G)[:, None]
        c = tl.arange(0, GROUP)[None, :]
        mask = g < G
        offs = g * GROUP + c
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)  # upcast: bf16 is unsafe
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        rstd = tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)
        y = x * rstd * w
        if ROUND_BF16:
            y = y.to(tl.bfloat16).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-30)
        scale = tl.exp2(tl.ceil(tl.log2(amax / 448.0)))
        q = tl.clamp(y / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + row * D + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + tl.arange(0, BLOCK_G) * M + row, scale, mask=tl.arange(0, BLOCK_G) < G)

    return rmsnorm_quant_kernel


def triton_rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float, group: int, out_dtype=None):
    """Triton RMSNorm + FP8 group quant: returns (q [M, D], s [D/group, M] MN-major).

    `out_dtype` defaults to float8_e4m3fn on CUDA and float32 under the CPU interpreter.
    """
    import os

    M, D = x.shape
    G = D // group
    if out_dtype is None:
        out_dtype = torch.float8_e4m3fn if x.is_cuda else torch.float32
    q = torch.empty(M, D, dtype=out_dtype, device=x.device)
    s = torch.empty(G, M, dtype=torch.float32, device=x.device)
    kernel = _triton_kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(M,)](
        x,
        w,
        q,
        s,
        M,
        D,
        eps,
        ROUND_BF16=x.dtype == torch.bfloat16,
        G=G,
        GROUP=group,
        BLOCK_G=triton.next_power_of_2(G),
    )
    return q, s


# ---------------------------------------------------------------------------------------------- reference


def reference(x: torch.Tensor, w: torch.Tensor, eps: float, group: int | None = None):
    """Torch reference: y, or (q fp8 [M, D], s fp32 [M, D/group]) when `group` is given."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    if group is None:
        return y
    M, D = x.shape
    yg = y.float().view(M, D // group, group)
    s = ue8m0_scale(yg.abs().amax(-1))
    q = (yg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, D), s


def reference_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Independent oracle for the norm: float64, written from the formula, RMS via the 2-norm."""
    x64 = x.double()
    rms = torch.linalg.vector_norm(x64, dim=-1, keepdim=True) / x.shape[-1] ** 0.5
    return x64 / torch.sqrt(rms**2 + eps) * w.double()


def roofline(M: int, D: int, group: int | None, act_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): read x and w, write y (or q + scales)."""
    out = M * D * act_bytes if group is None else M * D + 4 * M * ceil_div(D, group)
    return float(M * D * act_bytes + 4 * D + out), float(4 * M * D)


# ---------------------------------------------------------------------------------------------- ascend


def ascend_program(M: int, D: int, *, eps: float, block_m: int = 4, num_cores: int = 32):
    """Ascend 950 RMSNorm (vector cores only): SIMT squares, SIMD row reduction, SIMT scale.

    Rows are distributed persistently over `num_cores`; a block of rows lives in the Unified Buffer.
    """
    import tilelang.ascend.language as T

    bm = block_m
    assert M % bm == 0

    @T.prim_func
    def rmsnorm_ascend(X: T.Tensor((M, D), "bfloat16"), W: T.Tensor((D,), "float32"), Y: T.Tensor((M, D), "bfloat16")):
        with T.Kernel(num_cores) as bx:
            x_ub = T.alloc_shared((bm, D), "bfloat16")
            w_ub = T.alloc_shared((D,), "float32")
            sq = T.alloc_shared((bm, D), "float32")
            ss = T.alloc_shared((bm,), "float32")
            T.copy(W, w_ub)
            for tile in T.Persistent([M // bm], num_cores, bx):
                T.copy(X[tile * bm, 0], x_ub)
                with T.SimtVF(threads=128):
                    for i, j in T.Parallel(bm, D):
                        sq[i, j] = T.cast(x_ub[i, j], "float32") * T.cast(x_ub[i, j], "float32")
                with T.SimdVF():
                    T.reduce_sum(sq, ss, dim=1)  # lowered to vector reduce intrinsics (vcadd)
                with T.SimtVF(threads=128):
                    for i, j in T.Parallel(bm, D):
                        xf = T.cast(x_ub[i, j], "float32")
                        x_ub[i, j] = T.cast(xf * T.rsqrt(ss[i] / D + eps) * w_ub[j], "bfloat16")
                T.copy(x_ub, Y[tile * bm, 0])

    return rmsnorm_ascend
