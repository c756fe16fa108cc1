"""`ZeroEngine.full_state_dict`: the whole model's state dict from every rank's shards, slices and stages.

Three gathers, innermost first: each flat group's units all-gathered over the data group from the fp32
master (the exact trained values), then with tensor slicing each cut parameter made whole over the
tensor group, then with pipeline stages every stage's tensors merged over the pipeline group. Frozen
parameters and buffers are taken as the module holds them. Peak memory beyond the shards: one unit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Collectives
from .flat_group import FlatGroup
from .parallel import gather_tensor_slices

if TYPE_CHECKING:
    from tnlg.modeling.tensor_parallel import TensorSlice

    from .engine_state import PipelineStages
    from .parallel import ParallelGroups


def full_state_dict(
    module: nn.Module,
    groups: list[FlatGroup],
    collectives: Collectives,
    parallel: ParallelGroups | None,
    tensor_slices: dict[str, TensorSlice],
    pipeline: PipelineStages | None,
    rank0_only: bool,
) -> dict[str, torch.Tensor]:
    """`module.state_dict()`'s keys with whole values, on rank 0 only with `rank0_only` (the others get
    {}). Collective over every group the model is laid out on."""
    keep = collectives.rank == 0 or not rank0_only
    gathered = _gathered_master(groups, collectives, keep)
    if not keep:
        return {}
    result = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in gathered:
            result[name] = gathered[id(tensor)]
        else:
            result[name] = tensor.detach().clone().cpu()
    # Model parallelism: the whole tensors from every tensor rank's slices, then every stage's.
    if tensor_slices:
        result = _whole_slices(module, result, tensor_slices, parallel, groups[0].device)
        if rank0_only and parallel.rank("tensor") != 0:
            return {}
    if pipeline is not None:
        result = _all_stages(result, parallel, rank0_only)
    return result


def _gathered_master(
    groups: list[FlatGroup], collectives: Collectives, keep: bool
) -> dict[int, torch.Tensor]:
    """{id(parameter): its whole fp32 master value, on the CPU} (empty unless `keep`), all-gathered
    over the data group one unit at a time. Collective."""
    gathered: dict[int, torch.Tensor] = {}
    for group in groups:
        layout = group.layout
        for unit in layout.units:
            full = torch.empty(unit.numel, dtype=torch.float32, device=group.device)
            piece = layout.shard_piece(group.master, unit).to(group.device)  # offloaded: from the host
            if layout.num_shards == 1:
                full.copy_(piece)
            else:
                collectives.all_gather(full, piece)
            if keep:
                for index in unit.slots:
                    slot = layout.slots[index]
                    gathered[id(group.params[index])] = layout.param_view(full, slot).clone().cpu()
    return gathered


def _whole_slices(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    tensor_slices: dict[str, TensorSlice],
    parallel: ParallelGroups,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """`state` with every cut parameter whole, from every tensor rank's slice (under one state-dict
    key each, tied ones too). Collective over the tensor group."""
    names = {id(p): name for name, p in module.named_parameters()}
    keys = {key: names.get(id(t)) for key, t in module.state_dict(keep_vars=True).items()}
    local = {name: state[key] for key, name in keys.items() if name is not None}
    whole = gather_tensor_slices(local, tensor_slices, parallel.tensor, device)
    return {key: whole.get(keys[key], value) for key, value in state.items()}


def _all_stages(
    state: dict[str, torch.Tensor], parallel: ParallelGroups, rank0_only: bool
) -> dict[str, torch.Tensor]:
    """Every pipeline stage's `state` merged (a tied embedding, on two stages, has the same value on
    both), on pipeline rank 0 only with `rank0_only` (the others get {}). Collective over the
    pipeline group."""
    group = parallel.pipeline
    stages = [{}] * parallel.dims.pipeline
    if rank0_only:
        first = dist.get_global_rank(group, 0)
        receiving = dist.get_rank() == first
        dist.gather_object(state, stages if receiving else None, dst=first, group=group)
        if not receiving:
            return {}
    else:
        dist.all_gather_object(stages, state, group=group)
    return {key: value for stage in stages for key, value in stage.items()}
