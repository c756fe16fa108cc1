"""Dynamic fp16 loss scaling follows DeepSpeed's rule: hysteresis absorbs overflows, then each halves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tnlg.sharding import ZeroConfig, initialize
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


def test_a_skipped_step_is_logged_with_its_scales(caplog):
    # the skip showed only as a NaN gradient norm in the run's metrics, if those were logged at all
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine = initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        ZeroConfig(stage=1, mixed_precision="fp16", initial_loss_scale=2.0**40, hysteresis=1),
    )
    with caplog.at_level("INFO", logger="tnlg.sharding.optimizer"):
        engine.backward(engine(torch.randn(2, 4).half()).float().sum())
        engine.step()
    assert engine.step_was_skipped
    assert "step skipped: the gradient norm is nan at loss scale 1.09951e+12 (now 5.49756e+11)" in caplog.text
