"""What a run may do to its output directory, checked before anything is built: it never mixes two runs,
never removes its own inputs with train.overwrite, and names an output that is a file at once."""

from __future__ import annotations

import pytest

from tests.support import REPO
from tnlg.run.config import load_run_config
from tnlg.run.output import check_output_directory

DEBUG = REPO / "configs" / "pretrain" / "debug.yaml"
NO_INPUTS: dict = {}


def _used(directory):
    """A directory holding a run: a checkpoint, a model and a loss curve."""
    (directory / "checkpoints" / "step-00000002").mkdir(parents=True)
    (directory / "model").mkdir()
    (directory / "loss_curve.json").write_text("{}")
    return directory


def test_resuming_its_own_checkpoint_continues_the_run(tmp_path):
    run = _used(tmp_path / "run")
    assert check_output_directory(run, run / "checkpoints" / "step-00000002", False, NO_INPUTS) == []
    # a step directory that is a link to other storage is still this run's
    (tmp_path / "elsewhere").mkdir()
    (run / "checkpoints" / "step-00000004").symlink_to(tmp_path / "elsewhere")
    assert check_output_directory(run, run / "checkpoints" / "step-00000004", False, NO_INPUTS) == []


def test_overwrite_with_a_resume_of_the_same_run_is_refused(tmp_path):
    # the overwrite was silently not applied: the run continued and removed nothing
    run = _used(tmp_path / "run")
    link = tmp_path / "link"
    link.symlink_to(run / "checkpoints")  # through a link too
    for resumed in (run / "checkpoints" / "step-00000002", link / "step-00000002"):
        with pytest.raises(
            ValueError, match=r"continues the run in train.output_dir .*, which train.overwrite"
        ):
            check_output_directory(run, resumed, True, {"--resume": resumed})


def test_resuming_another_runs_checkpoint_into_a_used_directory_is_refused(tmp_path):
    # it replaced this run's checkpoints, model and loss curve with the other run's, step by step
    other, run = _used(tmp_path / "other"), _used(tmp_path / "run")
    with pytest.raises(
        FileExistsError, match=r"already holds a run .* \(--resume names a checkpoint of another"
    ):
        check_output_directory(run, other / "checkpoints" / "step-00000002", False, NO_INPUTS)
    assert (
        check_output_directory(tmp_path / "new", other / "checkpoints" / "step-00000002", False, NO_INPUTS)
        == []
    )
    replaced = check_output_directory(run, other / "checkpoints" / "step-00000002", True, NO_INPUTS)
    assert replaced == ["checkpoints", "loss_curve.json", "model"]


def test_overwrite_refuses_to_remove_the_runs_own_inputs(tmp_path):
    run = _used(tmp_path / "run")
    with pytest.raises(ValueError, match=r"model.init_from .*/run/model lies in the previous run's model"):
        check_output_directory(run, None, True, {"model.init_from": run / "model"})
    link = tmp_path / "link"
    link.symlink_to(run / "model")  # through a link too
    with pytest.raises(ValueError, match=r"model.init_from .*link lies in the previous run's model"):
        check_output_directory(run, None, True, {"model.init_from": link})
    elsewhere = _used(tmp_path / "elsewhere")
    assert check_output_directory(run, None, True, {"model.init_from": elsewhere / "model"}) == [
        "checkpoints", "loss_curve.json", "model",
    ]  # fmt: skip


def test_an_output_directory_that_is_a_file_is_refused_before_the_run_is_built(tmp_path):
    # it was found only when the trained model was saved into it, after the whole run
    from tnlg.run.loop import TrainingJob, build_run

    (tmp_path / "runfile").write_text("not a directory")
    config = load_run_config(DEBUG, ["--train.output_dir", str(tmp_path / "runfile")])
    with pytest.raises(NotADirectoryError, match=r"train.output_dir .*runfile is a file, not a directory"):
        build_run(config, TrainingJob(name="pretrain", seq_len=8, tokenizer="byte-level", batches=iter(())))
    assert (tmp_path / "runfile").read_text() == "not a directory"


def test_a_failed_gpt2_export_keeps_the_previous_one(tmp_path, monkeypatch):
    # a resumed run that finishes again exports anew: it removed the old export before writing the new
    import tnlg.run.loop as loop

    target = tmp_path / "model-gpt2"
    target.mkdir()
    (target / "config.json").write_text("the previous export")

    def failing_export(model, output, **kwargs):
        (output / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(loop, "export_gpt2", failing_export)
    with pytest.raises(OSError, match="disk full"):
        loop._export_gpt2(tmp_path / "model", target)
    assert [p.name for p in target.iterdir()] == ["config.json"]
    assert (target / "config.json").read_text() == "the previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["model-gpt2"]  # no staging left


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            '{"model_type": "gpt2", "n_layer": 2}',
            r"holds a 'gpt2' model, not a 'tnlg' one: .* --from gpt2 --input",
        ),
        ('{"n_layer": 2}', r"holds a None model, not a 'tnlg' one: tnlg converts GPT-2, Megatron-LM and"),
        ("{not json", r"config.json is not valid JSON"),
        ("[1, 2]", r"config.json holds a JSON list, not a model config"),
    ],
    ids=["gpt2", "no-model-type", "not-json", "not-an-object"],
)
def test_init_from_another_models_checkpoint_is_refused(tmp_path, config, message):
    # Transformers read a GPT-2 config.json as the default TNLG architecture, with a warning only
    from tnlg.run.build import check_init_from

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=message):
        check_init_from(str(tmp_path))


def test_resume_latest_naming_a_missing_checkpoint_is_named(tmp_path):
    # it warned "records no run config", built the engine, then failed on the missing manifest; with
    # train.resume_fallback the load takes the newest older checkpoint instead (CheckpointError per candidate)
    from tnlg.run.loop import TrainingJob, build_run

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest").write_text('{"checkpoint": "step-00000004"}')
    config = load_run_config(DEBUG, ["--train.output_dir", str(tmp_path / "run")])
    job = TrainingJob(name="pretrain", seq_len=8, tokenizer="byte-level", batches=iter(()))
    with pytest.raises(
        ValueError, match=r"latest names step-00000004, which is not there: set train.resume_fallback"
    ):
        build_run(config, job, resume="latest")
