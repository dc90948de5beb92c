"""benchmarks/gpu_e2e.py's weight-independent kernel check (PairedKernels: each kernel against its emulation on
identical operands) and its --formats parsing, on synthetic kernels (CPU, no plan)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_e2e as g  # noqa: E402


def _paired(real, emulated, calls: int = 2) -> g.PairedKernels:
    paired = g.PairedKernels(calls=calls)
    paired.ka = SimpleNamespace(build_kernel=lambda key: real, emulated_kernel=lambda key: emulated)
    return paired


def _key(family="fp8_gemm", program="program"):
    return SimpleNamespace(family=family, program=program)


def _off(paired) -> list[str]:
    return [k for k, v in paired.err.items() if v[1] > g.KERNEL_REL_L2 or v[2] > g.KERNEL_FP8_CODES]


def _gemm(scale: float = 1.0):
    def run(a, out):
        out.copy_((a @ a.T) * scale)

    return run


def test_a_kernel_off_its_emulation_is_flagged_and_one_ulp_is_not():
    a = torch.randn(16, 32)
    ok = _paired(_gemm(1.0 + 2.0**-9), _gemm())  # one bf16 ulp everywhere: what accumulation order can do
    ok(_key())(a, torch.empty(16, 16))
    assert _off(ok) == [] and 0 < ok.err["fp8_gemm.program"][1] < 1e-2
    bad = _paired(_gemm(1.05), _gemm())
    run = bad(_key())
    run(a, torch.empty(16, 16))
    assert _off(bad) == ["fp8_gemm.program"]
    # after `calls` paired calls only the real kernel runs (the record keeps the worst seen)
    run(a, torch.empty(16, 16))
    out = torch.empty(16, 16)
    run(a, out)
    assert torch.allclose(out, (a @ a.T) * 1.05)


def test_fp8_code_flips_are_counted():
    x = torch.randn(64, 32)

    def quant(shift: int):
        def run(src, codes):
            c = src.to(torch.float8_e4m3fn).view(torch.uint8).clone()
            c[:shift] += 1  # one e4m3 step up on the first `shift` rows
            codes.copy_(c.view(torch.float8_e4m3fn))

        return run

    paired = _paired(quant(4), quant(0))
    paired(_key("rmsnorm_quant"))(x, torch.empty(64, 32, dtype=torch.float8_e4m3fn))
    assert paired.err["rmsnorm_quant.program"][2] == pytest.approx(4 / 64)
    assert _off(paired) == ["rmsnorm_quant.program"]


def test_empty_chunk_sentinels_are_not_compared_by_size():
    """A split-K chunk with no valid entry keeps its running max at -1e30 (scaled by the softmax scale in the
    kernel, not in the emulation): both are "empty", not a 30-orders-of-magnitude error."""

    def partial(sentinel: float):
        def run(q, mp):
            mp.copy_(q)
            mp[:, 1] = sentinel

        return run

    q = torch.randn(4, 3)
    paired = _paired(partial(-1e30 * 0.088), partial(-1e30))
    paired(_key("sparse_attn_decode"))(q, torch.empty(4, 3))
    assert _off(paired) == [] and paired.err["sparse_attn_decode.program"][3] == 0
    one_sided = _paired(partial(-1e30), partial(-3.0))
    one_sided(_key("sparse_attn_decode"))(q, torch.empty(4, 3))
    assert one_sided.err["sparse_attn_decode.program"][3] == 4


def test_formats_entries_parse_with_their_weights():
    assert g.parse_formats("deepseek-v4-flash=tiny,deepseek-v4.1-flash=tiny:peaked") == [
        ("deepseek-v4-flash", "tiny", "random"), ("deepseek-v4.1-flash", "tiny", "peaked")]
    for bad in ("deepseek-v4.1-flash=tiny:trained", "deepseek-v4.1-flash"):
        with pytest.raises(SystemExit):
            g.parse_formats(bad)


def test_swab_rows_past_an_experts_count_are_not_compared():
    """swab_program over the masked layout (E experts x max_rows): rows past an expert's count are junk in the
    kernel (its docstring) and left untouched by the emulation, so the buffer's own junk stays there; only the live
    rows (kernel_adapters.swab_rows: expert counts 2 and 0 and 3 of 4 rows) are compared -- C's rows and the SwiGLU
    scales' columns. The junk's differing elements are counted apart (shown, not judged); a wrong live row is
    flagged. (s11 call 3: the small e2e's swab_program 'off' by rel L2 155 with 70% of FP8 codes differing.)"""
    from deepinfer.runtime import kernel_adapters as ka

    e, max_rows, n = 3, 4, 8
    key = ka._key("moe_grouped_gemm", "swab_program", (e * max_rows, 2 * n, 32, e), None, max_rows=max_rows,
                  fmt="fp8", act_group=32, weight_block=32, swiglu_limit=10.0)  # fmt: skip
    counts = torch.tensor([2, 0, 3], dtype=torch.int32)
    live = ka.swab_rows(key, counts) >= 0
    assert live.tolist() == [True, True, False, False] + [False] * 4 + [True, True, True, False]

    def swab(junk: float, live_error: float = 0.0):
        def run(a, sa_t, b, sb, meta, c, scales):
            c[live], scales[:, live] = a[live] * (1 + live_error), 1.0  # the live rows' values
            if junk:  # a kernel writes whatever it computed into the rows past the counts
                c[~live], scales[:, ~live] = junk, junk

        return run

    def operands():
        a = torch.randn(e * max_rows, n)
        return [a, None, None, None, counts, torch.full((e * max_rows, n), 7.0), torch.full((1, e * max_rows), 7.0)]

    paired = _paired(swab(junk=float("nan")), swab(junk=0.0))
    paired.ka = SimpleNamespace(build_kernel=paired.ka.build_kernel, emulated_kernel=paired.ka.emulated_kernel,
                                swab_rows=ka.swab_rows)  # fmt: skip
    paired(key)(*operands())
    rec = paired.err["moe_grouped_gemm.swab_program"]
    assert _off(paired) == [] and rec[3] == 0 and rec[4] == 7 * n + 7  # C's 7 dead rows, the scales' 7 columns
    wrong = _paired(swab(junk=0.0, live_error=0.05), swab(junk=0.0))
    wrong.ka = SimpleNamespace(build_kernel=wrong.ka.build_kernel, emulated_kernel=wrong.ka.emulated_kernel,
                               swab_rows=ka.swab_rows)  # fmt: skip
    wrong(key)(*operands())
    assert _off(wrong) == ["moe_grouped_gemm.swab_program"]
