"""Dynamic fp16 loss scaling follows DeepSpeed's rule: hysteresis absorbs overflows, then each halves."""

from __future__ import annotations

import pytest

from tnlg.sharding import ZeroConfig
from tnlg.sharding.loss_scaler import LossScaleError, LossScaler


def _scales(config: ZeroConfig, overflows: list[bool]) -> list[float]:
    scaler = LossScaler(config)
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_hysteresis_absorbs_then_every_overflow_halves():
    config = ZeroConfig(mixed_precision="fp16", hysteresis=2)
    assert _scales(config, [True] * 6) == [65536.0, 32768.0, 16384.0, 8192.0, 4096.0, 2048.0]


def test_a_clean_window_doubles_and_rearms_the_hysteresis():
    config = ZeroConfig(mixed_precision="fp16", hysteresis=2, loss_scale_window=3)
    scales = _scales(config, [True, True, False, False, False, True, True])
    assert scales == [65536.0, 32768.0, 32768.0, 32768.0, 65536.0, 65536.0, 32768.0]


def test_the_scale_never_drops_below_the_minimum_and_static_scales_stay():
    config = ZeroConfig(mixed_precision="fp16", hysteresis=1, initial_loss_scale=6.0, min_loss_scale=2.0)
    assert _scales(config, [True] * 2) == [3.0, 2.0]
    assert _scales(ZeroConfig(mixed_precision="fp16", static_loss_scale=128.0), [True, False]) == [
        128.0,
        128.0,
    ]
    assert _scales(ZeroConfig(mixed_precision="bf16"), [True]) == [1.0]


def test_an_overflow_at_the_minimum_scale_stops_the_run_as_deepspeeds_does():
    # every later step would be skipped: the engine went on training nothing, without a word
    config = ZeroConfig(mixed_precision="fp16", hysteresis=2, initial_loss_scale=4.0, min_loss_scale=2.0)
    scaler = LossScaler(config)
    for overflow in (True, True, False):  # absorbed by the hysteresis, halved to the minimum, clean
        scaler.update(overflow)
    assert scaler.scale == 2.0
    with pytest.raises(LossScaleError, match=r"overflowed at the minimum loss scale 2\.0 \(min_loss_scale\)"):
        scaler.update(True)
    assert scaler.scale == 2.0
