"""MoE routing: sqrtsoftplus scores, bias-corrected top-k selection, normalised and scaled weights.

    score = sqrt(softplus(logits))                       logits = x @ W_gateᵀ, fp32 [T, E]
    idx   = topk(score + bias, k)                        the bias only steers selection
    w     = score[idx] / Σ score[idx] · route_scale      (MODEL_SPEC §2.12; V4.1: E=384, k=6, scale 1.5)

The kernel does k rounds of (row max, lowest index attaining it, mask it out) over the E scores held
in registers: for k=6 and E=384 that beats a sort and gives a defined tie rule (lowest expert id),
which the reference reproduces so the comparison is exact.
"""

import functools
from dataclasses import dataclass

import torch

try:  # optional: the Triton variant; tl must be a module global so the interpreter can patch it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

FAMILY = "moe_routing"


@dataclass(frozen=True)
class Config:
    block_m: int = 1
    threads: int = 128


def config_space(T_: int, E: int) -> list[Config]:
    return [Config(bm, t) for bm in (1, 2, 4, 8) for t in (32, 64, 128, 256) if bm * E >= t]


def program(T_: int, E: int, *, topk: int, route_scale: float, target: str, cfg: Config = Config()):
    """prim_func(L [T, E] fp32, B [E] fp32, Idx [T, k] int32, Wt [T, k] fp32)."""
    import tilelang.language as T

    from deepinfer.codegen.kernels._common import Mem

    bm = cfg.block_m
    mem = Mem(target)
    NEG = -3.0e38

    @T.prim_func
    def moe_routing(
        L: T.Tensor((T_, E), "float32"),
        Bias: T.Tensor((E,), "float32"),
        Idx: T.Tensor((T_, topk), "int32"),
        Wt: T.Tensor((T_, topk), "float32"),
    ):
        with T.Kernel(T.ceildiv(T_, bm), threads=cfg.threads) as bx:
            score = mem.fragment((bm, E), "float32")
            sel = mem.fragment((bm, E), "float32")
            cand = mem.fragment((bm, E), "float32")
            best = mem.fragment((bm,), "float32")
            pick = mem.fragment((bm,), "float32")
            wsel = mem.shared((bm, topk), "float32")
            isel = mem.shared((bm, topk), "int32")
            wsum = mem.fragment((bm,), "float32")
            T.clear(wsum)
            for i, e in mem.par(bm, E):
                v = L[bx * bm + i, e]
                # stable softplus: max(v, 0) + log(1 + exp(-|v|)); min(v, -v) = -|v| also on the C target,
                # whose codegen has no fabs/log1p (the absolute error of log(1+t) is ~1 ulp of 1)
                score[i, e] = T.sqrt(T.max(v, 0.0) + T.log(1.0 + T.exp(T.min(v, -v))))
                sel[i, e] = score[i, e] + Bias[e]
            for j in T.serial(topk):
                T.reduce_max(sel, best, dim=1)
                for i, e in mem.par(bm, E):
                    cand[i, e] = T.if_then_else(sel[i, e] == best[i], T.cast(e, "float32"), 1.0e9)
                T.reduce_min(cand, pick, dim=1)  # lowest expert id among ties
                for i, e in mem.par(bm, E):
                    cand[i, e] = T.if_then_else(T.cast(e, "float32") == pick[i], score[i, e], 0.0)
                    sel[i, e] = T.if_then_else(T.cast(e, "float32") == pick[i], NEG, sel[i, e])
                T.reduce_sum(cand, best, dim=1)  # the picked expert's unbiased score
                for i in mem.par(bm):
                    wsel[i, j] = best[i]
                    wsum[i] += best[i]
                    isel[i, j] = T.cast(pick[i], "int32")
            for i, j in mem.par(bm, topk):
                Wt[bx * bm + i, j] = wsel[i, j] / wsum[i] * route_scale
                Idx[bx * bm + i, j] = isel[i, j]

    return moe_routing


# ---------------------------------------------------------------------------------------------- triton


@functools.lru_cache(maxsize=2)
def _triton_kernel(interpret: bool):
    """Built lazily (and per interpreter mode, which triton fixes at decoration time)."""
    if triton is None:
        raise ImportError("triton is not installed (pip install deepinfer[codegen])")

    @triton.jit
    def moe_routing_kernel(
        l_ptr,
        b_ptr,
        idx_ptr,
        w_ptr,
        E,
        route_scale,
        TOPK: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # one program per token; same k rounds of (max, lowest id, mask) as the TileLang kernel
        row = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        v = tl.load(l_ptr + row * E + e, mask=valid, other=0.0)
        score = tl.sqrt(tl.maximum(v, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(v))))
        sel = tl.where(valid, score + tl.load(b_ptr + e, mask=valid, other=0.0), -float("inf"))
        kk = tl.arange(0, BLOCK_K)
        ws = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOPK):
            best = tl.max(sel, axis=0)
            pick = tl.min(tl.where(sel == best, e, BLOCK_E), axis=0)
            wj = tl.sum(tl.where(e == pick, score, 0.0), axis=0)
            ws = tl.where(kk == j, wj, ws)
            ids = tl.where(kk == j, pick, ids)
            sel = tl.where(e == pick, -float("inf"), sel)
        ws = ws / tl.sum(ws, axis=0) * route_scale
        out = kk < TOPK
        tl.store(w_ptr + row * TOPK + kk, ws, mask=out)
        tl.store(idx_ptr + row * TOPK + kk, ids, mask=out)

    return moe_routing_kernel


def triton_moe_routing(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Triton routing: (idx int32 [T, k], weights fp32 [T, k]); logits fp32 [T, E]."""
    import os

    T_, E = logits.shape
    idx = torch.empty(T_, topk, dtype=torch.int32, device=logits.device)
    w = torch.empty(T_, topk, dtype=torch.float32, device=logits.device)
    kernel = _triton_kernel(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(T_,)](
        logits,
        bias,
        idx,
        w,
        E,
        route_scale,
        TOPK=topk,
        BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(topk),
    )
    return idx, w


# ---------------------------------------------------------------------------------------------- reference


def reference(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Torch reference: (idx int32 [T, k], weights fp32 [T, k]); ties go to the lowest expert id."""
    score = torch.sqrt(torch.nn.functional.softplus(logits.float()))
    sel = score + bias.float()
    # a stable descending sort breaks ties by position, i.e. lowest id first, like the kernel
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = score.gather(-1, idx)
    return idx.to(torch.int32), w / w.sum(-1, keepdim=True) * route_scale


def reference_f64(logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Independent oracle: float64, softplus from its definition, selection by full argsort per row."""
    s = torch.sqrt(torch.log(1.0 + torch.exp(logits.double())))
    order = torch.argsort(-(s + bias.double()), dim=-1, stable=True)[:, :topk]
    w = torch.stack([s[t, order[t]] for t in range(s.shape[0])])
    return order, w / w.sum(-1, keepdim=True) * route_scale


def roofline(T_: int, E: int, topk: int) -> tuple[float, float]:
    """(bytes, flops): read logits and bias, write ids and weights; ~8 flops per score per round."""
    return float(4 * T_ * E + 4 * E + 8 * T_ * topk), float(T_ * E * (6 + 4 * topk))


# ---------------------------------------------------------------------------------------------- ascend


def ascend_program(T_: int, E: int, *, topk: int, route_scale: float, block_m: int = 32, num_cores: int = 32):
    """Ascend 950 routing (vector cores): SIMT scores over all (token, expert) lanes, then one SIMT
    thread per token runs the k selection rounds over its row in the Unified Buffer (strict `>` keeps
    the lowest expert id on ties, like the CUDA kernel)."""
    import tilelang.ascend.language as T

    bm, NEG = block_m, -3.0e38
    assert T_ % bm == 0 and bm % 32 == 0

    @T.prim_func
    def moe_routing_ascend(
        L: T.Tensor((T_, E), "float32"),
        Bias: T.Tensor((E,), "float32"),
        Idx: T.Tensor((T_, topk), "int32"),
        Wt: T.Tensor((T_, topk), "float32"),
    ):
        with T.Kernel(num_cores) as bx:
            score = T.alloc_shared((bm, E), "float32")
            sel = T.alloc_shared((bm, E), "float32")
            b_ub = T.alloc_shared((E,), "float32")
            w_ub = T.alloc_shared((bm, topk), "float32")
            i_ub = T.alloc_shared((bm, topk), "int32")
            T.copy(Bias, b_ub)
            for tile in T.Persistent([T_ // bm], num_cores, bx):
                T.copy(L[tile * bm, 0], score)
                with T.SimtVF(threads=128):
                    for i, e in T.Parallel(bm, E):
                        v = score[i, e]
                        score[i, e] = T.sqrt(T.max(v, 0.0) + T.log(1.0 + T.exp(T.min(v, -v))))
                        sel[i, e] = score[i, e] + b_ub[e]
                with T.SimtVF(threads=bm):  # exactly one thread per token row
                    for i in T.Parallel(bm):
                        tot = T.alloc_var("float32", init=0.0)
                        for j in T.serial(topk):
                            best = T.alloc_var("float32", init=NEG)
                            arg = T.alloc_var("int32", init=0)
                            for e in T.serial(E):
                                if sel[i, e] > best:
                                    best = sel[i, e]
                                    arg = e
                            sel[i, arg] = NEG
                            i_ub[i, j] = arg
                            w_ub[i, j] = score[i, arg]
                            tot = tot + score[i, arg]
                        for j in T.serial(topk):
                            w_ub[i, j] = w_ub[i, j] / tot * route_scale
                T.copy(w_ub, Wt[tile * bm, 0])
                T.copy(i_ub, Idx[tile * bm, 0])

    return moe_routing_ascend
