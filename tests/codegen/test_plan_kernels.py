"""Kernel artifacts in a plan (codegen/plan_kernels.py): compile tiny V4.1 for sm90 writes sources, cubins and a
manifest (the engine's keys at the small bucket only, one kernel per program: the full set is ~80 builds, too many
for CI's 2 cores; tests/codegen/test_plan_kernels_engine.py checks the full set's keys without building); a
tuning-database record changes an sm100 config and is marked "tuned" (sm90 specs are the runtime adapters' configs:
the runtime reads no database); a second compile hits the caches and never tunes; load_plan refuses a missing or
altered artifact with one line.

Needs TileLang and nvcc (CPU-only is fine): without them the module fails rather than skipping silently.
"""

import json
import shutil
import time

import pytest

from deepinfer.codegen import plan_kernels, tuner
from deepinfer.codegen import tilelang_backend as tb
from deepinfer.compiler import compile_model
from deepinfer.errors import SerializationError
from deepinfer.runtime.plan import load_plan, write_plan

GEMM_FAMILIES = {"fp8_gemm", "moe_grouped_gemm"}


def _one_kernel_per_program(kernel_specs):
    """kernel_specs keeping, on sm90, the first spec of each (family, program): 10 of the 21 kernels at T=64, every
    family and program still built. (The three topk_select ones are 52 of the cold compile's 95 CPU seconds; the
    full set's build is the H200 machine's `deepinfer compile --kernels` run.)"""

    def specs(graph, target, *args, **kwargs):
        out, skipped = kernel_specs(graph, target, *args, **kwargs)
        if target != "sm90":
            return out, skipped
        first = {}
        for spec in out:
            first.setdefault((spec.family, spec.program), spec)
        return list(first.values()), skipped

    return specs


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Own codegen cache and tuning database for the module, restored afterwards; the sm90 compiles derive the
    engine's keys at T=64 only, without the batched decode step, and build one kernel per program (10)."""
    assert shutil.which("nvcc"), "nvcc must be on PATH for the plan-kernel tests"
    root = tmp_path_factory.mktemp("plan_kernels")
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_CODEGEN_CACHE", str(root / "cache"))
    mp.setenv(tuner.DB_ENV, str(root / "tuning.json"))
    mp.setattr(plan_kernels, "engine_lengths", lambda graph, mode: [64])
    mp.setattr(plan_kernels, "ENGINE_BATCH_SIZES", ())
    mp.setattr(plan_kernels, "kernel_specs", _one_kernel_per_program(plan_kernels.kernel_specs))
    yield root
    mp.undo()


def _compile(root, name, **kw):
    t0 = time.perf_counter()
    res = compile_model(None, "sm90", kernels="bound", jobs=2, kernels_dir=root / f"stage-{name}", **kw)
    dt = time.perf_counter() - t0
    return write_plan(res.plan, root / name), res, dt


FAMILIES = ("fp8_gemm", "moe_grouped_gemm", "rmsnorm_quant", "hyper_connection", "rope", "engram", "topk_select",
            "moe_routing")


def _family_hashes() -> dict:
    return {f: plan_kernels._family_hash(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def cold(env):
    before = _family_hashes()
    out = _compile(env, "cold")
    return (*out, before, _family_hashes())


def test_manifest_entries_exist_and_gemms_use_fp8_wgmma(cold):
    out, res = cold[:2]
    manifest = json.loads((out / "kernels" / "manifest.json").read_text())
    ents = manifest["kernels"]
    assert ents and all("error" not in e for e in ents), [e.get("error") for e in ents]
    assert {e["family"] for e in ents} >= GEMM_FAMILIES | {"rmsnorm_quant", "hyper_connection"}
    for e in ents:
        assert e["config_source"] == "adapter"
        for info in e["files"].values():
            assert (out / "kernels" / info["file"]).is_file()
        assert set(e["files"]) == {"source", "cubin"}
        if e["family"] in GEMM_FAMILIES:
            assert e["sass_mma"].get("QGMMA", 0) > 0, e  # FP8 wgmma on sm90
        if not e["sass_mma"]:  # no mma / gemm in the source: counted as none without disassembling -- check that
            sass = tb.dump_sass(out / "kernels" / e["files"]["cubin"]["file"])
            assert not plan_kernels._mma_counts(tb.count_opcodes(sass)), e["name"]
    plan = load_plan(out)
    assert plan.kernels["target"] == "sm90" and len(plan.kernels["kernels"]) == len(ents)
    ph = manifest["phases_s"]  # what the cold compile's time is made of (printed on the summary line)
    assert ph["derive"] > 0 and ph["built"] == len(ents) and ph["lower"] > 0 and ph["nvcc"] > 0, ph
    assert ph["batches"] < ph["built"], "no batch of two sources: the batched nvcc path did not run"
    assert "keys derived in" in res.kernels_summary


def test_second_compile_is_cached_and_never_tunes(env, cold, monkeypatch):
    """Every kernel of a family whose source files did not change meanwhile is a cache hit (the lowering cache is
    keyed by the family's source: an edit elsewhere in the checkout -- other engineers share it -- relowers that
    family, by design)."""
    _, _, cold_s, before, after = cold

    def no_tuning(*a, **k):
        raise AssertionError("compile must not tune")

    monkeypatch.setattr(tuner, "tune", no_tuning)
    monkeypatch.setattr(tuner, "tune_target", no_tuning)
    out, res, warm_s = _compile(env, "warm")
    now = _family_hashes()
    stable = {f for f in FAMILIES if before[f] == after[f] == now[f]}
    ents = res.plan.kernels["kernels"]
    assert stable & {e["family"] for e in ents}, "every family's source changed during the test: nothing to check"
    assert all(e["lower_cached"] for e in ents if e["family"] in stable), [e["name"] for e in ents
                                                                           if not e["lower_cached"]]  # fmt: skip
    if stable >= {e["family"] for e in ents}:
        assert warm_s < cold_s, (warm_s, cold_s)
    print(f"kernels: cold compile {cold_s:.1f} s, warm {warm_s:.1f} s")


def test_tuning_db_record_changes_the_config(env, monkeypatch):
    """sm100 (no runtime yet: the bindings' rule configs) takes a tuning-database record for its shape bucket;
    sm90 does not (its specs are the runtime adapters' keys, and the runtime reads no database)."""
    monkeypatch.setattr(tuner, "tune", lambda *a, **k: pytest.fail("compile must not tune"))
    graph = compile_model(None, "sm100", kernels="none").plan.graph
    rule, _ = plan_kernels.kernel_specs(graph, "sm100", "bound")
    gemm = next(s for s in rule if s.family == "fp8_gemm" and s.args[0] == 4096)
    node = gemm.nodes[0]
    attrs = next(n.attrs for n in graph.nodes if n.outputs[0].name == node)
    shape = graph.meta["kernels"]["nodes"][node]["buckets"]["prefill"]["shape"]
    key_shape = {"M": shape["M"], "N": shape["N"], "K": shape["K"], "g": attrs["block"]}
    db = tuner.TuningDB()
    key = tuner.make_key("fp8_gemm", key_shape, dtype=plan_kernels.GEMM_DTYPE, target="sm100")
    db.put(key, {**gemm.config, "block_n": 128, "stages": 4}, 0.01)
    db.save()
    specs, _ = plan_kernels.kernel_specs(graph, "sm100", "bound")
    mine = [s for s in specs if s.family == "fp8_gemm" and s.args[0] == 4096 and s.args[2] == gemm.args[2]]
    picked = [s for s in mine if s.source == "tuned"]
    assert picked and picked[0].config["block_n"] == 128 and picked[0].config["stages"] == 4
    manifest = plan_kernels.build_kernels(picked, "sm100", env / "tuned", jobs=1)
    (ent,) = manifest["kernels"]
    assert ent["config_source"] == "tuned" and ent["config"]["block_n"] == 128 and "error" not in ent
    graph90 = compile_model(None, "sm90", kernels="none").plan.graph
    specs90, _ = plan_kernels.kernel_specs(graph90, "sm90", "bound")
    assert specs90 and {s.source for s in specs90} == {"adapter"}


@pytest.mark.parametrize("how", ["altered", "missing"])
def test_altered_or_missing_artifact_fails_load_in_one_line(cold, tmp_path, how):
    out = tmp_path / "plan"
    shutil.copytree(cold[0], out)
    cubin = next((out / "kernels").glob("*.cubin"))
    if how == "altered":
        cubin.write_bytes(cubin.read_bytes() + b"\0")
    else:
        cubin.unlink()
    with pytest.raises(SerializationError) as e:
        load_plan(out)
    msg = str(e.value)
    assert "\n" not in msg and cubin.name in msg and how in msg


def test_kernels_none_writes_no_kernels(env):
    res = compile_model(None, "sm90", kernels="none")
    assert res.plan.kernels is None and res.plan.kernels_dir is None
    with pytest.raises(Exception, match="--kernels must be one of"):
        plan_kernels.kernel_specs(res.plan.graph, "sm90", "some")


def test_specs_with_the_same_program_lower_once_and_share_one_cubin(env, tmp_path, monkeypatch):
    """Two specs whose factory makes the same program (as keys that differ only in what the program ignores: a
    symbolic dim's bucket, sparse_attn_decode's ws pools): one lowering (the TIR-keyed cache answers the second), one
    nvcc (the source-keyed cubin), and each spec still gets its own source and a valid cubin in the manifest."""
    from deepinfer.codegen.kernels import rope

    cache = tmp_path / "cache"
    monkeypatch.setenv("DEEPINFER_CODEGEN_CACHE", str(cache))
    specs = [plan_kernels.KernelSpec("rope", "program", (None, 2, 64, 256 * (i + 1)), {"rope_dim": 64}, {}, "t")
             for i in range(2)]  # fmt: skip
    monkeypatch.setattr(plan_kernels, "_make_program", lambda spec, target: rope.program(
        None, 2, 64, 256, rope_dim=64, inverse=False, target=target))  # fmt: skip
    lowered, compiled = [], []
    real_lower, real_nvcc = tb.lower, tb.compile_cubin
    monkeypatch.setattr(tb, "lower", lambda *a: lowered.append(1) or real_lower(*a))
    monkeypatch.setattr(tb, "compile_cubin", lambda src, tgt: compiled.append(src) or real_nvcc(src, tgt))
    manifest = plan_kernels.build_kernels(specs, "sm90", tmp_path / "out", jobs=1)
    ents = manifest["kernels"]
    assert all("error" not in e for e in ents) and len({e["name"] for e in ents}) == 2, ents
    assert len(lowered) == 1, "the second spec's program is the first's: its lowering must come from the cache"
    assert len(set(compiled)) == 1 and len(list(cache.glob("sm90/*.cubin"))) == 1, compiled
    for e in ents:
        assert (tmp_path / "out" / e["files"]["cubin"]["file"]).stat().st_size > 0 and e["sass_mma"] == {}


def _source(path, prelude: str, kernel: str, size: int):
    body = f'extern "C" __global__ void {kernel}(float* X) {{\n' + "  X[0] = 1.0f;\n" * (size // 16) + "}\n"
    path.write_text(prelude + body)
    return path


def test_batches_hold_one_prelude_and_spread_a_large_group_over_the_processes(tmp_path):
    """plan_batches: every source in exactly one batch; a batch's sources share their #include prelude (one cicc
    parses it once); a group several times a process's share is split, a small one is not; largest first."""
    big = [_source(tmp_path / f"g{i}.cu", "#include <a.h>\n\n", f"k{i}", 200_000) for i in range(6)]
    small = [_source(tmp_path / f"s{i}.cu", "#include <b.h>\n\n", f"k{i}", 20_000) for i in range(2)]
    odd = tmp_path / "odd.cu"
    odd.write_text("__global__ void not_extern_c() {}\n")  # no extern "C" kernel: compiled on its own
    batches = plan_kernels.plan_batches(big + small + [odd], jobs=2)
    assert sorted(str(s) for b in batches for s in b) == sorted(str(s) for s in big + small + [odd])
    for b in batches:
        assert len({s.read_text().split("extern")[0] for s in b}) == 1
    assert [len(b) for b in batches if b[0] in big] == [3, 3]  # 1.1 M of the 1.5 M characters: two batches
    assert [sorted(b) for b in batches if b[0] in small] == [sorted(small)]  # 37 k characters: one batch
    assert [odd] in batches
    sizes = [sum(len(s.read_text()) for s in b) for b in batches]
    assert sizes == sorted(sizes, reverse=True)
    assert len(plan_kernels.plan_batches(big, jobs=1)) == 1


def test_lowering_order_is_longest_first():
    """The pool takes the costliest lowerings first (a 6 s attention lowering started last would leave the other
    process idle), and within one family keeps spread_families' order."""
    items = ["rmsnorm_quant.program", "moe_grouped_gemm.swab_program", "sparse_attn_decode.program",
             "rmsnorm_quant.program", "sparse_attn_decode.program", "unlisted.program"]  # fmt: skip
    order = plan_kernels.longest_first(list(range(len(items))), key=lambda i: items[i])
    costs = [plan_kernels.LOWER_COST_S.get(items[i], plan_kernels.DEFAULT_LOWER_S) for i in order]
    assert costs == sorted(costs, reverse=True) and sorted(order) == list(range(len(items)))
    assert [items[i] for i in order[:2]] == ["sparse_attn_decode.program"] * 2


def test_a_program_another_process_is_lowering_is_deferred_not_lowered_twice(tmp_path, monkeypatch):
    """lower_one(defer=True) finds another process's `.lowering` mark on the program's cache file: it returns
    "deferred" without lowering (build_kernels asks again once the first round is done); without defer it lowers
    (a mark an interrupted compile left behind must not block the build), and the mark is gone afterwards."""
    from deepinfer.codegen.kernels import rope

    monkeypatch.setenv("DEEPINFER_CODEGEN_CACHE", str(tmp_path / "cache"))
    spec = plan_kernels.KernelSpec("rope", "program", (None, 2, 64, 256), {"rope_dim": 64}, {}, "t")
    monkeypatch.setattr(plan_kernels, "_make_program", lambda spec, target: rope.program(
        None, 2, 64, 256, rope_dim=64, inverse=False, target=target))  # fmt: skip
    lowered = []
    real_lower = tb.lower
    monkeypatch.setattr(tb, "lower", lambda *a: lowered.append(1) or real_lower(*a))
    script = plan_kernels._make_program(spec, "sm90").script()
    import tilelang

    path = tb.cache_dir() / "sm90" / "by_program" / f"tir-{tb.content_hash(script, 'sm90', tilelang.__version__)}.cu"
    path.parent.mkdir(parents=True)
    mark = path.with_suffix(".lowering")
    mark.touch()
    assert plan_kernels.lower_one(spec, "sm90", defer=True) == {"name": spec.name, "deferred": True}
    assert not lowered and not path.exists()
    res = plan_kernels.lower_one(spec, "sm90")
    assert "error" not in res and len(lowered) == 1 and path.exists() and not mark.exists(), res
