"""Sharing evaluation work across the ranks of a process group (or doing all of it in one process).

Under ZeRO stage 3 every forward pass gathers parameters collectively, so every rank must run as
many as the others: `rank_share` pads a shorter share with a repeat of the first item, weighted 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


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


def rank_share(items: Sequence[T]) -> Iterator[tuple[T, float]]:
    """This rank's (item, weight 1.0) pairs, then (items[0], 0.0) up to the largest share's length."""
    if not items:
        raise ValueError("nothing to share across the ranks")
    rank, world = rank_and_world()
    start, end = rank_slice(len(items), rank, world)
    largest = math.ceil(len(items) / world)
    for index in range(largest):
        yield (items[start + index], 1.0) if start + index < end else (items[0], 0.0)


def all_ranks_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks (the tensor itself without a process group)."""
    if rank_and_world()[1] > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tensor = tensor.to(device)
        dist.all_reduce(tensor)
    return tensor.cpu()


def model_device(model: nn.Module) -> torch.device:
    """Where a model (or the module inside a ZeRO engine / peft wrapper) computes."""
    inner = getattr(model, "module", model)
    return inner.device if hasattr(inner, "device") else next(inner.parameters()).device
