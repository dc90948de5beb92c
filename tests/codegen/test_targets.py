import pytest

from deepinfer.codegen.targets import TARGETS, get_target
from deepinfer.errors import ConfigError, DeepInferError


def test_all_four_targets_exist():
    assert set(TARGETS) == {"cpu", "sm90", "sm100", "ascend950"}


def test_cuda_targets_use_dict_form_and_arch():
    for name, arch, cc in (("sm90", "sm_90a", 90), ("sm100", "sm_100a", 100)):
        t = get_target(name)
        assert t.tilelang_target == {"kind": "cuda", "arch": arch}  # TileLang 0.1.15 rejects CLI strings
        assert t.arch == arch and t.cc == cc and t.is_cuda
        assert "float8_e4m3" in t.dtypes and "tilelang" in t.backends


def test_nominal_rates_are_consistent():
    h200 = get_target("sm90")
    assert h200.peak_fp8_nominal == pytest.approx(2 * h200.peak_bf16_nominal, rel=0.01)
    assert 100 < h200.ridge_point("fp8") < 1000
    assert get_target("sm100").peak_fp8_nominal > h200.peak_fp8_nominal
    assert not get_target("ascend950").is_cuda and get_target("ascend950").cc == 0


def test_unknown_target_raises_one_line_config_error():
    with pytest.raises(ConfigError) as err:
        get_target("sm80")
    msg = str(err.value)
    assert "sm80" in msg and "\n" not in msg and "sm90" in msg
    assert isinstance(err.value, DeepInferError)
