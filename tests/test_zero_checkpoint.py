"""Engine checkpoints: every rank saves and loads its shard; a resumed run continues exactly."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize


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


def _load_with_another_stage(rank, world_size, directory):
    _train(rank, world_size, 1, 1, save_at=1, directory=directory)
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(stage=2))
    try:
        engine.load_checkpoint(f"{directory}/step1")
    except ValueError as error:
        return str(error)
    return "loaded"


def test_a_checkpoint_of_another_stage_is_refused_naming_it(tmp_path):
    message = run_distributed(_load_with_another_stage, 2, str(tmp_path))[0]
    assert "stage 1" in message
