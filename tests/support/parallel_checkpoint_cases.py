"""What each rank runs in the checkpoints-across-layouts tests (module-level so that spawned processes
import it): the tiny TNLG model trained with `train_batch` at one (tensor, data) layout, saved, and
loaded at another."""

from __future__ import annotations

import torch

from tests.support.parallel_cases import make_tnlg, tnlg_batches, tnlg_optimizer
from tnlg.sharding import ParallelDims, ZeroConfig, initialize

STEPS = 4  # in all; checkpoints are saved after SAVE_AT of them
SAVE_AT = 2


def build(tensor: int | None, stage: int):
    """The engine at tensor degree `tensor` (None: no `parallel=`, one process without torch.distributed)."""
    model = make_tnlg()
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    parallel = ParallelDims(tensor=tensor) if tensor is not None else None
    return initialize(model, tnlg_optimizer(model), config, parallel=parallel)


def _step(engine, ids: torch.Tensor, labels: torch.Tensor) -> float:
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
) -> dict:
    """Train the STEPS steps at this layout: from the start, saving to `save` after SAVE_AT steps, or
    from `load` (then at once, before any step, saving what was loaded to `resave`). Returns the mean
    losses of the steps run, full_state_dict() when saved / just loaded, and at the end."""
    engine = build(tensor, stage)
    start, result = 0, {}
    if load is not None:
        start = engine.load_checkpoint(load)["global_steps"]
        result["loaded"] = engine.full_state_dict(rank0_only=False)
        if resave is not None:
            engine.save_checkpoint(resave)
    losses = []
    for step, (ids, labels) in enumerate(tnlg_batches(STEPS)):
        if step < start:
            continue
        losses.append(_step(engine, ids, labels))
        if save is not None and step + 1 == SAVE_AT:
            engine.save_checkpoint(save)
            result["saved"] = engine.full_state_dict(rank0_only=False)
    result.update(losses=losses, state=engine.full_state_dict(rank0_only=False), start=start)
    engine.close()
    return result


def try_load(rank: int, world_size: int, tensor: int, stage: int, directory: str) -> str | None:
    """The CheckpointError a load raises on this rank (the same on every rank), or None."""
    from tnlg.sharding.checkpoint import CheckpointError

    engine = build(tensor, stage)
    try:
        engine.load_checkpoint(directory)
    except CheckpointError as error:
        return str(error)
    finally:
        engine.close()
    return None
