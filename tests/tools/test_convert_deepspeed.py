"""`from_deepspeed` and `convert_checkpoint.py --from deepspeed` on checkpoints DeepSpeed 0.19 itself wrote
(tests/assets/deepspeed): the converted model's loss on the batch after the save is the one DeepSpeed's
own resumed run computed from the same weights, before its first update."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from scripts import convert_checkpoint
from tests.support.deepspeed_fixtures import CASES, CHECKPOINT, SAVE_AT, global_batch
from tnlg import TNLGForCausalLM
from tnlg.tools.convert import from_deepspeed

CASE = {case.name: case for case in CASES}


def deepspeed_first_resumed_loss(name: str) -> float:
    return json.loads((CASE[name].directory / "resumed_losses.json").read_text())["resumed_losses"][0]


def loss_of(model: torch.nn.Module, step: int = SAVE_AT) -> float:
    ids = global_batch(step)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


@pytest.mark.parametrize("name", sorted(CASE))
def test_converted_model_scores_deepspeeds_resumed_loss(name):
    case = CASE[name]
    model = from_deepspeed(case.checkpoint)
    assert isinstance(model, TNLGForCausalLM)
    # DeepSpeed's resumed run computed in its training dtype, from the fp32 masters rounded to it
    model = model.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case.precision])
    # in bf16 at stage 3 DeepSpeed's own linear function rounds apart from torch's (2.3e-5)
    tolerance = 3e-5 if case.precision == "bf16" and case.stage == 3 else 1e-5
    assert loss_of(model, case.save_at) == pytest.approx(deepspeed_first_resumed_loss(name), rel=tolerance)


def test_a_gpt2_run_converts_to_the_same_logits_as_gpt2_itself():
    """The GPT-2 case's masters loaded into Transformers' GPT2LMHeadModel by their own names, against
    the converted TNLG model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tnlg.sharding.deepspeed.zero_checkpoint import read_deepspeed_checkpoint

    checkpoint = CASE["stage3_world2_gpt2"].directory / CHECKPOINT
    gpt2 = GPT2LMHeadModel(GPT2Config.from_pretrained(checkpoint)).eval()
    loaded = gpt2.load_state_dict(read_deepspeed_checkpoint(checkpoint).masters, strict=False)
    assert loaded.unexpected_keys == [] and set(loaded.missing_keys) <= {"lm_head.weight"}
    ids = global_batch(SAVE_AT)
    with torch.no_grad():
        expected = gpt2(input_ids=ids).logits
        got = from_deepspeed(checkpoint)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_script_writes_a_model_from_pretrained_loads(tmp_path):
    name = "stage2_world2"
    output = tmp_path / "model"
    convert_checkpoint.main(
        ["--from", "deepspeed", "--input", str(CASE[name].directory / CHECKPOINT), "--output", str(output)]
    )
    model = TNLGForCausalLM.from_pretrained(output)
    assert loss_of(model) == pytest.approx(deepspeed_first_resumed_loss(name), rel=1e-5)


def test_without_a_config_the_error_names_the_option(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(CASE["stage1_world2"].directory / CHECKPOINT, checkpoint)
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="pass the model's config with --config"):
        from_deepspeed(checkpoint)
    model = from_deepspeed(
        checkpoint / f"global_step{SAVE_AT}", config=CASE["stage1_world2"].directory / CHECKPOINT
    )
    assert loss_of(model) == pytest.approx(deepspeed_first_resumed_loss("stage1_world2"), rel=1e-5)


def test_config_with_another_source_is_refused(capsys):
    with pytest.raises(SystemExit):
        convert_checkpoint.parse_args(["--from", "gpt2", "--config", "x", "--input", "a", "--output", "b"])
    assert "--config is for --from deepspeed" in capsys.readouterr().err


@pytest.mark.parametrize("tagged", [False, True], ids=["save directory", "tag directory"])
def test_a_deepspeed_checkpoint_given_where_a_tnlg_one_is_read_is_named_with_the_way_on(tagged):
    from tnlg.run.checkpoint import RunCheckpointer, find_engine_checkpoint
    from tnlg.sharding.checkpoint import CheckpointError

    checkpoint = CASE["stage1_world2"].directory / CHECKPOINT
    given = checkpoint / f"global_step{SAVE_AT}" if tagged else checkpoint
    with pytest.raises(
        FileNotFoundError, match=r"it is a DeepSpeed checkpoint: convert it with --from deepspeed"
    ):
        find_engine_checkpoint(given)
    with pytest.raises(
        CheckpointError,
        match=r"is not a tnlg run checkpoint; it is a DeepSpeed checkpoint: .*--model.init_from",
    ):
        RunCheckpointer("unused", 1, accelerator=None).resolve(str(given))


def test_a_directory_that_is_no_checkpoint_is_not_called_deepspeeds(tmp_path):
    from tnlg.run.checkpoint import find_engine_checkpoint

    with pytest.raises(FileNotFoundError, match=r"holds no engine checkpoint") as raised:
        find_engine_checkpoint(tmp_path)
    assert "DeepSpeed" not in str(raised.value)


@pytest.mark.parametrize("pointer", ["", "garbage"], ids=["empty", "garbage"])
def test_a_runs_damaged_latest_is_not_called_deepspeeds(tmp_path, pointer):
    # a run's checkpoints root whose `latest` is damaged was sent to --from deepspeed
    from tnlg.run.checkpoint import find_engine_checkpoint
    from tnlg.sharding.deepspeed.zero_checkpoint import is_deepspeed_checkpoint

    (tmp_path / "step-00000002" / "engine").mkdir(parents=True)
    (tmp_path / "step-00000002" / "engine" / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_text(pointer)
    assert not is_deepspeed_checkpoint(tmp_path)
    with pytest.raises(ValueError) as raised:
        find_engine_checkpoint(tmp_path)
    assert "latest is not valid JSON" in str(raised.value) and "DeepSpeed" not in str(raised.value)


def test_a_runs_checkpoints_given_as_deepspeeds_are_named_as_tnlgs(tmp_path):
    from tnlg.sharding.checkpoint import CheckpointError
    from tnlg.sharding.deepspeed.zero_checkpoint import read_deepspeed_checkpoint

    (tmp_path / "latest").write_text('{"checkpoint": "step-00000002"}')
    with pytest.raises(CheckpointError, match=r"is a tnlg run's checkpoints .*: convert it with --from zero"):
        read_deepspeed_checkpoint(tmp_path)


@pytest.mark.parametrize(("content", "message"), [("[]", "holds a JSON list"), ("{bad", "is not valid JSON")])
def test_a_config_that_is_no_model_config_is_named(tmp_path, content, message):
    # a JSON list failed with an AttributeError traceback, bad JSON with a message naming no file

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=rf"config.json {message}"):
        from_deepspeed(CASE["stage1_world2"].directory / CHECKPOINT, config=tmp_path / "config.json")


def test_a_checkpoint_saved_without_zero_is_named_as_such(tmp_path):
    # DeepSpeed without ZeRO (stage 0, fp32 or fp16) keeps its optimizer inside mp_rank_00_model_states.pt,
    # param_shapes None, and writes no optim_states files: it was reported as missing those files.
    from tnlg.sharding.checkpoint import CheckpointError
    from tnlg.sharding.deepspeed.zero_checkpoint import read_deepspeed_checkpoint

    source = CASE["stage1_world2"].directory / CHECKPOINT
    tag = tmp_path / "checkpoint" / f"global_step{SAVE_AT}"
    tag.mkdir(parents=True)
    shutil.copy(source / "latest", tag.parent / "latest")
    shutil.copy(source / "config.json", tag.parent / "config.json")
    model_states = {
        "module": read_deepspeed_checkpoint(source).masters,
        "optimizer": {"state": {}, "param_groups": []},
        "param_shapes": None,
        "dp_world_size": 2,
        "global_steps": SAVE_AT,
    }
    torch.save(model_states, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(
        CheckpointError, match=r"is not a ZeRO checkpoint: DeepSpeed saved it without ZeRO \(stage 0"
    ) as raised:
        from_deepspeed(tag.parent)
    assert "is not supported" in str(raised.value) and "no optimizer file" not in str(raised.value)
