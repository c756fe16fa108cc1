"""Filling a new engine's shards: from the module's own weights, or for a meta-device model from a
checkpoint's slices and/or the seeded initialization, each rank building only what it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .flat_group import FlatGroup
from .init import materialize
from .pretrained import PretrainedSource, load_pretrained

if TYPE_CHECKING:
    from tnlg.modeling.tensor_parallel import TensorSlice

    from .engine_state import ShardedModel


def fill_shards(
    engine: ShardedModel,
    tensor_slices: dict[str, TensorSlice],
    planned: torch.device,
    target: torch.device,
    seed: int,
    source: PretrainedSource | None,
) -> int:
    """The groups' buffers from the module's own weights (every rank taking rank 0's), or for a meta
    model from `source` and/or the seeded initialization. Returns the bytes this rank read of `source`."""
    if planned.type == "meta":
        return _materialize(engine, tensor_slices, seed, target, source)
    if source is not None:
        raise ValueError(
            f"pretrained={source.path} needs a model built on the meta device (meta_from_pretrained); this "
            "one already holds weights"
        )
    if target != planned:
        raise ValueError(f"device={target} differs from the model's device {planned}; move the model")
    _sync_module_states(engine)
    for group in engine.groups:
        group.build_from_params()
    return 0


def _sync_module_states(engine: ShardedModel) -> None:
    """Every rank starts from rank 0's parameters and buffers, as DistributedDataParallel does."""
    if not engine.collectives.active:
        return
    with torch.no_grad():
        for tensor in [*engine.module.parameters(), *engine.module.buffers()]:
            engine.collectives.broadcast(tensor.data, 0)


def _materialize(
    engine: ShardedModel,
    tensor_slices: dict[str, TensorSlice],
    seed: int,
    device: torch.device,
    source: PretrainedSource | None,
) -> int:
    """A meta-device model: each rank builds only its shards, from a checkpoint's slices (see
    [Note: pretrained shards]) and/or the seeded initialization (see [Note: seeded initialization]).
    Returns the bytes read of `source`."""
    groups, module = engine.groups, engine.module
    where = {id(p): (group, i) for group in groups for i, p in enumerate(group.params)}
    for group in groups:
        group.allocate()
    # Tensor slicing: parameters are initialised whole and this rank keeps its slice of each.
    parameters = dict(module.named_parameters())
    cuts = {id(parameters[name]): cut for name, cut in tensor_slices.items()}
    whole_shapes = {
        id(parameters[name]): cut.full_shape(parameters[name].shape) for name, cut in tensor_slices.items()
    }

    def keep(param: nn.Parameter, value: torch.Tensor) -> None:
        if id(param) in cuts:
            value = cuts[id(param)].local(value)
        if id(param) in where:
            group, index = where[id(param)]
            group.load_slot(index, value)
        else:  # frozen: kept whole, as on every rank
            torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=False))

    bytes_read = 0
    if source is None:
        materialize(module, seed, device, keep, whole_shapes=whole_shapes)
    else:
        loaded = load_pretrained(engine, source, device, tensor_slices)
        bytes_read = loaded.bytes_read
        if loaded.uninitialized:
            materialize(module, seed, device, keep, only=loaded.uninitialized, whole_shapes=whole_shapes)
    for group in groups:
        group.finish()
    return bytes_read


def cast_frozen_floating_tensors(module: nn.Module, groups: list[FlatGroup], dtype: torch.dtype) -> None:
    """Frozen parameters compute in the same dtype as the sharded ones."""
    if dtype == torch.float32:
        return
    sharded = {id(p) for group in groups for p in group.params}  # inference: frozen but sharded
    for param in module.parameters():
        if not param.requires_grad and param.is_floating_point() and id(param) not in sharded:
            param.data = param.data.to(dtype)
