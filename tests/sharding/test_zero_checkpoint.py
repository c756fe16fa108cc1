"""Engine checkpoints: every rank saves and loads its shard; a resumed run continues exactly; a checkpoint
loads at another world size and stage; damaged checkpoints are refused naming the file and the problem."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.run.checkpoint import find_engine_checkpoint
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.checkpoint import (
    ENGINE_DIRECTORY,
    CheckpointError,
    ShardReader,
    engine_directory,
    read_manifest,
    saved_params,
)
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)


def _train(rank, world_size, stage, steps, save_at=None, resume_from=None, directory=None):
    model = make_model()
    engine = initialize(
        model,
        make_optimizer(model),
        ZeroConfig(stage=stage, reduce_bucket_size=64, param_persistence_threshold=20, mixed_precision="no"),
    )
    start = 0
    if resume_from is not None:
        start = engine.load_checkpoint(f"{directory}/step{resume_from}")["global_steps"]
    losses = []
    for step, batch in enumerate(batches(steps)):
        if step < start:
            continue
        loss = engine(*local(batch, rank, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save_at is not None and step + 1 == save_at:
            engine.save_checkpoint(f"{directory}/step{save_at}")
    return {"losses": losses, "state": engine.full_state_dict()}


def _stop_and_resume(rank, world_size, stage, directory):
    whole = _train(rank, world_size, stage, 6)
    _train(rank, world_size, stage, 3, save_at=3, directory=directory)
    resumed = _train(rank, world_size, stage, 6, resume_from=3, directory=directory)
    return {"whole": whole, "resumed": resumed}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, stage):
    result = run_distributed(_stop_and_resume, 2, stage, str(tmp_path))[0]
    assert result["resumed"]["losses"] == result["whole"]["losses"][3:]  # bit for bit on CPU in fp32
    for name, tensor in result["whole"]["state"].items():
        assert (result["resumed"]["state"][name] == tensor).all(), name


def _mean_loss(engine, batch, rank, world_size) -> float:
    loss = engine(*local(batch, rank, world_size))
    engine.backward(loss)
    engine.step()
    value = loss.detach().clone()
    if world_size > 1:
        torch.distributed.all_reduce(value)
    return value.item() / world_size


def _engine(stage: int, bucket: int = 64):
    model = make_model()
    config = ZeroConfig(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=20)
    return initialize(model, make_optimizer(model), config)


def _save_then_continue(rank, world_size, stage, directory):
    """3 steps, a checkpoint, then 3 more: the continuation any reshaped load must reproduce."""
    engine = _engine(stage)
    data = batches(6)
    for batch in data[:3]:
        _mean_loss(engine, batch, rank, world_size)
    engine.save_checkpoint(directory)
    return [_mean_loss(engine, batch, rank, world_size) for batch in data[3:]]


def _load_then_continue(rank, world_size, stage, directory, resaved):
    # Another bucket size too: the units differ, the parameters are matched by name.
    engine = _engine(stage, bucket=200)
    assert engine.load_checkpoint(directory)["global_steps"] == 3
    engine.save_checkpoint(resaved)  # as loaded, before any step: must equal what was saved
    return [_mean_loss(engine, batch, rank, world_size) for batch in batches(6)[3:]]


def _consolidated(directory) -> dict[str, torch.Tensor]:
    """Every parameter's master weights and Adam moments, assembled from the rank files."""
    manifest = read_manifest(directory)
    reader = ShardReader(directory, manifest)
    return {
        f"{name}/{key}": reader.full_param(name, saved, key)
        for name, saved in saved_params(manifest).items()
        for key in ("master", "state.exp_avg", "state.exp_avg_sq")
    }


@pytest.mark.parametrize(
    ("saved_world", "saved_stage", "loaded_world", "loaded_stage"),
    [(2, 2, 1, 2), (1, 2, 2, 2), (2, 2, 4, 2), (4, 2, 2, 2), (2, 3, 2, 1), (2, 1, 2, 3), (4, 3, 1, 0)],
    ids=lambda v: str(v),
)
def test_a_checkpoint_loads_at_another_world_size_and_stage(
    tmp_path, saved_world, saved_stage, loaded_world, loaded_stage
):
    saved, resaved = tmp_path / "saved", tmp_path / "resaved"
    original = run_distributed(_save_then_continue, saved_world, saved_stage, str(saved))[0]
    continued = run_distributed(_load_then_continue, loaded_world, loaded_stage, str(saved), str(resaved))[0]
    before, after = _consolidated(saved), _consolidated(resaved)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name  # weights and optimizer state carried over exactly
    # The continuation differs only by the reduction order of another world size.
    assert continued == pytest.approx(original, rel=1e-5)


def _save(rank, world_size, directory):
    engine = _engine(2)
    _mean_loss(engine, batches(1)[0], rank, world_size)
    engine.save_checkpoint(directory)


def _try_load(rank, world_size, directory, model="same"):
    if model == "same":
        engine = _engine(2)
    else:  # another model: a different set of parameters
        extra = make_model()
        extra.register_parameter("added", torch.nn.Parameter(torch.zeros(3)))
        engine = initialize(extra, make_optimizer(extra), ZeroConfig(stage=2))
    try:
        engine.load_checkpoint(directory)
    except CheckpointError as error:
        return str(error)
    return "loaded"


@pytest.fixture
def saved(tmp_path):
    run_distributed(_save, 2, str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: _flip_a_bit(d / "rank-00001.safetensors"), "rank-00001.safetensors: sha256 differs"),
        (lambda d: (d / "rank-00000.safetensors").write_bytes((d / "rank-00000.safetensors").read_bytes()[:-100]),
         "rank-00000.safetensors is .* bytes, the manifest says .*: truncated"),
        (lambda d: (d / "rank-00001.safetensors").unlink(), "rank-00001.safetensors is missing"),
        (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda d: (d / "manifest.json").write_text("{"), "manifest.json is not valid JSON"),
    ],
    ids=["bit flip", "truncated", "missing rank file", "no manifest", "corrupt manifest"],
)  # fmt: skip
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved, damage, message):
    damage(saved)
    errors = run_distributed(_try_load, 2, str(saved))
    assert all(re.search(message, error) for error in errors), errors


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameters(saved):
    error = run_distributed(_try_load, 2, str(saved), "other")[0]
    assert "holds a different model's parameters; missing: added" in error


def _manifest_in(directory: Path) -> Path:
    """A directory that looks like an engine checkpoint to the finders (they look for its manifest)."""
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{}")
    return directory


def test_every_checkpoint_layout_finds_its_engine_directory(tmp_path):
    bare = _manifest_in(tmp_path / "bare")
    holder = _manifest_in(tmp_path / "save_state" / "engine").parent  # save_state, step-N, checkpoint-N
    run = tmp_path / "run" / "checkpoints"
    step = _manifest_in(run / "step-00000004" / "engine")
    (run / "latest").write_text('{"checkpoint": "step-00000004"}')
    assert find_engine_checkpoint(bare) == bare
    assert find_engine_checkpoint(holder) == holder / ENGINE_DIRECTORY
    assert find_engine_checkpoint(run) == step
    assert engine_directory(holder) == holder / ENGINE_DIRECTORY
    with pytest.raises(FileNotFoundError, match="holds no engine checkpoint"):
        find_engine_checkpoint(tmp_path / "run")


def test_a_trainer_checkpoint_of_the_old_zero_layout_says_to_rename_it(tmp_path):
    checkpoint = _manifest_in(tmp_path / "checkpoint-2" / "zero").parent
    rename = re.escape(f"rename {checkpoint / 'zero'} to {checkpoint / 'engine'}")
    for find in (engine_directory, find_engine_checkpoint):
        with pytest.raises(CheckpointError, match=rename):
            find(checkpoint)
    (checkpoint / "zero").rename(checkpoint / "engine")  # the rename the error asks for: it loads
    assert find_engine_checkpoint(checkpoint) == checkpoint / "engine"
