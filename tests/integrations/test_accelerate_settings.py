"""ZeroAccelerator reads Accelerate's own settings as Accelerate does: the launcher's mixed precision, a
GradScalerKwargs handler, batch keys over data-parallel replicas, one clipping value, the gradient
accumulation plugin's sync_each_batch; and refuses save_on_each_node where it cannot apply it."""

from __future__ import annotations

import json
import math

import pytest

from tnlg.tools.spawn import run_distributed


def _error(make) -> str:
    try:
        make()
    except ValueError as error:
        return str(error)
    return "no error"


def _fresh_accelerator(**arguments):
    from accelerate.state import AcceleratorState

    from tnlg.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(True)  # each case its own mixed precision
    return ZeroAccelerator(**arguments)


def _mixed_precision_from_the_launcher(rank: int, world_size: int, directory: str) -> dict:
    import os

    import torch

    found = {}
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"  # what `accelerate launch --mixed_precision bf16` sets
    os.environ["TNLG_ZERO_STAGE"] = "2"
    accelerator = _fresh_accelerator()
    model = torch.nn.Linear(4, 4)
    engine, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    found["environment"] = (accelerator.mixed_precision, str(next(engine.module.parameters()).dtype))
    del os.environ["TNLG_ZERO_STAGE"]
    auto = os.path.join(directory, "auto.json")
    with open(auto, "w") as file:
        json.dump({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}, file)
    found["auto"] = _fresh_accelerator(zero_config=auto).zero_config.mixed_precision
    fp16 = os.path.join(directory, "fp16.json")
    with open(fp16, "w") as file:
        json.dump({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, file)
    found["clash"] = _error(lambda: _fresh_accelerator(zero_config=fp16))
    return found


def test_the_launchers_mixed_precision_reaches_the_engine(tmp_path):
    found = run_distributed(_mixed_precision_from_the_launcher, 1, str(tmp_path))[0]
    assert found["environment"] == ("bf16", "torch.bfloat16")
    assert found["auto"] == "bf16"
    assert "ACCELERATE_MIXED_PRECISION=bf16" in found["clash"]
    assert "enables fp16" in found["clash"]


def _grad_scaler_kwargs(rank: int, world_size: int, directory: str) -> dict:
    from accelerate.utils import GradScalerKwargs

    from tnlg.sharding import ZeroConfig

    def make(zero_config, **handler):
        return _fresh_accelerator(
            zero_config=zero_config, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**handler)]
        )

    config = make(ZeroConfig(stage=1), init_scale=1024.0, growth_interval=10).zero_config
    json_config = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": "auto", "initial_scale_power": 8}}
    return {
        "applied": (config.initial_loss_scale, config.loss_scale_window),
        "backoff": _error(lambda: make(ZeroConfig(stage=1), init_scale=1024.0, backoff_factor=0.25)),
        "disabled": _error(lambda: make(ZeroConfig(stage=1), enabled=False)),
        "json clash": _error(lambda: make(json_config, init_scale=1024.0)),
        "json agrees": make(json_config, init_scale=256.0).zero_config.initial_loss_scale,
        "zero clash": _error(lambda: make(ZeroConfig(stage=1, loss_scale_window=50), growth_interval=10)),
    }


def test_grad_scaler_kwargs_set_the_engines_loss_scaler_or_are_refused(tmp_path):
    found = run_distributed(_grad_scaler_kwargs, 1, str(tmp_path))[0]
    assert found["applied"] == (1024.0, 10)
    assert "backoff_factor=0.25" in found["backoff"] and "initial_scale_power" in found["backoff"]
    assert "enabled=False" in found["disabled"]
    assert "initial_loss_scale 1024.0" in found["json clash"] and "256.0" in found["json clash"]
    assert found["json agrees"] == 256.0
    assert "loss_scale_window 10" in found["zero clash"] and "50" in found["zero clash"]


def _batch_keys_under_tensor_slicing(rank: int, world_size: int, directory: str) -> dict:
    from tnlg.accelerate import ZeroAccelerator
    from tnlg.sharding import ParallelDims

    def make(total: int):
        config = {
            "zero_optimization": {"stage": 1},
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 1,
            "train_batch_size": total,
        }
        return ZeroAccelerator(zero_config=config, parallel=ParallelDims(tensor=2))

    found = {"correct": make(8).data_parallel_size}
    found["wrong"] = _error(lambda: make(16))
    return found


def test_batch_keys_count_data_parallel_replicas_not_tensor_slices(tmp_path):
    found = run_distributed(_batch_keys_under_tensor_slicing, 2, str(tmp_path))
    assert [f["correct"] for f in found] == [1, 1]
    assert "train_batch_size 16 != train_micro_batch_size_per_gpu 8" in found[0]["wrong"]


def _clipping(rank: int, world_size: int, directory: str) -> dict:
    import torch

    def step(gradient_clipping: float | None, max_norm: float) -> float | str:
        config = {"zero_optimization": {"stage": 1}}
        if gradient_clipping is not None:
            config["gradient_clipping"] = gradient_clipping
        accelerator = _fresh_accelerator(zero_config=config)
        model = torch.nn.Linear(4, 4)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
        accelerator.backward(engine(torch.full((2, 4), 10.0)).pow(2).sum())
        try:
            accelerator.clip_grad_norm_(engine.parameters(), max_norm)
        except ValueError as error:
            return str(error)
        optimizer.step()
        after = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        return (after - before).norm().item()  # SGD at lr 1: the applied gradient's norm

    return {
        "inf": step(0.1, math.inf),
        "same": step(0.1, 0.1),
        "other": step(0.1, 1000.0),
        "unconfigured": step(None, 0.5),
    }


def test_the_configured_clipping_governs_clip_grad_norm(tmp_path):
    found = run_distributed(_clipping, 1, str(tmp_path))[0]
    assert found["inf"] == pytest.approx(0.1, rel=1e-4)  # inf only reads the norm
    assert found["same"] == pytest.approx(0.1, rel=1e-4)
    assert "max_norm=1000.0" in found["other"] and "gradient_clipping 0.1" in found["other"]
    assert found["unconfigured"] == pytest.approx(0.5, rel=1e-4)  # no configured clipping: the call's


def _save_on_each_node(rank: int, world_size: int, directory: str, nodes: int) -> dict:
    """What ZeroAccelerator does with save_on_each_node when the 2 processes are on `nodes` machines (2:
    each process reports a host name of its own and is its machine's first, as on two machines)."""
    import os
    import socket
    from pathlib import Path

    import torch
    from accelerate.utils import ProjectConfiguration

    if nodes == 2:
        socket.gethostname = lambda: f"node-{rank}"  # this rank's process only
    # On one machine too every rank says local index 0, as Accelerate reads a missing LOCAL_RANK on CPU (a
    # process group made without the launcher): the machines are counted by host name, not by it.
    os.environ["LOCAL_RANK"] = "0"
    found = {}
    asked = ProjectConfiguration(save_on_each_node=True)
    found["built"] = _error(
        lambda: _fresh_accelerator(zero_config={"zero_optimization": {"stage": 2}}, project_config=asked)
    )
    accelerator = _fresh_accelerator(zero_config={"zero_optimization": {"stage": 2}})
    found["nodes"] = accelerator.num_nodes
    model = torch.nn.Linear(4, 4)
    engine, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.project_configuration.save_on_each_node = True  # set after the accelerator was built
    checkpoint, saved = Path(directory) / "checkpoint", Path(directory) / "model"
    found["save_state"] = _error(lambda: accelerator.save_state(checkpoint))
    found["save_model"] = _error(lambda: accelerator.save_model(engine, saved))
    accelerator.wait_for_everyone()
    found["written"] = sorted(path.name for path in Path(directory).iterdir())
    return found


@pytest.mark.slow
def test_save_on_each_node_is_refused_on_several_nodes_and_kept_on_one(tmp_path):
    # The engine's checkpoint is written once, for storage every node shares: ignored, the setting would
    # leave the second node without the manifest, and the run could not resume there.
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    two = run_distributed(_save_on_each_node, 2, str(tmp_path / "two"), 2)
    for found in two:
        assert found["nodes"] == 2
        for refused in (found["built"], found["save_state"], found["save_model"]):
            assert "ProjectConfiguration(save_on_each_node=True) with processes on 2 nodes" in refused
            assert "node-local checkpoints are not implemented" in refused
        assert found["written"] == []  # refused before anything was written
    one = run_distributed(_save_on_each_node, 2, str(tmp_path / "one"), 1)
    for found in one:
        assert found["nodes"] == 1
        assert found["built"] == "no error"
        assert found["save_state"] == found["save_model"] == "no error"
        assert found["written"] == ["checkpoint", "model"]


def _sync_each_batch(rank: int, world_size: int, stage: int, sync_each_batch: bool) -> dict:
    """The documented loop's losses and the engine's gradient reductions with Accelerate's
    GradientAccumulationPlugin(num_steps=2, sync_each_batch=...)."""
    import torch
    from accelerate.utils import GradientAccumulationPlugin

    from tests.support.accelerate_cases import _loader, train_loop
    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.sharding import ZeroConfig

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = _fresh_accelerator(zero_config=ZeroConfig(stage=stage), gradient_accumulation_plugin=plugin)
    model = debug_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _loader(world_size), scheduler
    )
    model.reset_comm_stats()
    losses = train_loop(accelerator, model, optimizer, loader, scheduler)
    reductions = model.comm_stats().get("all_reduce" if stage == 0 else "reduce_scatter", {}).get("calls", 0)
    return {"losses": losses, "reductions": reductions}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_sync_each_batch_reduces_every_micro_batch_and_trains_the_same(stage):
    # Accelerate then leaves no_sync out of accumulate(): stages 0-1, which otherwise reduce only at the
    # accumulation boundary, reduce each micro-batch into what they hold (stage 0 the averaged buffer,
    # stage 1 its piece of the means, multiplied back into its share of the sum first); the step is the same.
    once = run_distributed(_sync_each_batch, 2, stage, False)
    each = run_distributed(_sync_each_batch, 2, stage, True)
    assert each[0]["reductions"] == 2 * once[0]["reductions"] > 0
    for a, b in zip(once, each, strict=True):
        assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)


def _dtype_keys_at_the_accelerators_precision(rank: int, world_size: int, directory: str) -> dict:
    def make(mixed_precision: str):
        config = {"zero_optimization": {"stage": 1}, "communication_data_type": "bf16"}
        return _fresh_accelerator(
            zero_config=config, mixed_precision=mixed_precision
        ).zero_config.mixed_precision

    return {"bf16": make("bf16"), "fp32": _error(lambda: make("no"))}


def test_the_jsons_dtype_keys_are_checked_when_the_accelerator_settles_its_precision(tmp_path):
    # refused when the accelerator is built (at fp32 a bf16 reduction would not be what trains), not
    # only once prepare() builds the engine
    found = run_distributed(_dtype_keys_at_the_accelerators_precision, 1, str(tmp_path))[0]
    assert found["bf16"] == "bf16"
    assert (
        'communication_data_type = "bf16" is not supported' in found["fp32"] and "here fp32" in found["fp32"]
    )
