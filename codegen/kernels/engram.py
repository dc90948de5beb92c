"""Engram gather and gate (MODEL_SPEC §2.14).

Gather (`embed_program`): 24 row ids per token into the FP8 E4M3 table E [R, 256] with one ue8m0 scale
per 32 values (S [R, 8], the exponent byte), dequantised and concatenated:

    M[t, k*hd + c] = float(E[id[t, k], c]) * 2^(S[id[t, k], c // 32] - 127)          M [T, 24*256] fp32

Gate (`gate_program`): per token t and stream i (n = 4 streams of D), with kv = M @ wkv^T = n keys | value:

    dot_i = sum_d X_i[d] * QK[i, d] * key_i[d] * rsqrt(ms(X_i)+eps) * rsqrt(ms(key_i)+eps) * D^-0.5
    g_i   = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, clamp)))                         (sign + at 0)
    X_i  <- X_i + g_i * value               rows whose token is the image token are left unchanged

QK = q_weight * k_weight is folded once at load time (both are constant weights). All statistics are fp32.
Both kernels are memory-bound: the gather reads 24 * (256 + 8) bytes per token and writes 24 KiB of fp32;
the gate reads X twice (the second read hits L2), kv once, and writes X once. One CTA per `block_t` tokens
for the gather; one CTA per token for the gate, which walks D in `block_d` chunks.
"""

from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem

FAMILY = "engram"
HEAD_DIM, SCALE_GROUP = 256, 32


@dataclass(frozen=True)
class EmbedConfig:
    block_t: int = 2  # tokens per CTA
    threads: int = 256


@dataclass(frozen=True)
class GateConfig:
    block_d: int = 1024  # channels per pass over a stream
    threads: int = 256


def embed_config_space(T_: int) -> list[EmbedConfig]:
    return [EmbedConfig(bt, th) for bt in (1, 2, 4) for th in (128, 256, 512)]


def gate_config_space(D: int) -> list[GateConfig]:
    return [GateConfig(bd, th) for bd in (512, 1024, 2048) for th in (128, 256, 512) if D % bd == 0 and bd >= th]


def embed_program(T_: int | None, K: int, R: int | None, *, hd: int = HEAD_DIM, target: str,
                  cfg: EmbedConfig = EmbedConfig()):  # fmt: skip
    """prim_func(E [R, hd], S [R, hd/32] uint8, Ids [T, K] int32, M [T, K*hd] fp32).

    E is float8_e4m3 on CUDA; on the `c` target (no fp8 type) it is fp32 holding fp8-representable values.
    T_=None / R=None: the token count / the table's rows are symbolic (one build for every T and both tables;
    TileLang indexes the buffers in int64, so a 384M-row table stays addressable)."""
    import tilelang.language as T

    T_ = T.dynamic("T") if T_ is None else T_
    R = T.dynamic("R") if R is None else R
    mem = Mem(target)
    tab_dt = "float32" if mem.cpu else "float8_e4m3"
    ng, bt = hd // SCALE_GROUP, cfg.block_t

    @T.prim_func
    def engram_embed(
        E: T.Tensor((R, hd), tab_dt),
        S: T.Tensor((R, ng), "uint8"),
        Ids: T.Tensor((T_, K), "int32"),
        M: T.Tensor((T_, K * hd), "float32"),
    ):
        with T.Kernel(T.ceildiv(T_, bt), threads=cfg.threads) as bx:
            # tokens serially, (k, c) across the threads: a parallel nest over (bt, K, hd) fails TileLang 0.1.15's
            # layout inference for many (bt, threads) pairs at K*hd < 4096 (tiny/small presets)
            for t in T.serial(bt):
                for k, c in mem.par(K, hd):
                    tok = bx * bt + t
                    if tok < T_:
                        row = Ids[tok, k]
                        # 2^(s-127) exactly: exp2 of an integer-valued float
                        scale = T.exp2(T.cast(S[row, c // SCALE_GROUP], "float32") - 127.0)
                        M[tok, k * hd + c] = T.cast(E[row, c], "float32") * scale

    return engram_embed


def gate_program(T_: int | None, n: int, D: int, *, eps: float, clamp: float, image_token_id: int, target: str,
                 cfg: GateConfig = GateConfig()):  # fmt: skip
    """prim_func(X [T, n, D], KV [T, (n+1)*D] f32, QK [n, D] f32, Tok [T] int32, Y [T, n, D]).

    X/Y are bf16 on CUDA and fp32 on the `c` target; Y may alias X (each element is read before it is written).
    T_=None: the token count is symbolic (one CTA per token: one build for every T)."""
    import tilelang.language as T

    T_ = T.dynamic("T") if T_ is None else T_
    mem = Mem(target)
    dt = "float32" if mem.cpu else "bfloat16"
    bd = min(cfg.block_d, D)
    assert D % bd == 0
    nd, inv_d, inv_sqrt_d = D // bd, 1.0 / D, D**-0.5

    @T.prim_func
    def engram_gate(
        X: T.Tensor((T_, n, D), dt),
        KV: T.Tensor((T_, (n + 1) * D), "float32"),
        QK: T.Tensor((n, D), "float32"),
        Tok: T.Tensor((T_,), "int32"),
        Y: T.Tensor((T_, n, D), dt),
    ):
        with T.Kernel(T_, threads=cfg.threads) as bx:
            px = mem.fragment((n, bd), "float32")
            pk = mem.fragment((n, bd), "float32")
            pd = mem.fragment((n, bd), "float32")
            rx = mem.fragment((n,), "float32")
            rk = mem.fragment((n,), "float32")
            rd = mem.fragment((n,), "float32")
            sx = mem.shared((n,), "float32")
            sk = mem.shared((n,), "float32")
            sd = mem.shared((n,), "float32")
            gate = mem.shared((n,), "float32")
            for i in mem.par(n):
                sx[i] = 0.0
                sk[i] = 0.0
                sd[i] = 0.0
            for c in T.serial(nd):
                for i, j in mem.par(n, bd):
                    x = T.cast(X[bx, i, c * bd + j], "float32")
                    key = KV[bx, i * D + c * bd + j]
                    px[i, j] = x * x
                    pk[i, j] = key * key
                    pd[i, j] = x * QK[i, c * bd + j] * key
                T.reduce_sum(px, rx, dim=1)
                T.reduce_sum(pk, rk, dim=1)
                T.reduce_sum(pd, rd, dim=1)
                for i in mem.par(n):
                    sx[i] += rx[i]
                    sk[i] += rk[i]
                    sd[i] += rd[i]
            for i in mem.par(n):
                dot = sd[i] * T.rsqrt(sx[i] * inv_d + eps) * T.rsqrt(sk[i] * inv_d + eps) * inv_sqrt_d
                mag = T.sqrt(T.max(T.max(dot, -dot), clamp))
                sgn = T.if_then_else(dot < 0.0, -mag, mag)
                g = 1.0 / (1.0 + T.exp(-sgn))
                gate[i] = T.if_then_else(Tok[bx] == image_token_id, 0.0, g)
            for c in T.serial(nd):
                for i, j in mem.par(n, bd):
                    x = T.cast(X[bx, i, c * bd + j], "float32")
                    Y[bx, i, c * bd + j] = T.cast(x + gate[i] * KV[bx, n * D + c * bd + j], dt)

    return engram_gate


# ---------------------------------------------------------------------------------------------- references


def embed_reference(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Torch reference: gather rows and their exponent bytes, dequantise, concatenate -> fp32 [T, K*hd]."""
    rows = table[ids.long()].float()  # [T, K, hd]
    s = torch.exp2(scale[ids.long()].float() - 127.0)  # [T, K, hd/32]
    return (rows.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(1)


def embed_reference_f64(table, scale, ids) -> torch.Tensor:
    """Independent float64 oracle: one (token, slot) at a time, scale 2.0 ** (byte - 127) per channel."""
    T_, K = ids.shape
    hd = table.shape[1]
    out = torch.empty(T_, K * hd, dtype=torch.float64)
    chan_group = torch.arange(hd) // SCALE_GROUP
    for t in range(T_):
        for k in range(K):
            r = int(ids[t, k])
            mult = torch.tensor([2.0 ** (int(scale[r, g]) - 127) for g in chan_group.tolist()], dtype=torch.float64)
            out[t, k * hd : (k + 1) * hd] = table[r].double() * mult
    return out


def quantize_table(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, hd] -> (fp8 e4m3 [R, hd], uint8 ue8m0 exponent bytes [R, hd/32])."""
    from deepinfer.codegen.kernels._common import quant_fp8_groups

    q, s = quant_fp8_groups(w, SCALE_GROUP)
    return q, (torch.log2(s).round() + 127).to(torch.uint8)


def gate_reference(x, kv, qk, tokens, *, eps: float, clamp: float, image_token_id: int):
    """Torch reference with the folded QK weight; fp32 math, cast back to x's dtype."""
    T_, n, D = x.shape
    xf, kvf = x.float(), kv.float()
    key, value = kvf[:, : n * D].view(T_, n, D), kvf[:, n * D :]
    r = torch.rsqrt(xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (xf * qk.float() * key).sum(-1) * r * D**-0.5
    mag = dot.abs().clamp(min=clamp).sqrt()
    g = torch.sigmoid(torch.where(dot < 0, -mag, mag))
    g = torch.where((tokens.long() == image_token_id).unsqueeze(-1), torch.zeros_like(g), g)
    return (xf + g.unsqueeze(-1) * value.unsqueeze(1)).to(x.dtype)


def gate_reference_f64(x, kv, q_weight, k_weight, tokens, *, eps: float, clamp: float, image_token_id: int):
    """Independent float64 oracle, stream by stream, from the unfolded q and k weights."""
    T_, n, D = x.shape
    out = x.double().clone()
    for t in range(T_):
        if int(tokens[t]) == image_token_id:
            continue
        value = kv[t, n * D :].double()
        for i in range(n):
            xi, ki = x[t, i].double(), kv[t, i * D : (i + 1) * D].double()
            dot = float((xi * q_weight[i].double() * k_weight[i].double() * ki).sum())
            dot /= ((xi.pow(2).mean() + eps) ** 0.5 * (ki.pow(2).mean() + eps) ** 0.5 * D**0.5).item()
            s = max(abs(dot), clamp) ** 0.5 * (-1.0 if dot < 0 else 1.0)
            out[t, i] += value / (1.0 + torch.exp(torch.tensor(-s, dtype=torch.float64)))
    return out


def embed_roofline(T_: int, K: int, hd: int = HEAD_DIM) -> tuple[float, float]:
    """(bytes, flops): ids, K fp8 rows + their scales read, fp32 rows written; one multiply per value."""
    return float(T_ * K * (4 + hd + hd // SCALE_GROUP + 4 * hd)), float(T_ * K * hd)


def gate_roofline(T_: int, n: int, D: int, elem_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): X read once (the second read is from L2) and written once, kv read once (fp32), QK once."""
    return float(2 * T_ * n * D * elem_bytes + 4 * T_ * (n + 1) * D + 4 * n * D + 4 * T_), float(T_ * n * D * 8)
