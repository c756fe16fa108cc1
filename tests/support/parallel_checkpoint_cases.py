"""What each rank runs in the checkpoints-across-layouts tests (module-level so that spawned processes
import it): the tiny TNLG model trained with `train_batch` at one (tensor, pipeline, data) layout,
saved, and loaded at another."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.parallel_cases import make_tnlg, tnlg_batches, tnlg_optimizer
from tnlg.sharding import ParallelDims, ZeroConfig, initialize
from tnlg.sharding.parallel import gather_tensor_slices

STEPS = 4  # in all; checkpoints are saved after SAVE_AT of them
SAVE_AT = 2


MOMENTS = ("exp_avg", "exp_avg_sq")


def build(tensor: int | None, stage: int, pipeline: int = 1, layers: int = 2):
    """The engine of the tiny model with `layers` layers at tensor degree `tensor` and `pipeline` stages
    (`tensor` None: no `parallel=`, one process without torch.distributed)."""
    model = make_tnlg(num_hidden_layers=layers)
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    parallel = ParallelDims(tensor=tensor, pipeline=pipeline) if tensor is not None else None
    return initialize(model, tnlg_optimizer(model), config, parallel=parallel)


def optimizer_moments(engine) -> dict[str, torch.Tensor]:
    """{"name/exp_avg" and "name/exp_avg_sq": the whole tensor} for every parameter, and {"step/g": Adam's
    step of param group g}, assembled from the live optimizer state of every rank (data shards, tensor
    slices, pipeline stages), not from a checkpoint. Collective; every rank gets the result."""
    optimizer = engine.base_optimizer
    local, steps = {key: {} for key in MOMENTS}, {}
    for index, group in enumerate(engine.groups):
        state = optimizer.state.get(group.master, {})
        if "step" in state:
            steps[f"step/{index}"] = state["step"].detach().clone().cpu().reshape(())
        layout = group.layout
        for key in MOMENTS:
            shard = state[key].detach().cpu() if key in state else torch.zeros(layout.shard_numel)
            shards = engine.collectives.all_gather_object(shard)  # every data rank's, in rank order
            for unit in layout.units:
                full = torch.cat([layout.shard_piece(s, unit) for s in shards])
                for slot in (layout.slots[i] for i in unit.slots):
                    local[key][slot.name] = layout.param_view(full, slot).clone()
    if engine.tensor_slices:
        for key in MOMENTS:
            whole = gather_tensor_slices(local[key], engine.tensor_slices, engine.parallel.tensor, "cpu")
            local[key].update(whole)
    moments = {f"{name}/{key}": value for key in MOMENTS for name, value in local[key].items()}
    moments.update(steps)
    if engine.pipeline is not None:  # every stage's (the tied embedding's, equal on two, once)
        stages = [{}] * engine.parallel.dims.pipeline
        dist.all_gather_object(stages, moments, group=engine.parallel.pipeline)
        moments = {key: value for stage in stages for key, value in stage.items()}
    return moments


def train_data_share(engine, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """One step of `train_batch` on this data rank's share of the global batch (one sample per micro-batch)."""
    data_rank, data_size = (
        (engine.parallel.rank("data"), engine.parallel.dims.data) if engine.parallel is not None else (0, 1)
    )
    share = slice(data_rank * len(ids) // data_size, (data_rank + 1) * len(ids) // data_size)
    micro = [
        {"input_ids": i[None], "labels": t[None]} for i, t in zip(ids[share], labels[share], strict=True)
    ]
    return engine.train_batch(micro).item()


def run_layout(
    rank: int,
    world_size: int,
    tensor: int | None,
    stage: int,
    save: str | None = None,
    load: str | None = None,
    resave: str | None = None,
    pipeline: int = 1,
    layers: int = 2,
) -> dict:
    """Train the STEPS steps at this layout: from the start, saving to `save` after SAVE_AT steps, or
    from `load` (then at once, before any step, saving what was loaded to `resave`). Returns the mean
    losses of the steps run, full_state_dict() and Adam's state (`optimizer_moments`) when saved / just
    loaded, and full_state_dict() at the end."""
    engine = build(tensor, stage, pipeline, layers)
    start, result = 0, {}
    if load is not None:
        start = engine.load_checkpoint(load)["global_steps"]
        result["loaded"] = engine.full_state_dict(rank0_only=False)
        result["loaded_moments"] = optimizer_moments(engine)
        if resave is not None:
            engine.save_checkpoint(resave)
    losses = []
    for step, (ids, labels) in enumerate(tnlg_batches(STEPS)):
        if step < start:
            continue
        losses.append(train_data_share(engine, ids, labels))
        if save is not None and step + 1 == SAVE_AT:
            engine.save_checkpoint(save)
            result["saved"] = engine.full_state_dict(rank0_only=False)
            result["saved_moments"] = optimizer_moments(engine)
    result.update(losses=losses, state=engine.full_state_dict(rank0_only=False), start=start)
    engine.close()
    return result


def try_load(
    rank: int, world_size: int, tensor: int, stage: int, directory: str, pipeline: int = 1, layers: int = 2
) -> str | None:
    """The CheckpointError a load raises on this rank (the same on every rank), or None."""
    from tnlg.sharding.checkpoint import CheckpointError

    engine = build(tensor, stage, pipeline, layers)
    try:
        engine.load_checkpoint(directory)
    except CheckpointError as error:
        return str(error)
    finally:
        engine.close()
    return None
