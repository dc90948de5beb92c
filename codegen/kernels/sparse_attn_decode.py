"""Sparse attention decode with the attention sink (MODEL_SPEC §2.10), MQA over gathered KV rows.

One query token per request, H heads sharing one 512-d KV row per entry (K = V):
    ℓ_hj = (q_h · kv_j) · d^-0.5                         j over the request's selected entries
    p_hj = exp(ℓ_hj − m_h) / (Σ_j exp(ℓ_hj − m_h) + exp(sink_h − m_h))
    o_h  = Σ_j p_hj · kv_j
Entries are physical KV-pool rows listed in Idx [B, topk] (window + selected compressed rows), −1 =
invalid. Because all heads share the KV, one CTA takes every head of a request: each KV row is read
from HBM once, QKᵀ and PV are [H x block] x [block x d] tensor-core GEMMs, and the softmax is online
over blocks (flash-decoding with a sink). Not yet here: FP8 KV, fused q-norm/RoPE and the inverse RoPE
of o's last 64 dims, and split-K over long index lists for small batches.
"""

from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem

FAMILY = "sparse_attn_decode"


@dataclass(frozen=True)
class Config:
    block_n: int = 64
    threads: int = 256


def config_space(B: int, topk: int) -> list[Config]:
    return [Config(bn, t) for bn in (32, 64) for t in (128, 256) if topk % bn == 0]


def program(B: int, H: int, D: int, S: int, topk: int, *, target: str, cfg: Config = Config()):
    """prim_func(Q [B, H, D] act, KV [S, D] act, Idx [B, topk] int32, Sink [H] f32, O [B, H, D] act)."""
    import tilelang.language as T

    bn = cfg.block_n
    assert topk % bn == 0
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    scale = D**-0.5
    NEG = -3.0e38

    @T.prim_func
    def sparse_attn_decode(
        Q: T.Tensor((B, H, D), act),
        KV: T.Tensor((S, D), act),
        Idx: T.Tensor((B, topk), "int32"),
        Sink: T.Tensor((H,), "float32"),
        O: T.Tensor((B, H, D), act),
    ):
        with T.Kernel(B, threads=cfg.threads) as b:
            q_s = mem.shared((H, D), act)
            kv_s = mem.shared((bn, D), act)
            p_s = mem.shared((H, bn), act)
            s = mem.fragment((H, bn), "float32")
            o = mem.fragment((H, D), "float32")
            m = mem.fragment((H,), "float32")
            m_new = mem.fragment((H,), "float32")
            l_blk = mem.fragment((H,), "float32")
            l = mem.fragment((H,), "float32")
            T.copy(Q[b, 0, 0], q_s)
            T.clear(o)
            T.clear(l)
            T.fill(m, NEG)
            for blk in T.Pipelined(topk // bn, num_stages=1):
                for r, d in mem.par(bn, D):  # gather: rows are arbitrary pool slots (no TMA box)
                    kv_s[r, d] = KV[T.max(Idx[b, blk * bn + r], 0), d]
                T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True)
                for h, j in mem.par(H, bn):
                    s[h, j] = T.if_then_else(Idx[b, blk * bn + j] >= 0, s[h, j] * scale, NEG)
                T.reduce_max(s, m_new, dim=1, clear=True)
                for h in mem.par(H):
                    m_new[h] = T.max(m_new[h], m[h])
                for h, d in mem.par(H, D):  # rescale the running output to the new max
                    o[h, d] = o[h, d] * T.exp(m[h] - m_new[h])
                for h, j in mem.par(H, bn):
                    s[h, j] = T.exp(s[h, j] - m_new[h])
                T.reduce_sum(s, l_blk, dim=1)
                for h in mem.par(H):
                    l[h] = l[h] * T.exp(m[h] - m_new[h]) + l_blk[h]
                    m[h] = m_new[h]
                T.copy(s, p_s)
                T.gemm(p_s, kv_s, o)  # V = K: the same gathered rows
            for h, d in mem.par(H, D):
                # the sink joins the denominator only (it has no value row)
                O[b, h, d] = T.cast(o[h, d] / (l[h] + T.exp(Sink[h] - m[h])), act)

    return sparse_attn_decode


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
