"""Sparse attention decode with the attention sink (MODEL_SPEC §2.10), MQA over gathered KV rows.

One query token per request, H heads sharing one 512-d KV row per entry (K = V):
    ℓ_hj = (q_h · kv_j) · d^-0.5                         j over the request's selected entries
    p_hj = exp(ℓ_hj − m_h) / (Σ_j exp(ℓ_hj − m_h) + exp(sink_h − m_h))
    o_h  = Σ_j p_hj · kv_j
Entries are physical KV-pool rows listed in Idx [B, topk] (window + selected compressed rows), −1 =
invalid. Because all heads share the KV, one CTA takes every head of a request: each KV row is read
from HBM once, QKᵀ and PV are [H x block] x [block x d] tensor-core GEMMs, and the softmax is online
over blocks (flash-decoding with a sink).

Small batches leave most SMs idle with one CTA per request, so `num_split` > 1 cuts each request's entries
into chunks (split-K): one CTA per (chunk, request) writes its unnormalised fp32 output with its running
max and sum, and a second kernel folds the chunks together with the sink (exactly: a chunk of only -1
entries has weight 0). `stages` = 2 pipelines the KV gather of the next block under the math.
Not yet here: FP8 KV, fused q-norm/RoPE and the inverse RoPE of o's last 64 dims.
"""

from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem

FAMILY = "sparse_attn_decode"


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    threads: int = 256
    num_split: int = 1  # split-K: the request's entries are cut into this many chunks, one CTA each
    stages: int = 1  # software pipeline depth of the KV gather (2: the next block's rows load during the math)

    @property
    def tag(self) -> str:
        return f"n{self.block_n}t{self.threads}s{self.stages}" + (f"x{self.num_split}" if self.num_split > 1 else "")


def config_space(B: int, topk: int) -> list[Config]:
    out = [Config(bn, t) for bn in (32, 64) for t in (128, 256) if topk % bn == 0]
    for ns in (1, 2, 4, 5, 10):
        out += [Config(bn, 256, ns, 2) for bn in (32, 64) if topk % (ns * bn) == 0]
    return out


def sm90_config(B: int, topk: int, num_sms: int = 132) -> Config:
    """The fewest splits with B x num_split CTAs covering ~90% of the SMs (chunks of at least 32 entries):
    each split adds B x H x D fp32 of scratch written and read back by the combine."""
    bn = 32
    ns = 1
    for cand in (1, 2, 4, 5, 10, 20):
        if topk % (cand * bn) == 0:
            ns = cand
            if B * cand >= 0.9 * num_sms:
                break
    return Config(bn, 256, ns, 2)


def program(B: int, H: int, D: int, S: int, topk: int, *, target: str, cfg: Config = Config()):
    """prim_func(Q [B, H, D] act, KV [S, D] act, Idx [B, topk] int32, Sink [H] f32, O [B, H, D] act).

    With cfg.num_split > 1 this is the first of two kernels (`split_programs`), and its signature is
    (Q, KV, Idx, Op [B, ns, H, D] f32, Mp [B, ns, H] f32, Lp [B, ns, H] f32): each CTA writes its chunk's
    unnormalised output, running max and sum; `combine_program` folds the chunks and the sink.
    """
    import tilelang.language as T

    bn, ns = cfg.block_n, cfg.num_split
    assert topk % (bn * ns) == 0
    chunk = topk // ns
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    scale = D**-0.5
    NEG = -3.0e38

    @T.macro
    def body(Q, KV, Idx, b, sp, q_s, kv_s, p_s, s, o, m, m_new, l_blk, l):
        T.copy(Q[b, 0, 0], q_s)
        T.clear(o)
        T.clear(l)
        T.fill(m, NEG)
        for blk in T.Pipelined(chunk // bn, num_stages=cfg.stages):
            for r, d in mem.par(bn, D):  # gather: rows are arbitrary pool slots (no TMA box)
                kv_s[r, d] = KV[T.max(Idx[b, sp * chunk + blk * bn + r], 0), d]
            T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True)
            for h, j in mem.par(H, bn):
                s[h, j] = T.if_then_else(Idx[b, sp * chunk + blk * bn + j] >= 0, s[h, j] * scale, NEG)
            T.reduce_max(s, m_new, dim=1, clear=True)
            for h in mem.par(H):
                m_new[h] = T.max(m_new[h], m[h])
            for h, d in mem.par(H, D):  # rescale the running output to the new max
                o[h, d] = o[h, d] * T.exp(m[h] - m_new[h])
            for h, j in mem.par(H, bn):
                # -1 entries weigh exactly 0, even while every entry so far is invalid (m_new = NEG)
                s[h, j] = T.if_then_else(
                    Idx[b, sp * chunk + blk * bn + j] >= 0, T.exp(s[h, j] - m_new[h]), T.float32(0)
                )
            T.reduce_sum(s, l_blk, dim=1)
            for h in mem.par(H):
                l[h] = l[h] * T.exp(m[h] - m_new[h]) + l_blk[h]
                m[h] = m_new[h]
            T.copy(s, p_s)
            T.gemm(p_s, kv_s, o)  # V = K: the same gathered rows

    def allocs():
        return (
            mem.shared((H, D), act),
            mem.shared((bn, D), act),
            mem.shared((H, bn), act),
            mem.fragment((H, bn), "float32"),
            mem.fragment((H, D), "float32"),
            mem.fragment((H,), "float32"),
            mem.fragment((H,), "float32"),
            mem.fragment((H,), "float32"),
            mem.fragment((H,), "float32"),
        )

    if ns == 1:

        @T.prim_func
        def sparse_attn_decode(
            Q: T.Tensor((B, H, D), act),
            KV: T.Tensor((S, D), act),
            Idx: T.Tensor((B, topk), "int32"),
            Sink: T.Tensor((H,), "float32"),
            O: T.Tensor((B, H, D), act),
        ):
            with T.Kernel(B, threads=cfg.threads) as b:
                q_s, kv_s, p_s, s, o, m, m_new, l_blk, l = allocs()
                body(Q, KV, Idx, b, 0, q_s, kv_s, p_s, s, o, m, m_new, l_blk, l)
                for h, d in mem.par(H, D):
                    # the sink joins the denominator only (it has no value row)
                    O[b, h, d] = T.cast(o[h, d] / (l[h] + T.exp(Sink[h] - m[h])), act)

        return sparse_attn_decode

    @T.prim_func
    def sparse_attn_decode_split(
        Q: T.Tensor((B, H, D), act),
        KV: T.Tensor((S, D), act),
        Idx: T.Tensor((B, topk), "int32"),
        Op: T.Tensor((B, ns, H, D), "float32"),
        Mp: T.Tensor((B, ns, H), "float32"),
        Lp: T.Tensor((B, ns, H), "float32"),
    ):
        with T.Kernel(ns, B, threads=cfg.threads) as (sp, b):
            q_s, kv_s, p_s, s, o, m, m_new, l_blk, l = allocs()
            body(Q, KV, Idx, b, sp, q_s, kv_s, p_s, s, o, m, m_new, l_blk, l)
            T.copy(o, Op[b, sp, 0, 0])
            for h in mem.par(H):
                Mp[b, sp, h] = m[h]
                Lp[b, sp, h] = l[h]

    return sparse_attn_decode_split


def combine_program(B: int, H: int, D: int, num_split: int, *, target: str, threads: int = 128):
    """prim_func(Op, Mp, Lp, Sink, O): O[b, h] = Σ_s e^(m_s − M) o_s / (Σ_s e^(m_s − M) l_s + e^(sink − M)),
    M = max(max_s m_s, sink). A chunk with no valid entry has m_s = NEG, l_s = 0, o_s = 0: weight exactly 0."""
    import tilelang.language as T

    ns = num_split
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"

    @T.prim_func
    def sparse_attn_combine(
        Op: T.Tensor((B, ns, H, D), "float32"),
        Mp: T.Tensor((B, ns, H), "float32"),
        Lp: T.Tensor((B, ns, H), "float32"),
        Sink: T.Tensor((H,), "float32"),
        O: T.Tensor((B, H, D), act),
    ):
        with T.Kernel(H, B, threads=threads) as (h, b):
            mx = T.alloc_local((1,), "float32")
            den = T.alloc_local((1,), "float32")
            acc = mem.fragment((D,), "float32")
            mx[0] = Sink[h]
            for sp in T.serial(ns):
                mx[0] = T.max(mx[0], Mp[b, sp, h])
            den[0] = T.exp(Sink[h] - mx[0])
            for sp in T.serial(ns):
                den[0] = den[0] + Lp[b, sp, h] * T.exp(Mp[b, sp, h] - mx[0])
            for d in mem.par(D):
                acc[d] = 0.0
            for sp in T.serial(ns):
                for d in mem.par(D):
                    acc[d] = acc[d] + Op[b, sp, h, d] * T.exp(Mp[b, sp, h] - mx[0])
            for d in mem.par(D):
                O[b, h, d] = T.cast(acc[d] / den[0], act)

    return sparse_attn_combine


def split_programs(B: int, H: int, D: int, S: int, topk: int, *, target: str, cfg: Config):
    """(partial, combine) prim_funcs for cfg.num_split > 1; `run_split` calls them in order."""
    assert cfg.num_split > 1
    return (
        program(B, H, D, S, topk, target=target, cfg=cfg),
        combine_program(B, H, D, cfg.num_split, target=target),
    )


def run_split(kernels, q, kv, idx, sink, out, num_split: int, scratch=None):
    """Launch the split pair; `scratch` (Op, Mp, Lp) can be passed to skip the allocations."""
    B, H, D = q.shape
    if scratch is None:
        scratch = (
            torch.empty(B, num_split, H, D, device=q.device, dtype=torch.float32),
            torch.empty(B, num_split, H, device=q.device, dtype=torch.float32),
            torch.empty(B, num_split, H, device=q.device, dtype=torch.float32),
        )
    op, mp, lp = scratch
    kernels[0](q, kv, idx, op, mp, lp)
    kernels[1](op, mp, lp, sink, out)
    return out


# ---------------------------------------------------------------------------------------------- reference


def reference(q, kv, idx, sink) -> torch.Tensor:
    """Torch reference: softmax over [selected entries ; sink] per head, sink column dropped."""
    B, H, D = q.shape
    rows = kv[idx.clamp_min(0).long()].float()  # [B, topk, D]
    logits = torch.einsum("bhd,bjd->bhj", q.float(), rows) * D**-0.5
    logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    full = torch.cat([logits, sink.float().view(1, H, 1).expand(B, H, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("bhj,bjd->bhd", p, rows).to(q.dtype)


def reference_f64_loops(q, kv, idx, sink) -> torch.Tensor:
    """Independent oracle: per (request, head) loops in float64 over the valid entries only."""
    B, H, D = q.shape
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        valid = [int(i) for i in idx[b] if i >= 0]
        rows = kv[valid].double()
        for h in range(H):
            lg = rows @ q[b, h].double() / D**0.5
            mx = max(lg.max().item(), float(sink[h]))
            w = torch.exp(lg - mx)
            out[b, h] = (w[:, None] * rows).sum(0) / (w.sum() + torch.exp(torch.tensor(float(sink[h]) - mx)))
    return out


def roofline(B: int, H: int, D: int, topk: int, kv_bytes: int = 2, act_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): each selected KV row once per request, q and o once; QKᵀ + PV."""
    return float(B * (topk * (D * kv_bytes + 4) + 2 * H * D * act_bytes)), float(4 * B * H * topk * D)
