"""A run refuses what it would otherwise ignore, overwrite or misread: its output directory, --resume
without a checkpoint, damaged run-checkpoint files, settings out of range or misspelled, a bad YAML file,
`model.init_from` that is no checkpoint; and the loss curve of a resumed run covers the whole run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO
from tnlg.run.config import RUN_DEFAULT_STAGE, load_run_config
from tnlg.run.finetune_config import load_finetune_config
from tnlg.tools.spawn import run_distributed

DEBUG = REPO / "configs" / "pretrain" / "debug.yaml"


def _pretrain(rank, world_size, cache, output, overrides, resume=None):
    """The debug run, small; returns its losses, or the input error it raised (type and message)."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.cli import INPUT_ERRORS
    from tnlg.run.pretrain import pretrain

    arguments = [
        "--train.max_steps", "4", "--train.eval_every", "0", "--train.save_every", "2",
        "--train.output_dir", output, "--logging.trackers", "[]", "--data.shuffle_buffer", "8", *overrides,
    ]  # fmt: skip
    try:
        return {"losses": pretrain(load_run_config(DEBUG, arguments), resume=resume)["losses"]}
    except INPUT_ERRORS as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _run(cache, output, *overrides, resume=None, world=1):
    return run_distributed(_pretrain, world, str(cache), str(output), list(overrides), resume, timeout=600)


@pytest.fixture(scope="module")
def finished_run(cache, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4."""
    output = tmp_path_factory.mktemp("finished")
    (result,) = _run(cache, output)
    assert "losses" in result, result
    return output, result["losses"]


@pytest.mark.slow
def test_a_new_run_into_a_used_output_directory_is_refused_and_loses_nothing(finished_run, cache):
    output, _ = finished_run
    before = {p: p.stat().st_mtime_ns for p in output.rglob("*")}
    (result,) = _run(cache, output)
    assert result["error"].startswith(f"FileExistsError: train.output_dir {output} already holds a run")
    assert "--resume latest" in result["error"] and "--train.overwrite true" in result["error"]
    assert {p: p.stat().st_mtime_ns for p in output.rglob("*")} == before


@pytest.mark.slow
def test_overwrite_replaces_the_previous_run_entirely(finished_run, cache, tmp_path):
    output, losses = finished_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(output), str(copy)], check=True)
    (copy / "checkpoints" / "step-00000099").mkdir()  # a leftover the new run must not inherit
    (result,) = _run(
        cache, copy, "--train.overwrite", "true", "--train.max_steps", "2", "--train.save_every", "0"
    )
    assert result["losses"] == pytest.approx(losses[:2], rel=1e-6)
    assert not (copy / "checkpoints").exists()  # the old run's checkpoints are gone, not mixed in
    assert json.loads((copy / "loss_curve.json").read_text())["steps"] == [1, 2]


@pytest.mark.slow
def test_resume_latest_without_a_checkpoint_is_refused_naming_the_directory(cache, tmp_path):
    (result,) = _run(cache, tmp_path, resume="latest")
    assert result["error"].startswith("CheckpointError: --resume latest:")
    assert str(tmp_path / "checkpoints") in result["error"]
    assert not (tmp_path / "model").exists()


@pytest.mark.slow
def test_a_resumed_run_keeps_the_whole_loss_curve(finished_run, cache, tmp_path):
    output, losses = finished_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(output), str(copy)], check=True)
    (copy / "checkpoints" / "latest").write_text(json.dumps({"checkpoint": "step-00000002"}))
    (result,) = _run(cache, copy, resume="latest")
    assert result["losses"] == pytest.approx(losses, rel=1e-6)  # steps 1-2 from the checkpoint, 3-4 retrained
    curve = json.loads((copy / "loss_curve.json").read_text())
    assert curve["steps"] == [1, 2, 3, 4]
    # Resumed at max_steps: nothing left to train, and the curve is still the whole run's.
    (again,) = _run(cache, copy, resume="latest")
    assert again["losses"] == pytest.approx(losses, rel=1e-6)
    assert json.loads((copy / "loss_curve.json").read_text())["steps"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_fallback_takes_the_newest_checkpoint_before_a_latest_that_is_gone(
    finished_run, cache, tmp_path
):
    output, losses = finished_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(output), str(copy)], check=True)
    (copy / "checkpoints" / "latest").write_text(json.dumps({"checkpoint": "step-00000006"}))
    (refused,) = _run(cache, copy, resume="latest")
    assert "latest names step-00000006, which is not there" in refused["error"]
    shutil.rmtree(copy / "checkpoints" / "step-00000004")  # the fallback must reach step 2, and retrain 3-4
    (result,) = _run(cache, copy, "--train.resume_fallback", "true", resume="latest")
    assert result["losses"] == pytest.approx(losses, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda c: (c / "latest").write_text("step-00000004"), "latest is not valid JSON"),
        (lambda c: (c / "latest").write_text('{"checkpoint": "../../etc"}'), "does not name a checkpoint"),
        (lambda c: (c / "step-00000004" / "rank-00000.json").write_text('{"step": 4, "da'), "rank-00000.json is not valid JSON"),
        (lambda c: (c / "step-00000004" / "rank-00000.json").unlink(), "rank-00000.json is missing"),
        (lambda c: (c / "step-00000004" / "scheduler.json").write_bytes(b"\xff\x00"), "scheduler.json is not valid JSON"),
    ],
    ids=["latest-not-json", "latest-escapes", "rank-file-truncated", "rank-file-missing", "scheduler-binary"],
)  # fmt: skip
def test_damaged_run_checkpoint_files_are_named(finished_run, cache, tmp_path, damage, message):
    output, _ = finished_run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(output), str(copy)], check=True)
    damage(copy / "checkpoints")
    (result,) = _run(cache, copy, resume="latest")
    assert result["error"].startswith("CheckpointError") and message in result["error"], result


@pytest.mark.slow
def test_a_missing_rank_file_of_a_two_process_checkpoint_is_named(cache, tmp_path):
    """Rank 1's file gone: before, the checkpoint read as a 1-process one and every rank resumed from rank
    0's data position; now both ranks stop naming the missing file."""
    results = _run(cache, tmp_path, "--train.max_steps", "2", world=2)
    assert all("losses" in r for r in results), results
    (tmp_path / "checkpoints" / "step-00000002" / "rank-00001.json").unlink()
    results = _run(cache, tmp_path, resume="latest", world=2)
    for result in results:
        assert "rank-00001.json is missing" in result["error"], result
        assert "saved by 2 processes" in result["error"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.max_steps", "-5"], "train.max_steps must be >= 1, got -5"),
        (["--train.max_steps", "0"], "train.max_steps must be >= 1, got 0"),
        (["--train.eval_batches", "0"], "train.eval_batches must be >= 1, got 0"),
        (["--train.gradient_accumulation_steps", "0"], "train.gradient_accumulation_steps must be >= 1"),
        (["--train.micro_batch_size", "0"], "train.micro_batch_size must be >= 1"),
        (["--optimizer.betas", "[0.9]"], "optimizer.betas must be two numbers in [0, 1)"),
        (["--optimizer.betas", "[0.9, 1.5]"], "optimizer.betas must be two numbers in [0, 1)"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be >= 0"),
        (["--optimizer.min_lr_ratio", "2"], "optimizer.min_lr_ratio must be in [0, 1]"),
        (["--train.mixed_precision", "bf17"], "train.mixed_precision must be one of"),
        (["--data.seq_len", "0"], "data.seq_len must be >= 1"),
        (["--zero.stgae", "3"], "unknown config key zero.stgae (did you mean zero.stage?)"),
        (["--zero.stage", "5"], "zero: ZeroConfig.stage must be one of [0, 1, 2, 3], got 5"),
        (["--zero.mixed_precision", "bf16"], "zero.mixed_precision (it is train.mixed_precision)"),
        (["--zero.offload_param", "cpu"], "offload_param needs stage 3"),
        (["--train.max_step", "3"], "unknown config key train.max_step (did you mean train.max_steps?)"),
    ],
)
def test_settings_out_of_range_or_misspelled_are_refused_when_read(overrides, message):
    with pytest.raises(ValueError) as raised:
        load_run_config(DEBUG, overrides)
    assert message in str(raised.value)
    with pytest.raises(ValueError):  # fine-tuning shares the sections (and has no data.seq_len)
        load_finetune_config(None, overrides)


def test_the_zero_section_is_typed_and_applied():
    config = load_run_config(DEBUG, ["--zero.stage", "3", "--zero.reduce_bucket_size", "1000"])
    zero = config.zero.to_zero_config("bf16")
    assert (zero.stage, zero.reduce_bucket_size, zero.mixed_precision, zero.gradient_clipping) == (
        3,
        1000,
        "bf16",
        1.0,
    )
    assert load_run_config(None).zero.to_zero_config("no").stage == 2  # the run default, not ZeroConfig's 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"model: {preset: debug\ntrain: [", "is not valid YAML"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not a YAML file: not UTF-8 text"),
        (b"- just\n- a list\n", "a run config must be a mapping of sections, got list"),
    ],
)
def test_a_bad_yaml_file_is_one_error_naming_it(tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError) as raised:
        load_run_config(path)
    assert str(path) in str(raised.value) and message in str(raised.value)
    with pytest.raises(FileNotFoundError, match=r"config file .*missing\.yaml does not exist"):
        load_run_config(tmp_path / "missing.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "no-config"])
def test_init_from_that_is_no_checkpoint_is_named_without_reaching_the_hub(cache, tmp_path, kind):
    target = tmp_path / "model"
    if kind == "no-config":
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"")
    (result,) = _run(cache, tmp_path / "out", "--model.init_from", str(target))
    expected = "does not exist" if kind == "missing" else "holds no config.json"
    assert result["error"].startswith("FileNotFoundError: model.init_from") and expected in result["error"]


@pytest.mark.slow
def test_the_script_prints_an_input_error_once_as_one_line(cache, tmp_path):
    """Under a 2-process launch both ranks refuse the used directory; the user sees one line from rank 0
    (the other rank, stopped by the launcher within its grace period, prints nothing), exit 2."""
    (tmp_path / "model").mkdir()
    environment = {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    environment.pop("TNLG_TRACEBACK", None)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(REPO / "scripts" / "pretrain.py"), "--train.output_dir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: train.output_dir {tmp_path} already holds a run (model): continue it with "
                      "--resume latest, pass --train.overwrite true to replace it, or choose another "
                      "--train.output_dir"]  # fmt: skip
    # The launcher reports the failed process with its own traceback; none comes from tnlg's code.
    assert "FileExistsError" not in result.stderr and "tnlg/run/loop.py" not in result.stderr


@pytest.mark.parametrize(
    ("json_config", "overrides", "message"),
    [
        ({"zero_optimization": {"stage": 3}}, ["--zero.stage", "1"], "zero.stage 1 conflicts with zero_optimization.stage 3"),
        ({"zero_optimization": {"stgae": 3}}, [], "zero_optimization.stgae (did you mean 'stage'?)"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, [], "has a 'optimizer' section, but a run builds"),
        ({"scheduler": {"type": "WarmupLR"}}, [], "has a 'scheduler' section"),
        ({"bf16": {"enabled": True}}, ["--train.mixed_precision", "fp16"], "train.mixed_precision fp16 conflicts"),
    ],
    ids=["override-conflict", "unknown-key", "optimizer-section", "scheduler-section", "precision-conflict"],
)  # fmt: skip
def test_a_deepspeed_json_in_a_run_is_applied_whole_or_refused(tmp_path, json_config, overrides, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(json_config))
    with pytest.raises(ValueError) as raised:
        config = load_run_config(DEBUG, ["--zero.deepspeed", str(path), *overrides])
        config.zero.engine_settings(config.train.mixed_precision)
    assert message in str(raised.value)


def test_a_deepspeed_json_fills_what_the_run_leaves_unset(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e5}}))
    config = load_run_config(DEBUG, ["--zero.deepspeed", str(path), "--zero.stage", "3"])
    zero = config.zero.to_zero_config("no")
    # the file's stage and bucket, the run config's clipping (debug.yaml), nothing silently dropped
    assert (zero.stage, zero.reduce_bucket_size, zero.gradient_clipping) == (3, 500_000, 1.0)


@pytest.mark.parametrize(
    ("json_config", "refused"),
    [
        ({"communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "bf16"}}, None),
        ({"data_types": {"grad_accum_dtype": "fp32"}}, 'data_types.grad_accum_dtype = "fp32" .*here bf16'),
    ],
)
def test_a_jsons_dtype_keys_are_checked_at_the_runs_precision(tmp_path, json_config, refused):
    # the JSON enables no precision: train.mixed_precision bf16 gives it, and its dtypes are checked at that
    # (they were at fp32 when the zero section was read, refusing bf16 reductions)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(json_config))
    overrides = ["--zero.deepspeed", str(path), "--train.mixed_precision", "bf16"]
    if refused is None:
        assert load_run_config(DEBUG, overrides).zero.to_zero_config("bf16").mixed_precision == "bf16"
        return
    with pytest.raises(ValueError, match=refused):
        load_run_config(DEBUG, overrides)


@pytest.mark.parametrize(
    ("overrides", "counting"),
    [([], "deepspeed"), (["--zero.loss_scale_counting", "torch"], "torch")],
)
def test_a_deepspeed_json_counts_the_loss_scale_window_as_deepspeed_unless_the_run_says(
    tmp_path, overrides, counting
):
    # DeepSpeed's count is the JSON's default, not a key it states, so the run's zero section may choose
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale_window": 3}}))
    config = load_run_config(
        DEBUG, ["--zero.deepspeed", str(path), "--train.mixed_precision", "fp16", *overrides]
    )
    zero = config.zero.to_zero_config("fp16")
    assert (zero.loss_scale_counting, zero.loss_scale_window) == (counting, 3)
    assert load_run_config(DEBUG, []).zero.to_zero_config("fp16").loss_scale_counting == "torch"


@pytest.mark.parametrize(
    ("json_config", "overrides", "stage"),
    [
        ({"gradient_clipping": 1.0}, [], RUN_DEFAULT_STAGE),
        ({"zero_optimization": {"overlap_comm": True}}, [], RUN_DEFAULT_STAGE),
        ({"zero_optimization": {"stage": 0}}, [], 0),
        ({"zero_optimization": {"overlap_comm": True}}, ["--zero.stage", "1"], 1),
        # checked at the run's stage, not at DeepSpeed's 0 (where offloading has nothing to offload)
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, [], RUN_DEFAULT_STAGE),
        ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, ["--zero.stage", "3"], 3),
    ],
    ids=[
        "no-zero-section",
        "no-stage-key",
        "json-stage-0",
        "run-stage-1",
        "offload",
        "offload-param-stage-3",
    ],
)
def test_a_run_takes_its_default_stage_when_neither_it_nor_the_json_names_one(
    tmp_path, json_config, overrides, stage
):
    # RUN_DEFAULT_STAGE, not DeepSpeed's own 0 (which shards nothing), unless one of them names a stage
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(json_config))
    config = load_run_config(None, ["--zero.deepspeed", str(path), *overrides])  # a config naming no stage
    assert config.zero.to_zero_config("no").stage == stage


def test_a_launch_variable_selecting_the_engine_is_refused_by_a_run(monkeypatch, tmp_path):
    # a run's engine is its config's zero section: TNLG_ZERO_CONFIG would be silently ignored
    from tnlg.run.loop import TrainingJob, build_run

    monkeypatch.setenv("TNLG_ZERO_CONFIG", str(REPO / "configs" / "deepspeed" / "zero3-bf16.json"))
    config = load_run_config(DEBUG, ["--train.output_dir", str(tmp_path / "run")])
    with pytest.raises(
        ValueError,
        match=r"TNLG_ZERO_CONFIG=.*zero3-bf16\.json is set, but the run config.s zero section .* --zero.deepspeed",
    ):
        build_run(config, TrainingJob(name="pretrain", seq_len=8, tokenizer="byte-level", batches=iter(())))
    assert not (tmp_path / "run").exists()


def test_a_launchers_accumulation_other_than_the_runs_is_refused(monkeypatch, tmp_path):
    # it beats the Accelerator's argument, so the Accelerator would sync at 4 while the loop feeds 1
    from tnlg.run.loop import TrainingJob, build_run

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    config = load_run_config(DEBUG, ["--train.output_dir", str(tmp_path / "run")])
    with pytest.raises(
        ValueError, match=r"=4 \(accelerate launch .*\) conflicts with train.gradient_accumulation_steps 1"
    ):
        build_run(config, TrainingJob(name="pretrain", seq_len=8, tokenizer="byte-level", batches=iter(())))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("section", "expected"), [({}, "bf16"), ({"bf16": {"enabled": True}}, "bf16")])
def test_train_mixed_precision_fills_a_deepspeed_json_that_enables_none(tmp_path, section, expected):
    # The one rule of every front door (DeepSpeedConfig.with_mixed_precision), as ZeroAccelerator applies it.
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **section}))
    config = load_run_config(DEBUG, ["--zero.deepspeed", str(path), "--train.mixed_precision", "bf16"])
    assert config.zero.to_zero_config(config.train.mixed_precision).mixed_precision == expected


@pytest.mark.slow
def test_a_deepspeed_json_accumulation_must_agree_with_the_run(cache, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}))
    (refused,) = _run(cache, tmp_path / "a", "--zero.deepspeed", str(path))
    assert "sets 2 steps but the Accelerator was given gradient_accumulation_steps=1" in refused["error"]
    (agreed,) = _run(
        cache, tmp_path / "b", "--zero.deepspeed", str(path), "--train.gradient_accumulation_steps", "2"
    )
    assert len(agreed["losses"]) == 4
