"""What a run checks before it changes anything: a resume under settings the checkpoint fixed (model,
data, optimizer) is refused naming each changed key, while layout, ZeRO, batch split, max_steps and
logging may change; train.overwrite removes the old run only once the new config is fully checked;
activation offload under pipeline stages is refused rather than ignored; a non-finite loss names the
data position without its buffers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import REPO
from tnlg.run.checkpoint import changed_settings, check_resume_candidates
from tnlg.run.config import load_run_config
from tnlg.sharding.checkpoint import CheckpointError
from tnlg.tools.spawn import run_distributed

DEBUG = REPO / "configs" / "pretrain" / "debug.yaml"


def _config(*overrides: str) -> dict:
    return load_run_config(DEBUG, list(overrides)).to_dict()


def _checkpoint(directory: Path, *overrides: str) -> Path:
    """A run checkpoint directory holding only the run config it was trained with."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(_config(*overrides)))
    return directory


@pytest.mark.parametrize(
    ("overrides", "changed"),
    [
        (["--data.seq_len", "64"], "data.seq_len: 128 -> 64"),
        (["--optimizer.lr", "0.001"], "optimizer.lr: 0.003 -> 0.001"),
        (["--optimizer.betas", "[0.9, 0.99]"], "optimizer.betas: [0.9, 0.95] -> [0.9, 0.99]"),
        (["--optimizer.warmup_steps", "5"], "optimizer.warmup_steps: 20 -> 5"),
        (["--model.overrides.num_hidden_layers", "3"], "model.overrides.num_hidden_layers: 4 -> 3"),
        (["--zero.gradient_clipping", "0.5"], "zero.gradient_clipping: 1.0 -> 0.5"),
    ],
)
def test_a_resume_that_changes_a_fixed_setting_is_refused_naming_it(tmp_path, overrides, changed):
    checkpoint = _checkpoint(tmp_path / "step-00000002")
    with pytest.raises(ValueError, match="the checkpoint was trained with other settings") as error:
        check_resume_candidates([checkpoint], _config(*overrides))
    assert changed in str(error.value)


def test_resume_fallback_checks_the_older_checkpoints_before_building(tmp_path):
    # `latest` names a checkpoint that is gone: the run skipped the check, the load fell back to step 2,
    # and the changed settings applied to its data position (a changed seq_len failed mid-run naming
    # array shapes, a changed shuffle buffer ran silently)
    from tnlg.run.loop import TrainingJob, build_run

    checkpoints = tmp_path / "run" / "checkpoints"
    _checkpoint(checkpoints / "step-00000002", "--train.output_dir", str(tmp_path / "run"))
    (checkpoints / "latest").write_text('{"checkpoint": "step-00000004"}')
    config = load_run_config(
        DEBUG,
        [
            "--train.output_dir",
            str(tmp_path / "run"),
            "--train.resume_fallback",
            "true",
            "--data.seq_len",
            "64",
        ],
    )
    job = TrainingJob(name="pretrain", seq_len=64, tokenizer="byte-level", batches=iter(()))
    with pytest.raises(
        ValueError, match=r"step-00000002: the checkpoint was trained with other settings"
    ) as error:
        build_run(config, job, resume="latest")
    assert "data.seq_len: 128 -> 64" in str(error.value)


def test_with_a_fallback_a_damaged_run_config_is_left_to_the_load(tmp_path, caplog):
    # the load skips a checkpoint whose config.json is damaged (it reads the file), so the check does too;
    # without a fallback the damage is refused by name, and so is a fallback with nothing older
    newest = _checkpoint(tmp_path / "step-00000004")
    (newest / "config.json").write_text('{"model": ')
    older = _checkpoint(tmp_path / "step-00000002", "--data.seq_len", "64")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        check_resume_candidates([newest], _config())
    with caplog.at_level("WARNING"), pytest.raises(ValueError, match=r"data\.seq_len: 64 -> 128"):
        check_resume_candidates([newest, older], _config())
    assert "the fallback skips this checkpoint" in caplog.text
    check_resume_candidates([newest, older], _config("--data.seq_len", "64"))


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--train.max_steps", "500", "--train.save_every", "1", "--train.keep_last", "1"],
        ["--parallel.pipeline", "2", "--parallel.tensor", "2", "--zero.stage", "3"],
        ["--zero.offload_optimizer", "cpu", "--train.mixed_precision", "bf16"],
        ["--train.micro_batch_size", "4", "--train.gradient_accumulation_steps", "2"],
        ["--train.on_nonfinite_loss", "skip", "--train.resume_fallback", "true", "--train.eval_every", "0"],
        ["--logging.trackers", "[]", "--train.output_dir", "elsewhere"],
    ],
)
def test_a_resume_may_change_layout_zero_batch_split_max_steps_and_logging(overrides):
    assert changed_settings(_config(), _config(*overrides)) == []


def test_a_setting_added_since_the_checkpoint_was_written_is_no_change():
    # a checkpoint from a release that had no `optimizer.min_lr_ratio` (the older run did what its default
    # does) but had a `train.retired_setting` this one lacks; an empty mapping since given a key is a change
    saved = _config()
    del saved["optimizer"]["min_lr_ratio"]
    saved["train"]["retired_setting"] = 1
    assert changed_settings(saved, _config()) == []
    saved["model"]["overrides"] = {}
    assert "model.overrides.num_hidden_layers: None -> 4" in changed_settings(saved, _config())


def _pretrain(rank, world_size, cache, output, overrides, resume=None):
    """The debug run; its losses, or the input error it raised (type and message)."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.cli import INPUT_ERRORS
    from tnlg.run.pretrain import pretrain

    arguments = [
        "--train.max_steps", "1", "--train.eval_every", "0", "--train.output_dir", output,
        "--logging.trackers", "[]", "--data.shuffle_buffer", "8", *overrides,
    ]  # fmt: skip
    try:
        return {"losses": pretrain(load_run_config(DEBUG, arguments), resume=resume)["losses"]}
    except INPUT_ERRORS as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _run(cache, output, *overrides, resume=None):
    (result,) = run_distributed(_pretrain, 1, str(cache), str(output), list(overrides), resume, timeout=300)
    return result


def test_a_refused_resume_stops_before_anything_is_built(cache, tmp_path):
    checkpoint = _checkpoint(tmp_path / "checkpoints" / "step-00000002")
    result = _run(cache, tmp_path, "--data.seq_len", "64", resume=str(checkpoint))
    assert result["error"].startswith("ValueError: --resume"), result
    assert "data.seq_len: 128 -> 64" in result["error"]


def test_overwrite_with_a_config_that_is_refused_keeps_the_old_run(cache, tmp_path):
    old_checkpoint = tmp_path / "checkpoints" / "step-00000002"
    old_checkpoint.mkdir(parents=True)
    (tmp_path / "loss_curve.json").write_text('{"steps": [1, 2]}')
    result = _run(cache, tmp_path, "--train.overwrite", "true", "--data.seq_len", "256")
    assert "the sequence length 256 exceeds" in result["error"], result
    assert old_checkpoint.is_dir() and (tmp_path / "loss_curve.json").is_file()


def test_activation_offload_under_pipeline_stages_is_refused_when_the_run_is_built(cache, tmp_path):
    result = _run(
        cache, tmp_path, "--parallel.pipeline", "2", "--model.activation_checkpointing.enabled", "true",
        "--model.activation_checkpointing.cpu_offload", "true",
    )  # fmt: skip
    assert result["error"].startswith(
        "ValueError: model.activation_checkpointing.cpu_offload is not supported with parallel.pipeline 2"
    ), result


def test_a_nonfinite_loss_names_the_data_position_without_its_buffers():
    from tnlg.run.loop import NonFiniteLossError, _handle_nonfinite_loss

    tokens = list(range(4096))
    position = {
        "rank": 0, "world_size": 1, "batches": 7,
        "shuffle": {"buffer": [tokens] * 8, "source": {"counts": [5, 2], "sources": {"a": {"buffer": tokens}}}},
    }  # fmt: skip
    run = SimpleNamespace(
        config=SimpleNamespace(train=SimpleNamespace(on_nonfinite_loss="stop")),
        accelerator=SimpleNamespace(process_index=0),
        stream=SimpleNamespace(state_dict=lambda: position),
    )
    with pytest.raises(NonFiniteLossError) as error:
        _handle_nonfinite_loss(run, 3, float("nan"))
    message = str(error.value)
    assert message.startswith("step 3: the mean loss over the ranks is nan")
    assert '"batches": 7' in message and '"counts": [5, 2]' in message
    assert "4095" not in message and len(message) < 500


def _train_then_fail_to_evaluate(rank, world_size, cache, output):
    """The debug run with a final evaluation that raises; whether the model was written before it."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.loop import TrainingJob, train
    from tnlg.run.pretrain import training_stream

    config = load_run_config(
        DEBUG,
        [
            "--train.max_steps", "1", "--train.eval_every", "0", "--train.output_dir", output,
            "--logging.trackers", "[]", "--data.shuffle_buffer", "8",
        ],
    )  # fmt: skip

    def failing_evaluation(model, tokenizer, accelerator):
        raise RuntimeError("the metric's package is missing")

    job = TrainingJob(
        name="pretraining",
        seq_len=config.data.seq_len,
        batches=lambda tokenizer, rank, world: training_stream(config, tokenizer, rank, world),
        final_evaluation=failing_evaluation,
    )
    try:
        train(config, job)
    except RuntimeError as error:
        return {"error": str(error), "model": sorted(p.name for p in (Path(output) / "model").iterdir())}
    return {"error": None}


def test_the_model_is_written_before_the_final_evaluation(cache, tmp_path):
    (result,) = run_distributed(_train_then_fail_to_evaluate, 1, str(cache), str(tmp_path), timeout=300)
    assert result["error"] == "the metric's package is missing"
    assert "config.json" in result["model"] and "model.safetensors" in result["model"], result
