"""Sharing evaluation work across the ranks of a process group (or doing all of it in one process).

Under ZeRO stage 3 every forward pass gathers parameters collectively, so every rank must run as
many as the others: `rank_share` pads a shorter share with a repeat of the first item, weighted 0.

[Note: evaluation by data rank]
A model under tensor slicing (or pipeline stages) is one replica spread over several ranks: the ranks
of one replica run each forward pass together, so they must all take the same examples. Work is
therefore split by data-parallel rank (`work_share(model)`: a ZeroEngine's data dimension, else the
whole process group), and results are combined over the data group only, once per replica; summing
over every rank would count each replica's share once per tensor (or pipeline) rank. The same split
is the training stream's (tnlg.run.loop cuts it by `data_parallel_rank`). A plain model cut by
`apply_tensor_parallel` (no engine, no layout) knows its tensor group only, not which replica that group
is: it is taken as the one replica when the group spans the process group, and refused otherwise.

[Note: one stream per replica]
The ranks of one replica must also agree on everything that decides the ids they feed the model: the
prompts, the settings, and each sampled token (a tensor-sliced embedding sums the rows every rank
looks up, so ranks embedding different ids give garbage, not an error). `replica_differs` compares
digests over the replica once per call, the same answer on each of its ranks, so that all raise and
none is left waiting; `replica_rng` makes the replica's ranks draw the replica's first rank's stream,
whatever each was seeded with (launchers seed seed + rank). That first rank draws from its own
generators, which advance as in one process; the others run on a forked copy of its state, so their
own generators are left as they were. Data-parallel replicas keep their own streams.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tnlg.modeling.tensor_parallel import tensor_group
from tnlg.sharding import ZeroEngine

T = TypeVar("T")


@dataclass(frozen=True)
class WorkShare:
    """This process's share of the work: share `index` of `count`, combined over `group` (None: the
    default process group). `replica`: the groups (tensor, then pipeline) that span this rank's model
    replica, whose ranks take the same work together; empty when the model is whole on every rank."""

    index: int
    count: int
    group: dist.ProcessGroup | None = None
    replica: tuple[dist.ProcessGroup, ...] = ()


def work_share(model: nn.Module | None = None) -> WorkShare:
    """How `model`'s evaluation work is split (see [Note: evaluation by data rank]): by the engine's
    data-parallel rank when it has a parallel layout, else by the rank in the process group. A plain
    model cut for tensor slicing over the whole process group is one replica: one share."""
    layout = model.parallel if isinstance(model, ZeroEngine) else None
    if layout is not None:
        dims = layout.dims
        replica = tuple(layout.group(d) for d in ("tensor", "pipeline") if getattr(dims, d) > 1)
        return WorkShare(layout.rank("data"), dims.data, layout.data, replica)
    rank, world = rank_and_world()
    group = _sliced_group(model)
    if group is None or dist.get_world_size(group) == 1:  # cut in one: whole on every rank
        return WorkShare(rank, world)
    if dist.get_world_size(group) != world:
        raise ValueError(
            f"this model is cut by apply_tensor_parallel over {dist.get_world_size(group)} of the {world} "
            "ranks: which replica a rank belongs to is not known, so the work cannot be shared; cut it over "
            "every rank, or build it with tnlg.sharding.initialize(..., parallel=ParallelDims(tensor=...)), "
            "whose layout names the data-parallel rank"
        )
    return WorkShare(0, 1, None, (group,))


def _sliced_group(model: nn.Module | None) -> dist.ProcessGroup | None:
    """The tensor group of a plain model (not an engine) cut by `apply_tensor_parallel`, else None."""
    if model is None or isinstance(model, ZeroEngine):
        return None
    return next((g for g in map(tensor_group, model.modules()) if g is not None), None)


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_slice(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """`[start, end)` of rank `rank`'s contiguous share of `count` items: shares differ by at most one,
    the larger ones first, so concatenating the shares in rank order restores the original order."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_share(items: Sequence[T], share: WorkShare | None = None) -> Iterator[tuple[T, float]]:
    """This rank's (item, weight 1.0) pairs, then (items[0], 0.0) up to the largest share's length;
    `share` defaults to the rank in the whole process group."""
    if not items:
        raise ValueError("nothing to share across the ranks")
    share = share or work_share()
    start, end = rank_slice(len(items), share.index, share.count)
    largest = math.ceil(len(items) / share.count)
    for index in range(largest):
        yield (items[start + index], 1.0) if start + index < end else (items[0], 0.0)


def all_ranks_sum(tensor: torch.Tensor, share: WorkShare | None = None) -> torch.Tensor:
    """The sum over the shares of `share` (default: every rank; the tensor itself with one share)."""
    share = share or work_share()
    if share.count > 1:
        tensor = tensor.to(collective_device(share.group))
        dist.all_reduce(tensor, group=share.group)
    return tensor.cpu()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where `group`'s collectives take their tensors: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replica_differs(replica: Sequence[dist.ProcessGroup], digests: torch.Tensor) -> list[bool]:
    """For each of this rank's int64 `digests`: whether it differs anywhere in the replica; the same answer
    on every rank of it. Collective over each group of `replica`. [Note: one stream per replica]"""
    own = digests.to(torch.int64)
    differs = torch.zeros_like(own)
    for group in replica:  # each group's answer travels on through the next (tensor, then pipeline)
        mine = torch.cat([own, differs]).to(collective_device(group))
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        rows = torch.stack(gathered).cpu()  # (ranks, 2 * digests): their digests, then what they found
        found = rows[:, own.numel() :].any(0) | (rows[:, : own.numel()] != rows[0, : own.numel()]).any(0)
        differs = found.to(torch.int64)
    return differs.bool().tolist()


@contextlib.contextmanager
def replica_rng(replica: Sequence[dist.ProcessGroup], device: torch.device) -> Iterator[None]:
    """Run the body with the default generators of the CPU and of `device` (a CUDA one) in the replica's
    first rank's state on every rank of the replica. Collective. [Note: one stream per replica]"""
    if not replica:
        yield
        return
    states = _rng_states(device)
    shared = torch.cat(states)
    for group in replica:  # from the first rank of each: the replica's first rank's state reaches all
        shared = shared.to(collective_device(group))
        dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group)
    if all(dist.get_rank(group) == 0 for group in replica):
        yield  # the first rank's own generators advance, as one process's would
        return
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):  # restores this rank's own after
        cpu_state, *cuda_state = shared.cpu().split([state.numel() for state in states])
        torch.set_rng_state(cpu_state)
        if cuda:
            torch.cuda.set_rng_state(cuda_state[0], device)
        yield


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The default CPU generator's state, and `device`'s when it is a GPU (what sampling there draws)."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def model_device(model: nn.Module) -> torch.device:
    """Where a model (or the module inside a ZeRO engine / peft wrapper) computes."""
    inner = getattr(model, "module", model)
    return inner.device if hasattr(inner, "device") else next(inner.parameters()).device
