"""A DeepSpeed ZeRO checkpoint restored into a tnlg engine at any world size and ZeRO stage: each rank
takes its own ranges of the whole fp32 masters and Adam moments (`read_deepspeed_checkpoint`), as from
one of tnlg's checkpoints, with no conversion step (see [Note: DeepSpeed ZeRO checkpoint layout])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint import check_same_parameters, saved_hyperparameters, scalar_state_device
from ..checkpoint_files import MANIFEST, CheckpointError
from ..engine_state import EngineState
from .zero_checkpoint import ADAM_KEYS, DeepSpeedZeroState, deepspeed_tag_directory, read_deepspeed_checkpoint


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a DeepSpeed checkpoint (save or tag directory) rather than one of tnlg's."""
    path = Path(path)
    return not (path / MANIFEST).exists() and deepspeed_tag_directory(path) is not None


def load_deepspeed_checkpoint(engine: EngineState, path: str | Path, sliced: bool = False) -> dict[str, Any]:
    """Restore this rank's master shard, Adam's moments and step, the loss scale, the step count and
    the module's buffers from the DeepSpeed checkpoint at `path`. Every rank reads the same files, so
    a refused checkpoint raises the same error on each, before anything is replaced. Returns a
    summary (stage, world size, steps) of what was read."""
    if sliced:
        raise CheckpointError(
            f"{path} is a DeepSpeed checkpoint: those load into engines without tensor slicing or "
            "pipeline stages (data parallelism at any world size and ZeRO stage)"
        )
    state = read_deepspeed_checkpoint(path)
    live = {slot.name: tuple(slot.shape) for group in engine.groups for slot in group.layout.slots}
    saved = {name: tuple(tensor.shape) for name, tensor in state.masters.items()}
    check_same_parameters(state.directory, saved, live, set(live))
    if len(set(state.adam_steps)) > 1:
        raise CheckpointError(
            f"{state.directory}: Adam's step differs between flat groups: {state.adam_steps}"
        )
    step = state.adam_steps[0] if state.adam_steps else 0
    restored = [_group_state(engine, index, group, state, step) for index, group in enumerate(engine.groups)]

    optimizer = engine.base_optimizer
    buffers = dict(engine.module.named_buffers())
    with torch.no_grad():  # the 16-bit parameters are written through views of the flat buffers
        for index, (group, (master, moments, hyperparameters)) in enumerate(
            zip(engine.groups, restored, strict=True)
        ):
            group.master.copy_(master)
            optimizer.state[group.master] = moments
            optimizer.param_groups[index].update(hyperparameters)
            group.write_back()
        for name, tensor in state.buffers.items():
            if name in buffers:
                buffers[name].copy_(tensor)
    engine_state = engine.checkpoint_state()
    # The scaler comes back only from a dynamic fp16 run into a dynamic fp16 engine (LossScaler.resume):
    # a bf16 or fp32 run's scale of 1 would otherwise replace an fp16 engine's initial scale.
    engine_state["mixed_precision"] = "fp16" if state.loss_scale_dynamic is not None else "bf16 or fp32"
    engine_state["loss_scaler"] = {
        **engine_state["loss_scaler"],
        "scale": state.loss_scale,
        "dynamic": bool(state.loss_scale_dynamic),
    }
    if state.loss_scale_clean_steps is not None and state.loss_scale_overflows_left is not None:
        engine_state["loss_scaler"]["clean_steps"] = state.loss_scale_clean_steps
        engine_state["loss_scaler"]["overflows_left"] = state.loss_scale_overflows_left
    engine_state["global_steps"] = state.global_steps
    engine.restore_checkpoint_state(engine_state)
    return {
        "format": "deepspeed", "directory": str(state.directory), "stage": state.stage,
        "world_size": state.world_size, "global_steps": state.global_steps, "adam_step": step,
        "lr_scheduler": state.lr_scheduler,
    }  # fmt: skip


def _group_state(
    engine: EngineState, index: int, group: Any, state: DeepSpeedZeroState, step: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's (master, Adam state, hyperparameters) of tnlg param group `index`."""
    optimizer = engine.base_optimizer
    names = [slot.name for slot in group.layout.slots]
    sources = {
        source
        for source, group_names in enumerate(state.group_names)
        for name in names
        if name in group_names
    }
    if len(sources) > 1:
        raise CheckpointError(
            f"{state.directory}: the parameters of param group {index} were in DeepSpeed's groups "
            f"{sorted(sources)}: the optimizer's param groups must hold the same parameters as when it was saved"
        )
    master = torch.zeros_like(group.master)  # padding stays zero, as in a fresh engine
    moments = {key: torch.zeros_like(group.master) for key in ADAM_KEYS}
    for slot in group.layout.slots:
        owned = group.layout.owned_range(slot, group.shard_rank)
        if owned is None:
            continue
        start, end, at = owned
        master[at : at + end - start].copy_(state.masters[slot.name].reshape(-1)[start:end])
        for key in ADAM_KEYS:
            moments[key][at : at + end - start].copy_(state.moments[key][slot.name].reshape(-1)[start:end])
    live = optimizer.state.get(group.master, {}).get("step")
    device = live.device if live is not None else scalar_state_device(optimizer, group)
    adam = {"step": torch.tensor(float(step), device=device), **moments}
    same_groups = sources and len(state.param_groups) == len(state.group_names)
    saved = state.param_groups[sources.pop()] if same_groups else {}
    hyperparameters = saved_hyperparameters(saved, optimizer.param_groups[index])
    return master, adam, hyperparameters
