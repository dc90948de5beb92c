"""moe_routing with a symbolic token count (program(None, ...), what the runtime builds): one c-target build routes
two token counts exactly (the float64 argsort oracle's experts; block_m 4 leaves a partial last block, whose rows
past T must be neither read into the result nor written), and the sm90 build has no local-memory spills."""

import pytest
import torch

from deepinfer.codegen.kernels import moe_routing

E, K, SCALE = 64, 6, 1.5


def test_symbolic_rows_one_build_two_token_counts(tilelang_required):
    from deepinfer.codegen.tilelang_backend import compile_cpu

    kernel = compile_cpu(moe_routing.program(None, E, topk=K, route_scale=SCALE, target="cpu",
                                             cfg=moe_routing.Config(4, 128)))  # fmt: skip
    for t in (7, 2):
        torch.manual_seed(t)
        logits, bias = torch.randn(t, E) * 2, torch.randn(E) * 0.2
        # the outputs are the first t rows of taller buffers: a write past row t shows in the spare rows
        idx_buf, w_buf = torch.full((t + 4, K), -7, dtype=torch.int32), torch.full((t + 4, K), float("nan"))
        kernel(logits, bias, idx_buf[:t], w_buf[:t])
        oidx, ow = moe_routing.reference_f64(logits, bias, K, SCALE)
        assert torch.equal(idx_buf[:t].long(), oidx), t
        assert (w_buf[:t].double() - ow).abs().max() < 1e-5, t
        assert (idx_buf[t:] == -7).all() and w_buf[t:].isnan().all(), "rows past T written"


@pytest.mark.parametrize("target", ["sm90"])
def test_symbolic_rows_build_for_cuda(codegen_cache, nvcc_required, target):
    from deepinfer.codegen import tilelang_backend as tb

    art = tb.build(f"moe_routing_sym_{target}", moe_routing.program(None, 384, topk=6, route_scale=1.5, target=target),
                   target)  # fmt: skip
    assert "int T" in art.source, "the token count is a kernel argument"
    assert art.opcodes["LDG"] > 0 and art.opcodes["STG"] > 0
    assert art.opcodes["LDL"] == 0 and art.opcodes["STL"] == 0, "no local-memory spills"
