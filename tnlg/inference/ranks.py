"""Sharing evaluation work across the ranks of a process group (or doing all of it in one process).

Under ZeRO stage 3 every forward pass gathers parameters collectively, so every rank must run as
many as the others: `rank_share` pads a shorter share with a repeat of the first item, weighted 0.

[Note: evaluation by data rank]
A model under tensor slicing (or pipeline stages) is one replica spread over several ranks: the ranks
of one replica run each forward pass together, so they must all take the same examples. Work is
therefore split by data-parallel rank (`work_share(model)`: a ZeroEngine's data dimension, else the
whole process group), and results are combined over the data group only, once per replica; summing
over every rank would count each replica's share once per tensor (or pipeline) rank. The same split
is the training stream's (tnlg.run.loop cuts it by `data_parallel_rank`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tnlg.sharding import ZeroEngine

T = TypeVar("T")


@dataclass(frozen=True)
class WorkShare:
    """This process's share of the work: share `index` of `count`, combined over `group` (None: the
    default process group)."""

    index: int
    count: int
    group: dist.ProcessGroup | None = None


def work_share(model: nn.Module | None = None) -> WorkShare:
    """How `model`'s evaluation work is split (see [Note: evaluation by data rank]): by the engine's
    data-parallel rank when it has a parallel layout, else by the rank in the process group."""
    layout = model.parallel if isinstance(model, ZeroEngine) else None
    if layout is not None:
        return WorkShare(layout.rank("data"), layout.dims.data, layout.data)
    rank, world = rank_and_world()
    return WorkShare(rank, world)


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
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tensor = tensor.to(device)
        dist.all_reduce(tensor, group=share.group)
    return tensor.cpu()


def model_device(model: nn.Module) -> torch.device:
    """Where a model (or the module inside a ZeRO engine / peft wrapper) computes."""
    inner = getattr(model, "module", model)
    return inner.device if hasattr(inner, "device") else next(inner.parameters()).device
