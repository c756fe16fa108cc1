"""Dynamic fp16 loss scaling follows DeepSpeed's rule: hysteresis absorbs overflows, then each halves; its
window counted as torch's GradScaler counts, or (a DeepSpeed JSON's) as DeepSpeed's scaler does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.deepspeed import zero_config_from
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


class DeepSpeedRule:
    """DeepSpeed 0.19's DynamicLossScaler update, restated from its rule: updates are numbered from 0 and
    the last overflow's number is kept (-1 at the start); an overflow halves unless hysteresis is left to
    absorb it; a clean update doubles when the clean updates before it since the last overflow are a
    positive multiple of the window, and re-arms the hysteresis then (or at every clean update, with
    consecutive hysteresis)."""

    def __init__(self, scale: float, window: int, hysteresis: int, consecutive: bool):
        self.scale, self.window, self.hysteresis, self.consecutive = scale, window, hysteresis, consecutive
        self.left, self.update_number, self.last_overflow = hysteresis, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.left == 1:
                self.scale /= 2.0
            else:
                self.left -= 1
            self.last_overflow = self.update_number
        else:
            if self.consecutive:
                self.left = self.hysteresis
            clean_before = self.update_number - self.last_overflow - 1
            if clean_before > 0 and clean_before % self.window == 0:
                self.left = self.hysteresis
                self.scale *= 2.0
        self.update_number += 1


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(("window", "hysteresis"), [(1, 1), (2, 2), (3, 2), (4, 3)])
def test_deepspeed_counting_takes_deepspeeds_scale_path(window, hysteresis, consecutive):
    generator = torch.Generator().manual_seed(window * 10 + hysteresis)
    config = ZeroConfig(
        mixed_precision="fp16",
        loss_scale_window=window,
        hysteresis=hysteresis,
        min_loss_scale=2.0**-60,  # never reached: the path is the rule's alone
        loss_scale_counting="deepspeed",
        consecutive_hysteresis=consecutive,
    )
    for _ in range(20):
        overflows = (torch.rand(40, generator=generator) < 0.3).tolist()
        reference = DeepSpeedRule(config.initial_loss_scale, window, hysteresis, consecutive)
        expected = []
        for overflow in overflows:
            reference.update(overflow)
            expected.append(reference.scale)
        assert _scales(config, overflows) == expected, overflows


def test_the_two_countings_double_a_step_apart_after_the_start_and_after_each_overflow():
    steps = [False] * 4 + [True] + [False] * 4
    torch_counted = ZeroConfig(mixed_precision="fp16", hysteresis=1, loss_scale_window=3)
    deepspeed_counted = torch_counted.replace(loss_scale_counting="deepspeed")
    s = 65536.0
    # GradScaler: the 3rd clean step doubles; DeepSpeed: the 4th after the start or an overflow
    assert _scales(torch_counted, steps) == [s, s, 2 * s, 2 * s, s, s, s, 2 * s, 2 * s]
    assert _scales(deepspeed_counted, steps) == [s, s, s, 2 * s, s, s, s, s, 2 * s]


def test_consecutive_hysteresis_is_rearmed_by_every_clean_step():
    steps = [True, False, True, False, True]
    plain = ZeroConfig(mixed_precision="fp16", hysteresis=2, loss_scale_window=100)
    s = 65536.0
    assert _scales(plain, steps) == [s, s, s / 2, s / 2, s / 4]
    assert _scales(plain.replace(consecutive_hysteresis=True), steps) == [s] * 5


def test_a_deepspeed_json_counts_as_deepspeed_and_reads_consecutive_hysteresis():
    fp16 = {"enabled": True, "loss_scale_window": 3, "consecutive_hysteresis": True}
    config = zero_config_from({"fp16": fp16, "zero_optimization": {"stage": 2}})
    assert (config.loss_scale_counting, config.consecutive_hysteresis) == ("deepspeed", True)
    assert zero_config_from({"stage": 2, "mixed_precision": "fp16"}).loss_scale_counting == "torch"
    # a lone gradient_clipping reads as ZeroConfig fields as well: the same config either way
    assert zero_config_from({"gradient_clipping": 1.0}) == ZeroConfig(gradient_clipping=1.0)


@pytest.mark.parametrize("counting", ["deepspeed", "torch"])
def test_a_scaler_resumed_from_deepspeeds_position_follows_its_path(counting):
    """DeepSpeed's scaler saved at random points of random runs, read as its checkpoint reader reads it
    ([Note: DeepSpeed's scaler position]) into a fresh scaler: both then go on through random overflows.
    Counted as DeepSpeed counts, the paths agree to the end; counted as GradScaler counts, until the next
    overflow (from there it doubles a step sooner)."""
    from types import SimpleNamespace

    from tnlg.sharding.deepspeed.zero_checkpoint import _loss_scaler

    generator = torch.Generator().manual_seed(3)
    config = ZeroConfig(
        mixed_precision="fp16",
        loss_scale_window=3,
        hysteresis=2,
        min_loss_scale=2.0**-60,
        loss_scale_counting=counting,
    )
    differed = 0
    for _ in range(200):
        reference = DeepSpeedRule(config.initial_loss_scale, 3, 2, consecutive=False)
        for overflow in (
            torch.rand(int(torch.randint(0, 20, (1,), generator=generator)), generator=generator) < 0.3
        ).tolist():
            reference.update(overflow)
        saved = {
            "cur_scale": reference.scale, "dynamic": True, "cur_iter": reference.update_number,
            "last_overflow_iter": reference.last_overflow, "scale_window": 3, "cur_hysteresis": reference.left,
        }  # fmt: skip
        read = _loss_scaler(SimpleNamespace(state=saved), fp16=True)
        scaler = LossScaler(config)
        scaler.load_state_dict(
            {"scale": read["loss_scale"], "clean_steps": read["loss_scale_clean_steps"], "overflows_left": read["loss_scale_overflows_left"]}
        )  # fmt: skip
        later = (torch.rand(30, generator=generator) < 0.3).tolist()
        ours, theirs = [], []
        for overflow in later:
            scaler.update(overflow)
            reference.update(overflow)
            ours.append(scaler.scale)
            theirs.append(reference.scale)
        first_overflow = later.index(True) if True in later else len(later)
        assert (
            ours[: first_overflow + 1] == theirs[: first_overflow + 1]
        )  # either count, up to the next overflow
        differed += ours != theirs
    assert differed == 0 if counting == "deepspeed" else differed > 0
