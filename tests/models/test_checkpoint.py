"""Checkpoint I/O: formats on disk, bit-exact round trips, sharding, validation errors, random weights,
make_checkpoint and resolve_model."""

from __future__ import annotations

import json
import math
import struct
import types

import pytest
import torch

from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, TensorType, Value
from deepinfer.ir.ops.quant import dequant_fp4_rows, dequant_fp8_blocks
from deepinfer.models import checkpoint as ck
from deepinfer.models.checkpoint import (
    INDEX_FILE,
    load_checkpoint,
    random_weights,
    read_header,
    resolve_model,
    save_checkpoint,
)
from deepinfer.models.presets import preset_config


def P(name: str, dtype: dt.DType, shape: tuple[int, ...]) -> Value:
    return Value(name, TensorType(dtype, shape), "param")


def params(block: int = 32) -> list[Value]:
    """One of each storage format, with FP8 dims that are not multiples of the block."""
    out, inn = 100, 72
    return [
        P("embed.weight", dt.bf16, (50, 64)),
        P("layers.0.attn.wq_a.weight", dt.f8e4m3, (out, inn)),
        P("layers.0.attn.wq_a.scale", dt.e8m0, (math.ceil(out / block), math.ceil(inn / block))),
        P("layers.0.attn.q_norm.weight", dt.bf16, (out,)),
        P("layers.0.attn.attn_sink", dt.f32, (4,)),
        P("layers.0.hc_attn_fn", dt.f32, (24, 256)),
        P("layers.0.hc_attn_base", dt.f32, (24,)),
        P("layers.0.hc_attn_scale", dt.f32, (3,)),
        P("layers.0.ffn.gate.weight", dt.bf16, (8, 64)),
        P("layers.0.ffn.gate.tid2eid", dt.i32, (50, 3)),
        P("layers.1.ffn.gate.bias", dt.f32, (8,)),
        P("layers.1.ffn.experts.0.w1.weight", dt.f4e2m1x2, (32, 64 // 2)),
        P("layers.1.ffn.experts.0.w1.scale", dt.e8m0, (32, 64 // 32)),
        P("layers.1.ffn.experts.0.w2.weight", dt.f4e2m1x2, (64, 32 // 2)),
        P("layers.1.ffn.experts.0.w2.scale", dt.e8m0, (64, 1)),
        P("norm.weight", dt.bf16, (64,)),
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for bit-exact comparisons (nan-safe)."""
    return t.contiguous().view(torch.uint8).flatten() if t.element_size() == 1 else t.contiguous().view(-1)


def assert_bit_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        x, y = a[k].contiguous(), b[k].contiguous()
        assert torch.equal(
            x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int8).view(-1),
            y.view(torch.uint8) if y.element_size() == 1 else y.view(torch.int8).view(-1),
        ), k


@pytest.fixture
def saved(tmp_path):
    ps = params()
    w = random_weights(ps, seed=3, block=32)
    d = save_checkpoint(tmp_path / "ckpt", w, {"model_type": "deepseek_v41", "x": 1}, max_shard_bytes=8000)
    return d, ps, w


# ---------------------------------------------------------------------------------------------------
# formats and round trips
# ---------------------------------------------------------------------------------------------------


def test_round_trip_bit_exact_across_shards(saved):
    d, ps, w = saved
    index = json.loads((d / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert set(index["weight_map"]) == {p.name for p in ps}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in w.values())
    assert json.loads((d / "config.json").read_text()) == {"model_type": "deepseek_v41", "x": 1}
    loaded = load_checkpoint(d, ps)
    assert_bit_equal(loaded, w)
    assert loaded["layers.1.ffn.experts.0.w1.weight"].dtype == torch.uint8  # the IR's f4e2m1x2 storage
    assert loaded["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    # without an expected list everything comes back, FP4 as stored (I8)
    raw = load_checkpoint(d)
    assert set(raw) == set(w)
    assert raw["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert torch.equal(raw["layers.1.ffn.experts.0.w1.weight"].view(torch.uint8), w["layers.1.ffn.experts.0.w1.weight"])


def test_on_disk_dtype_strings_and_shapes(saved):
    d, _, _ = saved
    wm = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    entry = {n: read_header(d / f)[n] for n, f in wm.items()}
    assert entry["layers.0.attn.wq_a.weight"]["dtype"] == "F8_E4M3"
    assert entry["layers.0.attn.wq_a.scale"]["dtype"] == "F8_E8M0"
    assert entry["layers.0.attn.wq_a.scale"]["shape"] == [4, 3]  # ceil(100/32), ceil(72/32)
    assert entry["layers.1.ffn.experts.0.w1.weight"] == {
        **entry["layers.1.ffn.experts.0.w1.weight"],
        "dtype": "I8",
        "shape": [32, 32],
    }
    assert entry["layers.1.ffn.experts.0.w1.scale"]["dtype"] == "F8_E8M0"
    assert entry["embed.weight"]["dtype"] == "BF16"
    assert entry["layers.0.hc_attn_fn"]["dtype"] == "F32"
    assert entry["layers.0.ffn.gate.tid2eid"]["dtype"] == "I32"


def test_single_file_checkpoint_without_index(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "single"
    d.mkdir()
    save_file({"norm.weight": torch.ones(4, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    out = load_checkpoint(d, [P("norm.weight", dt.bf16, (4,))])
    assert torch.equal(out["norm.weight"], torch.ones(4, dtype=torch.bfloat16))


def test_fp4_stored_as_u8_or_torch_f4_is_read(tmp_path):
    from safetensors.torch import save_file

    packed = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for name, stored in (("u8", packed), ("f4", packed.view(torch.float4_e2m1fn_x2))):
        d = tmp_path / name
        d.mkdir()
        save_file({"w.weight": stored}, str(d / "model.safetensors"))
        got = load_checkpoint(d, [P("w.weight", dt.f4e2m1x2, (4, 8))])["w.weight"]
        assert got.dtype == torch.uint8 and torch.equal(got, packed)


def test_int_width_is_converted_for_tid2eid(tmp_path):
    t = torch.tensor([[0, 3], [2, 1]], dtype=torch.int64)
    d = save_checkpoint(tmp_path / "c", {"layers.0.ffn.gate.tid2eid": t}, {})
    got = load_checkpoint(d, [P("layers.0.ffn.gate.tid2eid", dt.i32, (2, 2))])["layers.0.ffn.gate.tid2eid"]
    assert got.dtype == torch.int32 and torch.equal(got, t.int())


# ---------------------------------------------------------------------------------------------------
# dequantisation against an independent decode of the code tables (§4.2-4.3)
# ---------------------------------------------------------------------------------------------------


def e4m3_by_hand(byte: int) -> float:
    """FP8 E4M3 (fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    assert not (e == 15 and m == 7), "NaN code"
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # §4.3, codes 8-15 negative


def e2m1_by_hand(code: int) -> float:
    v = E2M1_TABLE[code & 7]
    return -v if code & 8 else v


def test_fp8_block_dequant_matches_hand_decode(saved):
    d, ps, _ = saved
    w = load_checkpoint(d, ps)
    codes, scale = w["layers.0.attn.wq_a.weight"], w["layers.0.attn.wq_a.scale"]
    got = dequant_fp8_blocks(codes, scale, 32)
    cb, sb = codes.view(torch.uint8).tolist(), scale.view(torch.uint8).tolist()
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            want = e4m3_by_hand(cb[i][j]) * 2.0 ** (sb[i // 32][j // 32] - 127)
            assert got[i, j].item() == want, (i, j)


def test_fp4_dequant_matches_hand_decode(saved):
    d, ps, _ = saved
    w = load_checkpoint(d, ps)
    packed, scale = w["layers.1.ffn.experts.0.w1.weight"], w["layers.1.ffn.experts.0.w1.scale"]
    got = dequant_fp4_rows(packed, scale, 32)
    pb, sb = packed.tolist(), scale.view(torch.uint8).tolist()
    for i in range(packed.shape[0]):
        for j in range(packed.shape[1] * 2):
            byte = pb[i][j // 2]
            code = byte & 0xF if j % 2 == 0 else byte >> 4  # low nibble = even column
            want = e2m1_by_hand(code) * 2.0 ** (sb[i][j // 32] - 127)
            assert got[i, j].item() == want, (i, j)


def test_hand_written_fp8_bytes_round_trip_exactly(tmp_path):
    """Every finite E4M3 byte and a spread of e8m0 bytes survive the disk untouched."""
    fin = [b for b in range(256) if (b & 0x7F) != 0x7F]
    codes = torch.tensor(fin[:240], dtype=torch.uint8).view(16, 15).view(torch.float8_e4m3fn)
    scale = torch.tensor([[0, 127], [100, 140]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = save_checkpoint(tmp_path / "c", {"a.weight": codes, "a.scale": scale}, {})
    got = load_checkpoint(d, [P("a.weight", dt.f8e4m3, (16, 15)), P("a.scale", dt.e8m0, (2, 2))])
    assert torch.equal(got["a.weight"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got["a.scale"].view(torch.uint8), scale.view(torch.uint8))
    deq = dequant_fp8_blocks(got["a.weight"], got["a.scale"], 8)
    assert deq[0, 1].item() == e4m3_by_hand(fin[1]) * 2.0**-127
    assert deq[15, 14].item() == e4m3_by_hand(fin[239]) * 2.0 ** (140 - 127)


# ---------------------------------------------------------------------------------------------------
# bad checkpoints: one line naming the tensor or file
# ---------------------------------------------------------------------------------------------------


def one_line_error(fn, *names):
    with pytest.raises(CheckpointError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert n in msg, msg
    return msg


def test_missing_tensor(saved):
    d, ps, _ = saved
    extra = P("layers.9.attn.wkv.weight", dt.bf16, (4, 4))
    one_line_error(lambda: load_checkpoint(d, [*ps, extra]), "layers.9.attn.wkv.weight", "missing")


def test_wrong_shape(saved):
    d, ps, _ = saved
    bad = [P(p.name, p.type.dtype, (101, 72)) if p.name == "layers.0.attn.wq_a.weight" else p for p in ps]
    msg = one_line_error(lambda: load_checkpoint(d, bad), "layers.0.attn.wq_a.weight", "shape")
    assert "[100, 72]" in msg and "[101, 72]" in msg


def test_wrong_dtype(saved):
    d, ps, _ = saved
    bad = [P(p.name, dt.f32, p.type.shape) if p.name == "embed.weight" else p for p in ps]
    msg = one_line_error(lambda: load_checkpoint(d, bad), "embed.weight", "dtype")
    assert "BF16" in msg and "F32" in msg
    bad = [P(p.name, dt.bf16, p.type.shape) if p.name == "layers.0.attn.wq_a.scale" else p for p in ps]
    one_line_error(lambda: load_checkpoint(d, bad), "layers.0.attn.wq_a.scale", "F8_E8M0")


def test_fp4_packed_shape_is_checked(saved):
    d, ps, _ = saved
    bad = [P(p.name, p.type.dtype, (32, 64)) if p.name == "layers.1.ffn.experts.0.w1.weight" else p for p in ps]
    one_line_error(lambda: load_checkpoint(d, bad), "layers.1.ffn.experts.0.w1.weight", "[32, 32]")


def test_missing_index_file(saved):
    d, ps, _ = saved
    (d / INDEX_FILE).unlink()
    one_line_error(lambda: load_checkpoint(d, ps), INDEX_FILE)


def test_corrupt_index_file(saved):
    d, ps, _ = saved
    (d / INDEX_FILE).write_text("{not json")
    one_line_error(lambda: load_checkpoint(d, ps), INDEX_FILE)


def test_shard_listed_but_absent(saved):
    d, ps, _ = saved
    shard = "model-00002-of-" + json.loads((d / INDEX_FILE).read_text())["weight_map"]["embed.weight"][-17:]
    (d / shard).unlink()
    one_line_error(lambda: load_checkpoint(d, ps), shard, "missing")


def test_truncated_shard(saved):
    d, ps, _ = saved
    f = d / json.loads((d / INDEX_FILE).read_text())["weight_map"]["layers.0.attn.wq_a.weight"]
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    one_line_error(lambda: load_checkpoint(d, ps), f.name, "truncated")
    f.write_bytes(data[:5])
    one_line_error(lambda: load_checkpoint(d, ps), f.name, "truncated")


def test_tensor_in_index_but_not_in_shard(saved):
    d, ps, _ = saved
    idx = json.loads((d / INDEX_FILE).read_text())
    idx["weight_map"]["ghost.weight"] = idx["weight_map"]["embed.weight"]
    (d / INDEX_FILE).write_text(json.dumps(idx))
    one_line_error(lambda: load_checkpoint(d, ps), "ghost.weight")


def test_several_problems_are_counted(saved):
    d, ps, _ = saved
    extra = [P("a.weight", dt.bf16, (1,)), P("b.weight", dt.bf16, (1,))]
    one_line_error(lambda: load_checkpoint(d, [*ps, *extra]), "a.weight", "1 more")


def test_not_a_directory(tmp_path):
    one_line_error(lambda: load_checkpoint(tmp_path / "nope"), "nope")


# ---------------------------------------------------------------------------------------------------
# atomic writes
# ---------------------------------------------------------------------------------------------------


def test_existing_directory_is_refused_unless_overwrite(saved):
    d, ps, w = saved
    one_line_error(lambda: save_checkpoint(d, w, {}), str(d))
    w2 = random_weights(ps, seed=4, block=32)
    save_checkpoint(d, w2, {"v": 2}, overwrite=True)
    assert_bit_equal(load_checkpoint(d, ps), w2)
    assert sorted(p.name for p in d.parent.iterdir()) == ["ckpt"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        real(tensors, filename, metadata=metadata)

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    w = random_weights(params(), seed=0, block=32)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "out", w, {}, max_shard_bytes=8000)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# random weights
# ---------------------------------------------------------------------------------------------------


def test_random_weights_deterministic_per_name():
    ps = params()
    a, b = random_weights(ps, seed=7, block=32), random_weights(ps, seed=7, block=32)
    assert_bit_equal(a, b)
    sub = [ps[0], ps[11], ps[12], ps[9], ps[8]]  # a subset, in another order
    c = random_weights(sub, seed=7, block=32)
    for p in sub:
        assert torch.equal(bits(c[p.name]), bits(a[p.name])), p.name
    only_scale = random_weights([ps[1], ps[2]][::-1], seed=7, block=32)  # scale before its weight
    assert torch.equal(bits(only_scale[ps[2].name]), bits(a[ps[2].name]))
    d = random_weights(ps, seed=8, block=32)
    assert not torch.equal(bits(d["embed.weight"]), bits(a["embed.weight"]))
    renamed = random_weights([P("other.weight", dt.bf16, (50, 64))], seed=7)
    assert not torch.equal(bits(renamed["other.weight"]), bits(a["embed.weight"]))


def test_random_weights_are_realistic():
    ps = params()
    w = random_weights(ps, seed=1, block=32)
    fp8 = dequant_fp8_blocks(w["layers.0.attn.wq_a.weight"], w["layers.0.attn.wq_a.scale"], 32)
    assert abs(fp8.std().item() * math.sqrt(72) - 1) < 0.15  # std ~ 1/sqrt(fan_in)
    # each block's largest code is near the top of the E4M3 range (the scale is 2^ceil(log2(amax/448)))
    blocks = torch.nn.functional.pad(w["layers.0.attn.wq_a.weight"].float().abs(), (0, 24, 0, 28))
    amax = blocks.view(4, 32, 3, 32).amax(dim=(1, 3))
    assert (amax > 224).all() and (amax <= 448).all()
    fp4 = dequant_fp4_rows(w["layers.1.ffn.experts.0.w1.weight"], w["layers.1.ffn.experts.0.w1.scale"])
    assert fp4.shape == (32, 64) and abs(fp4.std().item() * math.sqrt(64) - 1) < 0.2
    codes = dt.unpack_fp4(w["layers.1.ffn.experts.0.w1.weight"])
    assert len(set(codes.flatten().tolist())) > 10
    norm = w["layers.0.attn.q_norm.weight"].float()
    assert (norm - 1).abs().max() < 0.6 and norm.std() > 0.01
    for name in (
        "layers.0.attn.attn_sink",
        "layers.0.hc_attn_base",
        "layers.0.hc_attn_scale",
        "layers.1.ffn.gate.bias",
    ):
        assert 0 < w[name].abs().max() < 1, name
    assert w["layers.0.hc_attn_fn"].dtype == torch.float32
    tid = w["layers.0.ffn.gate.tid2eid"]
    assert tid.dtype == torch.int32 and tid.min() >= 0 and tid.max() < 8
    assert all(len(set(r)) == 3 for r in tid.tolist())
    assert len({tuple(r) for r in tid.tolist()}) > 10


def test_random_weights_block_from_shapes_and_errors():
    ps = params(block=128)
    w = random_weights(ps, seed=0)  # no block given: inferred from the scale shape (one 128-block here)
    assert w["layers.0.attn.wq_a.scale"].shape == (1, 1)
    with pytest.raises(CheckpointError, match="layers.0.ffn.gate.tid2eid"):
        random_weights([P("layers.0.ffn.gate.tid2eid", dt.i32, (5, 2))], seed=0)
    got = random_weights([P("layers.0.ffn.gate.tid2eid", dt.i64, (5, 2))], seed=0, n_experts=4)
    assert got["layers.0.ffn.gate.tid2eid"].max() < 4


# ---------------------------------------------------------------------------------------------------
# make_checkpoint and resolve_model
# ---------------------------------------------------------------------------------------------------


def _v4_graph_available() -> bool:
    try:
        from deepinfer.models import deepseek_v4
    except ImportError:
        return False
    return hasattr(deepseek_v4, "build_graph") and hasattr(deepseek_v4, "parse_config")


def test_make_checkpoint_with_hand_built_graph(tmp_path, monkeypatch):
    graph = Graph("hand", params=params(block=32))
    seen = {}

    def parse_config(cfg):
        seen["cfg"] = cfg
        return cfg

    fake = types.SimpleNamespace(__name__="fake", parse_config=parse_config, build_graph=lambda cfg: graph)
    monkeypatch.setattr("deepinfer.models.get_model", lambda name: fake)
    out = ck.make_checkpoint("deepseek-v4.1-flash", "tiny", tmp_path / "m", seed=5, max_shard_bytes=8000)
    assert seen["cfg"] == preset_config("deepseek-v4.1-flash", "tiny")
    assert json.loads((out / "config.json").read_text()) == seen["cfg"]
    got = load_checkpoint(out, graph.params)
    assert_bit_equal(got, random_weights(graph.params, seed=5, block=32))
    one_line_error(lambda: ck.make_checkpoint("deepseek-v4.1-flash", "tiny", out, seed=5), str(out))


@pytest.mark.skipif(not _v4_graph_available(), reason="models/deepseek_v4.py has no build_graph yet")
def test_make_checkpoint_v4_tiny(tmp_path):
    from deepinfer.models import get_model

    out = ck.make_checkpoint("deepseek-v4-flash", "tiny", tmp_path / "v4", seed=0, max_shard_bytes=10 * 2**20)
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == preset_config("deepseek-v4-flash", "tiny")
    mod = get_model("deepseek-v4-flash")
    graph = mod.build_graph(mod.parse_config(cfg))
    w = load_checkpoint(out, graph.params)  # the backbone graph finds everything it needs
    assert set(w) == {p.name for p in graph.params}
    assert w["layers.0.ffn.gate.tid2eid"].max() < cfg["n_routed_experts"]
    everything = ck.checkpoint_params("deepseek-v4-flash", cfg)
    assert any(p.name.startswith("mtp.0.") for p in everything)  # the MTP block is in the checkpoint too
    assert_bit_equal(load_checkpoint(out, everything), random_weights(everything, seed=0, block=128))
    for p in graph.params:
        if p.type.dtype is dt.f8e4m3:  # V4's 128x128 blocks over tiny dims: one block per matrix row/col range
            s = w[p.name[: -len("weight")] + "scale"]
            assert s.shape == (math.ceil(p.type.shape[0] / 128), math.ceil(p.type.shape[1] / 128))


@pytest.mark.skipif(not _v4_graph_available(), reason="models/deepseek_v4.py has no build_graph yet")
def test_real_v4_checkpoint_inventory():
    """§1.1/§4.1: the released V4-Flash checkpoint has 69,187 tensors and 159,609,485,896 payload bytes (its
    tid2eid tables are I64; ours are declared i32, which the loader accepts and converts)."""
    ps = ck.checkpoint_params("deepseek-v4-flash", preset_config("deepseek-v4-flash", "real"))
    assert len(ps) == 69187
    tid = [p for p in ps if p.name.endswith("tid2eid")]
    widen = sum(math.prod(p.type.shape) * (8 - p.type.dtype.itemsize) for p in tid)
    assert ck.params_bytes(ps) + widen == 159_609_485_896
    with pytest.raises(CheckpointError, match="GB"):
        ck.make_checkpoint("deepseek-v4-flash", "real", "/nonexistent/never-written")


def test_cli_make_checkpoint_reports_errors(tmp_path, capsys):
    from deepinfer.cli import main

    (tmp_path / "exists").mkdir()
    rc = main(["make-checkpoint", "--model", "deepseek-v4-flash", "--out", str(tmp_path / "exists")])
    assert rc == 2
    assert "exists" in capsys.readouterr().err


def test_resolve_model(tmp_path, monkeypatch):
    monkeypatch.delenv(ck.ENV_MODEL_DIR, raising=False)
    name, cfg, d = resolve_model("deepseek-v4-flash")
    assert (name, d) == ("deepseek-v4-flash", None) and cfg == preset_config("deepseek-v4-flash", "tiny")
    name, cfg, d = resolve_model("deepseek-v4.1-flash:real")
    assert name == "deepseek-v4.1-flash" and cfg["text_config"]["hidden_size"] == 5120 and d is None
    assert resolve_model(None)[0] == "deepseek-v4.1-flash"

    ckpt = save_checkpoint(tmp_path / "c", {"norm.weight": torch.ones(2)}, preset_config("deepseek-v4-flash", "tiny"))
    name, cfg, d = resolve_model(str(ckpt))
    assert (name, d) == ("deepseek-v4-flash", ckpt) and cfg["hidden_size"] == 64

    monkeypatch.setenv(ck.ENV_MODEL_DIR, str(ckpt))
    assert resolve_model(None)[2] == ckpt
    assert resolve_model("deepseek-v4-flash")[2] == ckpt
    assert resolve_model("deepseek-v4.1-flash")[2] is None  # the env checkpoint is another model

    with pytest.raises(ConfigError, match="nope"):
        resolve_model("nope")
    with pytest.raises(ConfigError, match="huge"):
        resolve_model("deepseek-v4-flash:huge")
    bad = save_checkpoint(tmp_path / "bad", {"x": torch.ones(1)}, {"model_type": "llama"})
    with pytest.raises(ConfigError, match="llama"):
        resolve_model(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        resolve_model(str(empty))


def test_header_parser_rejects_garbage(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 4) + b"nope")
    one_line_error(lambda: read_header(f), "x.safetensors")


def test_tied_and_sliced_tensors_are_saved(tmp_path):
    big = torch.randn(4, 8)
    tensors = {"embed.weight": big, "head.weight": big, "a.weight": big[:2], "b.weight": big[2:]}
    d = save_checkpoint(tmp_path / "c", tensors, {})
    got = load_checkpoint(d)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not _v4_graph_available(), reason="models/deepseek_v4.py has no build_graph yet")
def test_cli_make_checkpoint_writes_a_loadable_checkpoint(tmp_path, capsys):
    from deepinfer.cli import main

    out = tmp_path / "v4"
    assert main(["make-checkpoint", "--model", "deepseek-v4-flash", "--preset", "tiny", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    name, cfg, d = resolve_model(str(out))
    assert (name, d) == ("deepseek-v4-flash", out)
    w = load_checkpoint(out, ck.checkpoint_params(name, cfg))
    assert w["embed.weight"].shape == (129280, 64)
