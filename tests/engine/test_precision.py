"""Dtype policy and the dynamic loss scaler, on CPU."""

import json

import pytest
import torch

from tierzero import precision
from tierzero.config import DType
from tierzero.errors import ConfigError, TierzeroError
from tierzero.precision import (
    DynamicLossScaler,
    check_dtype_supported,
    compute_dtype,
    default_dtype,
)

CPU = torch.device("cpu")


def test_compute_dtype_maps_each_policy_on_cpu() -> None:
    assert compute_dtype(DType.FP32, CPU) is torch.float32
    assert compute_dtype(DType.BF16, CPU) is torch.bfloat16
    assert compute_dtype(DType.FP16, CPU) is torch.float16


def test_default_dtype_on_cpu_is_fp32() -> None:
    assert default_dtype(CPU) is DType.FP32


def test_unsupported_dtype_names_device_and_suggests_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    precision.supports.cache_clear()
    monkeypatch.setattr(precision, "probe_dtype", lambda dtype, device: dtype is not torch.float16)
    try:
        with pytest.raises(ConfigError, match=r"fp16 .*device 'cpu'.*--dtype fp32"):
            check_dtype_supported(DType.FP16, CPU)
        check_dtype_supported(DType.BF16, CPU)
        check_dtype_supported(DType.FP32, CPU)
    finally:
        precision.supports.cache_clear()


def test_probe_reports_a_failing_kernel_as_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_ones(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError('"addmm" not implemented for this dtype')

    monkeypatch.setattr(torch, "ones", broken_ones)
    assert precision.probe_dtype(torch.float16, CPU) is False


def test_overflow_halves_and_skips_then_grows_after_interval() -> None:
    s = DynamicLossScaler(init_scale=2.0**16, growth_interval=3)
    assert s.update(found_inf=True) is False
    assert s.scale == 2.0**15
    assert [s.update(False) for _ in range(2)] == [True, True]
    assert s.scale == 2.0**15
    assert s.update(False) is True
    assert s.scale == 2.0**16
    # an overflow resets the run of good steps
    s.update(False)
    s.update(False)
    s.update(True)
    s.update(False)
    s.update(False)
    assert s.scale == 2.0**15


def test_state_round_trip_through_json() -> None:
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=5)
    s.update(True)
    s.update(False)
    s.update(False)
    t = DynamicLossScaler(init_scale=1024.0, growth_interval=5)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.scale == s.scale == 512.0
    for _ in range(3):
        assert t.update(False) == s.update(False)
    assert t.scale == s.scale == 1024.0


def test_malformed_state_is_named() -> None:
    s = DynamicLossScaler(growth_interval=5)
    with pytest.raises(TierzeroError, match="malformed"):
        s.load_state_dict({"scale": 3.0, "good_steps": 0})
    with pytest.raises(TierzeroError, match="malformed"):
        s.load_state_dict({"scale": 4.0})


@pytest.mark.parametrize("bad", [3.0, 0.0, -4.0, 1000.0, float("inf")])
def test_init_scale_must_be_a_power_of_two(bad: float) -> None:
    with pytest.raises(ConfigError, match="power of two"):
        DynamicLossScaler(init_scale=bad)


def test_other_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="growth interval"):
        DynamicLossScaler(growth_interval=0)
    with pytest.raises(ConfigError, match="backoff"):
        DynamicLossScaler(backoff=0.3)
    with pytest.raises(ConfigError, match="growth"):
        DynamicLossScaler(growth=1.0)


def test_disabled_scaler_is_one_and_never_skips() -> None:
    s = DynamicLossScaler(enabled=False)
    assert s.scale == 1.0
    assert s.update(found_inf=True) is True
    assert s.scale == 1.0
