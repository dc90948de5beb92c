"""dtype round trips: fp4 packing/encoding, e8m0, fp8, and the torch mappings."""

import pytest
import torch

from deepinfer.errors import IRError
from deepinfer.ir import dtypes as dt


def test_every_dtype_maps_to_torch_and_back():
    for d in dt.ALL_DTYPES.values():
        assert dt.dtype(d.name) is d
        if d is not dt.f4e2m1x2:
            assert dt.from_torch(d.torch_dtype) is d
            t = torch.zeros(3, dtype=d.torch_dtype)
            assert t.element_size() == d.itemsize
    assert dt.from_torch(torch.float4_e2m1fn_x2) is dt.f4e2m1x2
    with pytest.raises(IRError, match="unknown dtype 'f7'"):
        dt.dtype("f7")


def test_fp4_code_table_matches_spec():
    # MODEL_SPEC §4.3: 0:0, 1:0.5, 2:1, 3:1.5, 4:2, 5:3, 6:4, 7:6; 8..15 negated.
    spec = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    codes = torch.arange(16, dtype=torch.uint8)
    vals = dt.fp4_decode(codes)
    assert vals[:8].tolist() == spec
    assert vals[8:].tolist() == [-v for v in spec]


def test_fp4_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    back = dt.fp4_encode(dt.fp4_decode(codes))
    assert back.tolist() == codes.tolist()


def test_fp4_rounds_to_nearest_ties_to_even():
    x = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.4, 2.5, 2.6, 3.5, 5.0, 5.1, 100.0, -0.75, -7.0])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0]
    assert dt.fp4_decode(dt.fp4_encode(x)).tolist() == want


def test_fp4_pack_low_nibble_is_even_column():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = dt.pack_fp4(codes)
    assert packed.tolist() == [[1 | (2 << 4), 15]]
    assert dt.unpack_fp4(packed).tolist() == codes.tolist()
    g = torch.Generator().manual_seed(0)
    many = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(dt.unpack_fp4(dt.pack_fp4(many)), many)
    # torch's own packed dtype views the same bytes
    assert torch.equal(dt.unpack_fp4(dt.pack_fp4(many).view(torch.float4_e2m1fn_x2)), many)
    with pytest.raises(IRError, match="even last dim"):
        dt.pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_e8m0_round_trip_and_value():
    exps = torch.arange(-127, 128)
    vals = torch.exp2(exps.double()).float()
    enc = dt.float_to_e8m0(vals)
    assert enc.dtype == torch.float8_e8m0fnu
    assert enc.view(torch.uint8).tolist() == (exps + 127).tolist()  # value = 2^(byte-127)
    assert torch.equal(dt.e8m0_to_float(enc), vals)
    # non powers of two round up
    assert dt.e8m0_to_float(dt.float_to_e8m0(torch.tensor([3.0, 0.3]))).tolist() == [4.0, 0.5]


def test_pow2_scale_is_ceil_of_amax_over_qmax():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0])
    s = dt.pow2_scale(amax, 448.0)
    assert s.tolist() == [1.0, 2.0, 2.0**-8, 2.0**-22]  # 0 uses the 1e-4 floor: 2^ceil(log2(1e-4/448))


def test_fp8_saturates_and_round_trips_representable_values():
    x = torch.tensor([0.0, 1.0, -2.5, 448.0, 1000.0, -1000.0])
    y = dt.fp8_to_float(dt.float_to_fp8(x))
    assert y.tolist() == [0.0, 1.0, -2.5, 448.0, 448.0, -448.0]
