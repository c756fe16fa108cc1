"""DeepSpeed ZeRO checkpoints, as DeepSpeed 0.19 itself wrote them (tests/assets/deepspeed, made by
tests/support/deepspeed_fixtures.py on gloo CPU processes), resumed by tnlg's engine at other world sizes
and ZeRO stages: its next losses must be DeepSpeed's own resumed run's."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from tests.support.deepspeed_fixtures import CASES, CHECKPOINT, RESUMED_STEPS, SAVE_AT
from tests.support.deepspeed_resume_cases import loss_scale_after_resume, resume_in_tnlg
from tnlg.sharding.checkpoint_files import CheckpointError
from tnlg.sharding.deepspeed.zero_checkpoint import read_deepspeed_checkpoint
from tnlg.tools.spawn import RankFailed, run_distributed

CASE = {case.name: case for case in CASES}
TAG = f"global_step{SAVE_AT}"


def deepspeed_record(name: str) -> dict:
    return json.loads((CASE[name].directory / "resumed_losses.json").read_text())


@pytest.mark.parametrize(
    ("name", "world", "stage", "where"),
    [
        ("stage2_world2", 1, 2, "trainer"),  # the must-shows: 2 ranks at stage 2 -> 1 and 4 ranks
        ("stage2_world2", 4, 2, "trainer"),
        ("stage3_world4", 2, 1, "trainer"),  # 4 ranks at stage 3 -> stage 1
        ("stage1_world2", 1, 3, "tag"),  # the tag directory itself, stage 1 -> 3
        ("stage2_world2_accumulation2", 1, 3, "trainer"),  # 2 micro-batches a step, WarmupLR
    ],
)
def test_tnlg_resumes_a_deepspeed_run_with_deepspeeds_own_next_losses(name, world, stage, where):
    checkpoint = CASE[name].directory / CHECKPOINT
    path = checkpoint if where == "trainer" else checkpoint / TAG
    result = run_distributed(resume_in_tnlg, world, name, str(path), stage, timeout=300)[0]
    record = deepspeed_record(name)
    assert record["world"] != world or record["stage"] != stage  # another layout than DeepSpeed's
    assert len(result["losses"]) == RESUMED_STEPS
    for ours, theirs in zip(result["losses"], record["resumed_losses"], strict=True):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (result["losses"], record["resumed_losses"])
    assert result["global_steps"] == SAVE_AT + RESUMED_STEPS
    assert result["summary"] == {
        "stage": record["stage"],
        "world_size": record["world"],
        "global_steps": SAVE_AT,
        "adam_step": SAVE_AT,
    }


@pytest.mark.parametrize(
    ("name", "world", "stage"),
    [
        ("stage1_world2_bf16_fp32_gradients", 1, 2),  # DeepSpeed's BF16_Optimizer: no zero_stage saved
        ("stage2_world2_bf16", 2, 3),
        ("stage3_world2_bf16", 1, 2),
    ],
)
def test_tnlg_resumes_a_deepspeed_bf16_run_with_deepspeeds_own_next_losses(name, world, stage):
    """bf16 runs (DeepSpeed's bf16_zero_pp_rank_* files) at ZeRO 1-3, ZeRO 1 under the BF16_Optimizer
    that DeepSpeed takes for fp32 gradient accumulation (which tnlg's engine does not do: the resumed
    run accumulates in bf16). The first resumed loss comes from the restored weights: DeepSpeed's own to
    2.3e-5 (stage 3, where DeepSpeed runs its own linear function) or exactly; the later ones from bf16
    updates, which round apart (up to 6.6e-5)."""
    result = run_distributed(resume_in_tnlg, world, name, str(CASE[name].checkpoint), stage, timeout=300)[0]
    record = deepspeed_record(name)
    first, *later = zip(result["losses"], record["resumed_losses"], strict=True)
    first_tolerance = 3e-5 if CASE[name].stage == 3 else 1e-6
    assert abs(first[0] - first[1]) <= first_tolerance * abs(first[1]), (
        result["losses"],
        record["resumed_losses"],
    )
    for ours, theirs in later:
        assert abs(ours - theirs) <= 2e-4 * abs(theirs), (result["losses"], record["resumed_losses"])
    assert result["summary"] == {
        "stage": CASE[name].stage,
        "world_size": 2,
        "global_steps": 3,
        "adam_step": 3,
    }


@pytest.mark.parametrize("name", ["stage2_world2", "stage2_world2_bf16"])
def test_an_fp32_or_bf16_runs_static_scale_of_one_is_no_fp16_scale(name):
    # DeepSpeed saves a static LossScaler at scale 1 with bf16 and fp32 runs too: read as an fp16 run's
    # static scale, the resume named "the checkpoint's fp16 loss scale was static" to an fp16 engine
    state = read_deepspeed_checkpoint(CASE[name].directory / CHECKPOINT)
    assert (state.loss_scale, state.loss_scale_dynamic) == (1.0, None)
    fp16 = read_deepspeed_checkpoint(CASE["stage2_world2_fp16_step4"].checkpoint)
    assert (fp16.loss_scale, fp16.loss_scale_dynamic) == (2.0**17, True)


def test_an_fp16_engine_keeps_its_loss_scale_over_a_run_that_saved_none():
    # the fixtures are fp32 DeepSpeed runs (a static scale of 1 saved): their scale must not replace the
    # fp16 engine's initial 2**12 (it did, and a scale of 1 takes ~12k clean steps to grow back)
    name = "stage2_world2"
    checkpoint = str(CASE[name].directory / CHECKPOINT)
    assert run_distributed(loss_scale_after_resume, 1, name, checkpoint)[0] == 2.0**12


@pytest.mark.parametrize(
    ("name", "world"),
    [
        ("stage2_world2_fp16_step1", 2),  # saved after an overflow its hysteresis absorbed: the next halves
        ("stage2_world2_fp16_step4", 1),  # two clean steps into a window of 3: the second resumed one doubles
    ],
)
def test_an_fp16_run_resumes_on_deepspeeds_loss_scale_path(name, world):
    """DeepSpeed's dynamic loss scaler is resumed where it stood, not only at its scale: the resumed
    steps run at the scales DeepSpeed's own resumed run used and skip the same steps. With the fresh
    engine's hysteresis and clean count (the scale alone, as before), step 1's case absorbs the overflow
    that halves DeepSpeed's scale and step 4's doubles one step late."""
    result = run_distributed(resume_in_tnlg, world, name, str(CASE[name].checkpoint), 2, timeout=300)[0]
    record = deepspeed_record(name)
    assert len(set(record["resumed_loss_scales"])) == 2  # the path turns within the resumed steps
    assert result["loss_scales"] == record["resumed_loss_scales"]
    assert result["applied"] == record["resumed_applied"]
    # the first resumed step computes from the restored weights alone; later ones from fp16 updates,
    # which round apart (3e-4 at the third step)
    assert result["losses"][0] == record["resumed_losses"][0]
    for ours, theirs in zip(result["losses"], record["resumed_losses"], strict=True):
        assert abs(ours - theirs) <= 1e-3 * abs(theirs), (result["losses"], record["resumed_losses"])
    assert result["summary"]["global_steps"] == CASE[name].save_at


@pytest.mark.parametrize("name", ["stage2_world2", "stage2_world2_accumulation2"])
def test_the_warmup_schedule_resumes_where_deepspeed_left_it(name):
    """DeepSpeed's WarmupLR (a log ramp over 8 steps) saved at step 3: the resumed engine uses the lrs
    DeepSpeed's own resumed run used, step by step (optimizer steps, not micro-batches)."""
    result = run_distributed(resume_in_tnlg, 1, name, str(CASE[name].directory / CHECKPOINT), 2)[0]
    expected = deepspeed_record(name)["resumed_lrs"]
    assert len(set(expected)) == RESUMED_STEPS  # still ramping
    assert result["lrs"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["stage2_world2", "stage1_world2_bf16_fp32_gradients"])
def test_adams_moments_and_step_are_read(name):
    """Adam's second moments are read non-zero for every parameter and its step is the saved one (with
    them zeroed, the resumed losses above differ from DeepSpeed's: 4.5963 against 4.5930)."""
    state = read_deepspeed_checkpoint(CASE[name].directory / CHECKPOINT)
    assert all(float(t.abs().max()) > 0 for t in state.moments["exp_avg_sq"].values())
    assert state.adam_steps == [SAVE_AT]


@pytest.mark.parametrize(
    "name", ["stage1_world2", "stage2_world2", "stage1_world2_bf16_fp32_gradients", "stage2_world2_bf16"]
)
def test_masters_are_the_weights_deepspeed_saved(name):
    """At stages 1-2 DeepSpeed also saves the module's weights whole (in the training dtype): the masters
    rebuilt from its flat partitions are exactly those (rounded to bf16 for the bf16 runs), and the tied
    head is recorded as an alias."""
    state = read_deepspeed_checkpoint(CASE[name].directory / CHECKPOINT)
    module = torch.load(state.directory / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert set(state.masters) == set(module) - {"lm_head.weight"}
    for parameter, tensor in state.masters.items():
        assert torch.equal(tensor.to(module[parameter].dtype), module[parameter]), parameter
    assert {tensor.dtype for tensor in module.values()} == {
        torch.bfloat16 if CASE[name].precision == "bf16" else torch.float32
    }
    assert state.shared == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "deepspeed" not in sys.modules  # read without importing DeepSpeed


@pytest.fixture
def copied(tmp_path):
    target = tmp_path / "checkpoint"
    shutil.copytree(CASE["stage2_world2"].directory / CHECKPOINT, target)
    return target


def test_a_missing_rank_file_is_named(copied):
    (copied / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        CheckpointError, match=r"saved by 2 data-parallel ranks but has no optimizer file for rank\(s\) \[1\]"
    ):
        read_deepspeed_checkpoint(copied)


def test_latest_naming_a_missing_tag_is_named(copied):
    (copied / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="names tag 'global_step9'"):
        read_deepspeed_checkpoint(copied)


def test_a_pickled_class_outside_deepspeed_is_refused_not_run(copied):
    path = copied / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"hook": RankFailed("x")}}, path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        read_deepspeed_checkpoint(copied)


def test_tensor_parallel_deepspeed_checkpoints_are_refused_by_name(copied):
    shutil.copy(copied / TAG / "mp_rank_00_model_states.pt", copied / TAG / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="several model-parallel ranks"):
        read_deepspeed_checkpoint(copied)


def test_a_tnlg_run_roots_latest_pointer_is_not_taken_for_deepspeeds(tmp_path):
    """A tnlg run's checkpoint root also has a `latest` file (JSON naming its checkpoint): not DeepSpeed's."""
    from tnlg.sharding.deepspeed.restore import is_deepspeed_checkpoint

    (tmp_path / "latest").write_text('{"checkpoint": "step-00000004"}')
    assert not is_deepspeed_checkpoint(tmp_path)
    assert is_deepspeed_checkpoint(CASE["stage1_world2"].directory / CHECKPOINT)
