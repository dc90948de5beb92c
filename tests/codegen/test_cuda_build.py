"""Every family lowers for sm90 and sm100 at real V4.1-Flash shapes, compiles with nvcc, and its SASS
uses the tensor-core instructions we expect.

SASS names: FP8 wgmma shows up as QGMMA (HGMMA is its fp16/bf16/tf32 sibling); tcgen05 FP8 MMA as
UTCQMMA (UTCHMMA for fp16/bf16). Bulk tensor copies are UTMALDG/UTMASTG.
"""

import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deepinfer.codegen.kernels import (
    fp8_gemm,
    hyper_connection,
    moe_grouped_gemm,
    moe_routing,
    rmsnorm_quant,
    sparse_attn_decode,
)

T_PREFILL = 4096
D = 5120  # V4.1 hidden
NAMES = [
    "fp8_gemm_v41",
    "fp8_gemm_v4",
    "moe_grouped_gemm",
    "rmsnorm",
    "rmsnorm_quant",
    "moe_routing",
    "hc_pre",
    "hc_post",
    "sparse_attn_decode",
]


def _programs(target):
    """(name, prim_func) for every family on `target`, at V4.1 shapes."""
    g32, g128 = fp8_gemm.default_config(32), fp8_gemm.default_config(128)
    return [
        ("fp8_gemm_v41", fp8_gemm.program(T_PREFILL, 1280, D, act_group=32, weight_block=32, target=target, cfg=g32)),
        (
            "fp8_gemm_v4",
            fp8_gemm.program(T_PREFILL, 1024, 4096, act_group=128, weight_block=128, target=target, cfg=g128),
        ),
        (
            "moe_grouped_gemm",  # EP8 slice of V4.1: 48 local experts, w1|w3 fused (2 x 2304)
            moe_grouped_gemm.program(24576, 4608, D, 48, act_group=32, weight_block=32, target=target, cfg=g32),
        ),
        ("rmsnorm", rmsnorm_quant.program(T_PREFILL, D, group=32, quant=False, eps=1e-20, target=target)),
        ("rmsnorm_quant", rmsnorm_quant.program(T_PREFILL, D, group=32, quant=True, eps=1e-20, target=target)),
        ("moe_routing", moe_routing.program(T_PREFILL, 384, topk=6, route_scale=1.5, target=target)),
        ("hc_pre", hyper_connection.pre_program(T_PREFILL, D, eps=1e-20, hc_eps=1e-6, iters=20, target=target)),
        ("hc_post", hyper_connection.post_program(T_PREFILL, D, target=target)),
        # decode batch 64, 64 heads x 512, 128 window + 512 selected entries from a 64K-row pool
        ("sparse_attn_decode", sparse_attn_decode.program(64, 64, 512, 65536, 640, target=target)),
    ]


@pytest.fixture(scope="module")
def artifacts(codegen_cache, nvcc_required):
    """Build everything once per module: {(target, name): Artifact}. One program lowered at a time; nvcc and
    cuobjdump (subprocesses) for the lowered ones two at a time, so CI's second core works too."""
    from deepinfer.codegen import tilelang_backend as tb

    built = {}
    with ThreadPoolExecutor(2) as pool:
        for target in ("sm90", "sm100"):
            programs = _programs(target)
            assert [name for name, _ in programs] == NAMES
            for name, func in programs:
                source = tb.lower(func, target)
                built[(target, name)] = pool.submit(tb.build_source, f"{name}_{target}", source, target)
    return {key: future.result() for key, future in built.items()}


@pytest.mark.parametrize("target", ["sm90", "sm100"])
@pytest.mark.parametrize("name", NAMES)
def test_lowers_and_compiles_to_cubin(artifacts, target, name):
    art = artifacts[(target, name)]
    assert art.cubin_path is not None and art.cubin_path.stat().st_size > 1000
    assert art.cubin_path.parent == art.source_path.parent
    cc = "90" if target == "sm90" else "100"
    assert f"code for sm_{cc}" in art.sass and f"EF_CUDA_SM{cc}" in art.sass
    assert sum(art.opcodes.values()) > 20 and art.opcodes["EXIT"] >= 1


@pytest.mark.parametrize("name", ["fp8_gemm_v41", "fp8_gemm_v4", "moe_grouped_gemm"])
def test_sm90_fp8_gemm_uses_wgmma_and_tma(artifacts, name):
    ops = artifacts[("sm90", name)].opcodes
    assert ops["QGMMA"] > 0, "FP8 wgmma (QGMMA) missing from SASS"
    assert ops["UTMALDG"] > 0, "no TMA loads"
    assert ops["HMMA"] == 0


@pytest.mark.parametrize("name", ["fp8_gemm_v41", "fp8_gemm_v4", "moe_grouped_gemm"])
def test_sm100_fp8_gemm_uses_tcgen05(artifacts, name):
    art = artifacts[("sm100", name)]
    assert art.opcodes["UTCQMMA"] > 0, "tcgen05 FP8 MMA (UTCQMMA) missing from SASS"
    assert art.opcodes["QGMMA"] == 0 and art.opcodes["HMMA"] == 0
    assert "tcgen05" in art.source and "tmem" in art.source.lower()


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_hc_pre_mixes_run_on_tensor_cores(artifacts, target):
    # tf32 MMA for the 24 mixes (fp32 fn): mma.sync, as the tile is 64x32
    assert artifacts[(target, "hc_pre")].opcodes["HMMA"] > 0


def test_second_build_hits_the_cache(artifacts):
    from deepinfer.codegen import tilelang_backend as tb

    art = artifacts[("sm90", "rmsnorm")]
    mtime = art.cubin_path.stat().st_mtime_ns
    again = tb.build("rmsnorm_sm90", _programs("sm90")[3][1], "sm90", sass=False)
    assert again.cubin_path == art.cubin_path and again.cubin_path.stat().st_mtime_ns == mtime


def test_sm90_sparse_attention_uses_bf16_wgmma_and_async_gather(artifacts):
    ops = artifacts[("sm90", "sparse_attn_decode")].opcodes
    assert ops["HGMMA"] > 0, "bf16 wgmma (HGMMA) missing for QK^T / PV"
    assert ops["LDGSTS"] > 0, "the KV row gather should use cp.async"


def test_sm100_sparse_attention_uses_tensor_cores(artifacts):
    # fragment accumulators lower to mma.sync on sm100 (tcgen05 needs a TMEM accumulator: not yet)
    assert artifacts[("sm100", "sparse_attn_decode")].opcodes["HMMA"] > 0


# A header-internal object's mangled name carries its translation unit's file name (`<len>_INTERNAL_<hash>_<n>_<file>
# _cu_<id>`, `<len>_GLOBAL__N__...` alike): a TU of many sources, or a source under another name, differs there only.
_TU_NAME = re.compile(rb"\d*_(?:INTERNAL|GLOBAL__N_)_[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}")
_DEBUG = (".debug", ".nv_debug", ".rela.debug", ".rela.nv_debug", ".note.nv.tkinfo")


def _is_debug(section: str) -> bool:
    return section.removeprefix(".nv.merc").startswith(_DEBUG)  # sm100 cubins mirror sections under .nv.merc


def _code_of(cubin: Path) -> dict:
    """A cubin's sections but the debug ones (line tables and the embedded PTX name their source files), its
    symbol tables as (name, info, other, section, value, size) rows."""
    from deepinfer.codegen import tilelang_backend as tb

    secs = {k: v for k, v in tb.cubin_sections(cubin).items() if not _is_debug(k)}
    names = secs.pop(".strtab")
    for table in [k for k in secs if k.endswith("symtab")]:
        rows = []
        for at in range(0, len(secs[table]), 24):  # Elf64_Sym
            name, info, other, shndx, value, size = struct.unpack_from("<IBBHQQ", secs[table], at)
            label = _TU_NAME.sub(b"<tu>", names[name : names.index(b"\0", name)])
            rows.append((label, info, other, shndx, value, size))
        secs[table] = rows
    return secs


# sm100 compiles one source per nvcc (BATCH_ARCHS), so its compile_cubins reruns artifacts' own nvcc commands: the
# three GEMMs (one prelude: the TU that sm_100a must not share, see BATCH_ARCHS; ~2 s of nvcc each) and rmsnorm_quant
# show it does not batch there, without compiling hc_pre / hc_post / attention (most of the nine's nvcc time) again.
# The SASS counts are compared for all nine families on both targets.
BATCH_CHECKED = {"sm90": NAMES, "sm100": ["fp8_gemm_v41", "fp8_gemm_v4", "moe_grouped_gemm", "rmsnorm_quant"]}


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_batched_nvcc_makes_the_one_source_code(artifacts, target, tmp_path, monkeypatch):
    """compile_cubins (sm90: the sources of one #include prelude through one cicc, ptxas per kernel cut out of the
    PTX; sm100: one nvcc per source, see BATCH_ARCHS) makes the code one nvcc per source makes: every non-debug
    section and every symbol equal; and the SASS counts from one disassembler process equal cuobjdump's per cubin."""
    from deepinfer.codegen import tilelang_backend as tb
    from deepinfer.codegen.targets import get_target

    counts = tb.count_opcodes_many([artifacts[(target, n)].cubin_path for n in NAMES], get_target(target))
    assert counts == [artifacts[(target, n)].opcodes for n in NAMES]
    monkeypatch.setenv("DEEPINFER_CODEGEN_CACHE", str(tmp_path / "cache"))  # nothing cached: every cubin built
    sources = {}
    for name in BATCH_CHECKED[target]:
        sources[name] = tmp_path / f"{name}.cu"
        sources[name].write_text(artifacts[(target, name)].source)
    preludes = [tb.split_source(p.read_text())[0] for p in sources.values()]
    alone = {p for p, pre in zip(sources.values(), preludes, strict=True) if preludes.count(pre) == 1}
    assert len(alone) < len(sources) - 1, "no prelude shared by two sources: nothing to batch"
    one_by_one = []
    real = tb.compile_cubin
    monkeypatch.setattr(tb, "compile_cubin", lambda src, tgt: one_by_one.append(src) or real(src, tgt))
    built = tb.compile_cubins(list(sources.values()), get_target(target))
    assert set(one_by_one) == (alone if target == "sm90" else set(sources.values()))
    for name, src in sources.items():
        assert isinstance(built[src], Path), built[src]
        assert _code_of(built[src]) == _code_of(artifacts[(target, name)].cubin_path), name


def test_a_failing_batch_compiles_its_sources_one_by_one(artifacts, tmp_path, monkeypatch):
    """One source that nvcc rejects does not take its batch down: the batch is compiled source by source, and
    the error names that source."""
    from deepinfer.codegen import tilelang_backend as tb
    from deepinfer.codegen.targets import get_target

    monkeypatch.setenv("DEEPINFER_CODEGEN_CACHE", str(tmp_path / "cache"))
    good, bad = tmp_path / "good.cu", tmp_path / "bad.cu"
    good.write_text(artifacts[("sm90", "rmsnorm")].source)
    bad.write_text(artifacts[("sm90", "rmsnorm")].source + "\nint not_cuda(;\n")
    built = tb.compile_cubins([good, bad], get_target("sm90"))
    assert isinstance(built[good], Path) and built[good].stat().st_size > 1000
    assert isinstance(built[bad], str) and "nvcc failed for bad.cu" in built[bad]


@pytest.mark.parametrize("max_rows", [0, 64])
def test_sm90_moe_grouped_improved_loop(codegen_cache, nvcc_required, max_rows):
    """sm90 grouped GEMM with fp8_gemm's overlapped main loop: contiguous and masked (decode) layouts."""
    from deepinfer.codegen import tilelang_backend as tb

    cfg = moe_grouped_gemm.sm90_config(0, 4608, masked=bool(max_rows))
    m = 48 * max_rows if max_rows else 24576
    func = moe_grouped_gemm.program(m, 4608, D, 48, act_group=32, weight_block=32, target="sm90", cfg=cfg,
                                    max_rows=max_rows)  # fmt: skip
    art = tb.build(f"moe_grouped_sm90_{max_rows}", func, "sm90")
    assert art.opcodes["QGMMA"] > 0 and art.opcodes["UTMALDG"] > 0
    assert art.opcodes["LDL"] == 0 and art.opcodes["STL"] == 0, "register spills"


def test_sm90_sparse_attention_split_builds(codegen_cache, nvcc_required):
    from deepinfer.codegen import tilelang_backend as tb

    cfg = sparse_attn_decode.portable_split_config(16, 640)  # the ws program: tests/codegen/test_sparse_attn_ws.py
    assert cfg.num_split > 1 and not cfg.ws
    part, comb = sparse_attn_decode.split_programs(16, 64, 512, 65536, 640, target="sm90", cfg=cfg)
    ops = tb.build("sparse_attn_split_sm90", part, "sm90").opcodes
    assert ops["HGMMA"] > 0 and ops["LDGSTS"] > 0
    assert tb.build("sparse_attn_combine_sm90", comb, "sm90").opcodes["EXIT"] >= 1


# config_space does not depend on M (only on D): one M a target covers both token counts without building the same
# nine configs twice per target.
@pytest.mark.parametrize("target, M", [("sm90", 16), ("sm100", 64)])
def test_rmsnorm_quant_builds_every_config(codegen_cache, nvcc_required, target, M):
    """Non-power-of-two group counts (D=1280, V4.1's q_lora_rank: 40 groups of 32; 5120 is built above) lowered to
    a 40-thread XOR-butterfly reduce for some configs; every config of the space (and the adapter's default) must
    lower and compile. The sources go through compile_cubins (sm90: one cicc for their shared prelude, which
    test_batched_nvcc_makes_the_one_source_code shows makes nvcc's own code); an nvcc error fails the test."""
    from deepinfer.codegen import tilelang_backend as tb
    from deepinfer.codegen.targets import get_target

    D, tgt = 1280, get_target(target)
    assert rmsnorm_quant.config_space(16, D) == rmsnorm_quant.config_space(64, D)  # (the M above is arbitrary)
    space = rmsnorm_quant.config_space(M, D)
    assert space and all(c.threads & (c.threads - 1) == 0 for c in space)
    sources = []
    for cfg in {*space, rmsnorm_quant.Config(2, 256)}:
        func = rmsnorm_quant.program(M, D, group=32, quant=True, eps=1e-6, target=target, cfg=cfg)
        sources.append(tb.write_source(f"rmsnorm_quant_{M}x{D}_{cfg.block_m}x{cfg.threads}_{target}", tgt,
                                       tb.lower(func, tgt)))  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # two halves at once (nvcc subprocesses): CI's two cores
        halves = pool.map(lambda half: tb.compile_cubins(half, tgt), (sources[::2], sources[1::2]))
        built = {src: cubin for half in halves for src, cubin in half.items()}
    assert set(built) == set(sources)
    failed = {src.name: cubin for src, cubin in built.items() if not isinstance(cubin, Path)}
    assert not failed, failed
    assert all(cubin.stat().st_size > 1000 for cubin in built.values())


def test_engram_embed_lowers_at_the_preset_shapes():
    """tiny/small Engram shapes (hd 32/64, 6-12 heads) failed TileLang's layout inference on the H200 for most
    (block_t, threads) pairs; tokens now run serially inside a CTA, so every config in the space lowers."""
    from deepinfer.codegen import tilelang_backend as tb
    from deepinfer.codegen.kernels import engram

    for k, hd in ((6, 32), (12, 64)):
        for cfg in engram.embed_config_space(8):
            tb.lower(engram.embed_program(8, k, 1000, hd=hd, target="sm90", cfg=cfg), "sm90")


def _mx_probe(M=256, N=256, K=512, bm=128, bk=128):
    """The smallest sm100 FP8 GEMM on TileLang's block-scaled MMA (T.gemm_blockscaled): ue8m0 scales per 32 K,
    4 packed per uint32 word, copied shared -> tensor memory by tcgen05.cp. A toolchain probe only: no SM100
    device here, so its numerics (the scale-factor chunk layout tcgen05.cp expects) are not checked."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    fp8 = "float8_e4m3fn"

    @T.prim_func
    def mx_probe(A: T.Tensor((M, K), fp8), SFA: T.Tensor((K // bk, M), "uint32"), B: T.Tensor((N, K), fp8),
                 SFB: T.Tensor((K // bk, N), "uint32"), C: T.Tensor((M, N), "float32")):  # fmt: skip
        with T.Kernel(N // bm, M // bm, threads=128) as (bx, by):
            A_s, B_s = T.alloc_shared((bm, bk), fp8), T.alloc_shared((bm, bk), fp8)
            SFA_s, SFB_s = T.alloc_shared((bm,), "uint32"), T.alloc_shared((bm,), "uint32")
            C_t = T.alloc_tmem([bm, bm], "float32")
            SFA_t, SFB_t = T.alloc_tmem([bm, 4], "uint32"), T.alloc_tmem([bm, 4], "uint32")
            mbar = T.alloc_barrier(1)
            C_l = T.alloc_fragment((bm, bm), "float32")
            for ko in T.serial(K // bk):
                T.copy(A[by * bm, ko * bk], A_s)
                T.copy(B[bx * bm, ko * bk], B_s)
                T.copy(SFA[ko, by * bm : (by + 1) * bm], SFA_s)
                T.copy(SFB[ko, bx * bm : (bx + 1) * bm], SFB_s)
                T.tcgen05_cp_warpx4(SFA_s, SFA_t)
                T.tcgen05_cp_warpx4(SFB_s, SFB_t)
                TC.gemm_blockscaled(A_s, B_s, C_t, SFA_t, SFB_t, transpose_B=True, clear_accum=(ko == 0),
                                    k_start=ko * bk, sf_a_granularity_k=32, sf_b_granularity_k=32,
                                    mbar=mbar)  # fmt: skip
            T.copy(C_t, C_l)
            T.copy(C_l, C[by * bm, bx * bm])

    return mx_probe


def test_sm100_block_scaled_mma_is_available(codegen_cache, nvcc_required):
    """fp8_gemm.py's SM100 note: TileLang 0.1.15 lowers kind::mxf8f6f4.block_scale (ue8m0 per 32 K in tensor
    memory), the hardware form of V4.1's 32-group promotion; nvcc emits the scaled UTCQMMA (scale-factor TMEM
    operands) and UTCCP for the scale copies."""
    from deepinfer.codegen import tilelang_backend as tb

    art = tb.build("fp8_mx_probe_sm100", _mx_probe(), "sm100")
    assert "tcgen05mma_blockscaled_ss<tl::DataType::kFloat8_e4m3" in art.source
    assert art.opcodes["UTCQMMA"] > 0 and art.opcodes["UTCCP"] > 0
    scaled = [line for line in art.sass.splitlines() if "UTCQMMA" in line]
    assert all(line.count("tmem[") == 3 for line in scaled), "accumulator + SFA + SFB in tensor memory"


def test_sm90_hc_pre_split_builds_with_tensor_core_mixes(codegen_cache, nvcc_required):
    """The few-token hc_pre pair at V4.1 decode (64 tokens, D 5120 over 20 CTAs per 16 tokens) lowers and
    compiles; its partial mixes run on the tensor cores (tf32 mma.sync = HMMA) like pre_program's."""
    from deepinfer.codegen import tilelang_backend as tb

    partial, finish = hyper_connection.pre_split_programs(64, D, eps=1e-20, hc_eps=1e-6, iters=20, target="sm90")
    p = tb.build("hc_pre_partial_sm90", partial, "sm90")
    f = tb.build("hc_pre_finish_sm90", finish, "sm90")
    assert p.opcodes.get("HMMA", 0) > 0 and "hc_pre_partial" in p.source
    assert f.cubin_path is not None and "hc_pre_finish" in f.source
