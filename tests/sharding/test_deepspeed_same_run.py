"""DeepSpeed's own runs (tests/assets/deepspeed, recorded by tests/support/deepspeed_fixtures.py under
DeepSpeed 0.19) trained again by tnlg's engine from the same initial weights with the same DeepSpeed
JSON: its losses must be DeepSpeed's step for step, and under fp16 its loss scales DeepSpeed's too (the
JSON's window counted as DeepSpeed counts it: [Note: loss-scale counting] in sharding/loss_scaler.py)."""

from __future__ import annotations

import json

import pytest

from tests.support.deepspeed_fixtures import CASES, RESUMED_STEPS
from tests.support.deepspeed_resume_cases import train_in_tnlg_from_start
from tnlg.tools.spawn import run_distributed

CASE = {case.name: case for case in CASES}


def deepspeed_run(name: str) -> dict:
    """DeepSpeed's record: the losses of its whole run (before the save, then resumed, which DeepSpeed
    resumes exactly) and, under fp16, the scales and applied flags of its resumed steps."""
    return json.loads((CASE[name].directory / "resumed_losses.json").read_text())


@pytest.mark.parametrize(
    ("name", "world", "stage"),
    [
        ("stage2_world2", 2, 2),  # DeepSpeed's layout, WarmupLR ramping over every step
        ("stage2_world2", 1, 3),
        ("stage1_world2", 2, 1),
        ("stage3_world4", 2, 3),
        ("stage2_world2_accumulation2", 2, 2),  # 2 micro-batches a step (forward, backward, step each)
        ("stage2_world2_accumulation2", 1, 1),
        ("stage2_world2_bf16", 2, 2),
        ("stage3_world2_bf16", 2, 3),
    ],
)
def test_deepspeeds_json_trains_deepspeeds_losses(name, world, stage):
    result = run_distributed(train_in_tnlg_from_start, world, name, stage, timeout=300)[0]
    record = deepspeed_run(name)
    theirs = record["losses_before_save"] + record["resumed_losses"]
    assert len(result["losses"]) == len(theirs) == CASE[name].save_at + RESUMED_STEPS
    tolerance = 3e-4 if CASE[name].precision == "bf16" else 1e-5  # bf16 updates round apart (1.1e-4)
    for ours, expected in zip(result["losses"], theirs, strict=True):
        assert abs(ours - expected) <= tolerance * abs(expected), (result["losses"], theirs)
    if CASE[name].warmup:
        assert result["lrs"][-RESUMED_STEPS:] == pytest.approx(record["resumed_lrs"], rel=1e-12)


@pytest.mark.parametrize("name", ["stage2_world2_fp16_step1", "stage2_world2_fp16_step4"])
def test_deepspeeds_fp16_json_takes_deepspeeds_loss_scale_path(name):
    """From 2**18 the first two steps overflow (the hysteresis absorbs one, the other halves), then
    steps are clean with a window of 3: DeepSpeed doubles at the 4th clean step after the overflow (step
    5's update, so step 6 runs at 2**18), where torch's GradScaler count doubles at the 3rd (step 5 ran
    at 2**18 when tnlg counted so). At DeepSpeed's 2 ranks: an fp16 overflow depends on each rank's
    micro-batch, so other world sizes overflow elsewhere, under DeepSpeed too."""
    result = run_distributed(train_in_tnlg_from_start, 2, name, 2, timeout=300)[0]
    record = deepspeed_run(name)
    save_at = CASE[name].save_at
    assert result["loss_scales"][save_at:] == record["resumed_loss_scales"]
    assert result["applied"][save_at:] == record["resumed_applied"]
    assert result["applied"][:2] == [False, False]  # the overflows the path turns on
    theirs = record["losses_before_save"] + record["resumed_losses"]
    for ours, expected in zip(result["losses"], theirs, strict=True):  # fp16 updates round apart
        assert abs(ours - expected) <= 1e-3 * abs(expected), (result["losses"], theirs)
