"""AscendC emitted through TileLang 0.1.15's Ascend 950 backend, checked structurally.

No CANN/bisheng here, so nothing is compiled; we check that the source has the shape an Ascend 950
kernel must have: the core split (a mixed Cube/Vector kernel is `__mix__(1, 2)` with AIC/AIV sections,
a vector-only kernel is `__vector__`), pipe synchronisation between the DMA and compute pipes, and
the intrinsics each family is built from.
"""

import re

import pytest

from deepinfer.codegen.kernels import fp8_gemm, hyper_connection, moe_routing, rmsnorm_quant


@pytest.fixture(scope="module")
def sources(tilelang_required, codegen_cache):
    from deepinfer.codegen import tilelang_backend as tb

    programs = {
        "fp8_gemm": fp8_gemm.ascend_program(
            512, 1280, 5120, act_group=32, weight_block=32, cfg=fp8_gemm.Config(128, 128, 32, 2, 128)
        ),
        "rmsnorm": rmsnorm_quant.ascend_program(4096, 5120, eps=1e-20, block_m=2),
        "moe_routing": moe_routing.ascend_program(4096, 384, topk=6, route_scale=1.5),
        "hc_post": hyper_connection.ascend_post_program(4096, 5120),
    }
    return {name: tb.build(f"{name}_ascend", f, "ascend950") for name, f in programs.items()}


def _kernel_signature(src):
    return re.search(r'extern "C" __global__ (\S+(?: \S+)?) void (\w+)\(', src)


def test_sources_are_written_as_cpp(sources):
    for art in sources.values():
        assert art.source_path.suffix == ".cpp" and art.source_path.read_text() == art.source
        assert art.cubin_path is None


def test_fp8_gemm_is_a_mixed_cube_vector_kernel(sources):
    src = sources["fp8_gemm"].source
    assert "__mix__(1, 2)" in src  # one Cube core drives two Vector cores
    assert "ASC_IS_AIC" in src and "ASC_IS_AIV" in src
    assert "ascend_gemm_l1" in src  # Cube MMA from L1
    assert "asc_copy_gm2l1_nd2nz" in src  # operands to L1 in the fractal (NZ) layout
    assert "asc_copy_l0c2ub" in src  # the accumulator handed to the vector cores (dual_copy)
    assert "asc_sync_intra_arrive" in src and "asc_sync_intra_wait" in src  # cross-core handshake
    assert "__simt_vf__" in src and "asc_vf_call" in src  # the scale promotion on the vector cores


@pytest.mark.parametrize("name", ["rmsnorm", "moe_routing", "hc_post"])
def test_vector_families_run_on_vector_cores_only(sources, name):
    src = sources[name].source
    sig = _kernel_signature(src)
    assert sig and sig.group(1) == "__vector__", sig
    assert "ASC_IS_AIC" not in src and "ascend_gemm" not in src
    assert "asc_copy_gm2ub_align" in src and "asc_copy_ub2gm_align" in src  # GM <-> Unified Buffer DMA
    assert "__simt_vf__" in src


@pytest.mark.parametrize("name", ["fp8_gemm", "rmsnorm", "moe_routing", "hc_post"])
def test_pipes_are_synchronised(sources, name):
    src = sources[name].source
    # every notify has a matching wait, and loads (MTE2) are fenced before vector compute (V)
    notifies = re.findall(r"asc_sync_notify\((PIPE_\w+), (PIPE_\w+)", src)
    waits = re.findall(r"asc_sync_wait\((PIPE_\w+), (PIPE_\w+)", src)
    assert notifies and sorted(set(notifies)) == sorted(set(waits))
    assert ("PIPE_MTE2", "PIPE_V") in notifies


def test_rmsnorm_reduces_with_simd_intrinsics(sources):
    src = sources["rmsnorm"].source
    assert "__simd_vf__" in src and "simd_inst::vcadd" in src  # row sums as vector reductions
    assert "rsqrtf" in src


def test_routing_selection_is_per_token_serial(sources):
    src = sources["moe_routing"].source
    assert "sqrtf" in src and "expf" in src
    assert re.search(r"for \(int32_t e = 0; e < 384; \+\+e\)", src)
