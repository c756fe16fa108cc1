"""Stateless collectives over flat buffers, with byte accounting per collective kind.

Every collective the engine issues goes through `Collectives`, which picks the torch API that
exists (`all_gather_single` / `reduce_scatter_single` from torch 2.13, `all_gather_into_tensor` /
`reduce_scatter_tensor` before) and records calls and payload bytes: the output of an all-gather,
the input of a reduce-scatter, the tensor of an all-reduce or broadcast.

With no initialised process group (or a group of one) every collective is a local no-op, so the
engine runs unchanged in a single process.

[Note: gather group]
On NCCL a process group is one stream: collectives on it run one after another. Stage 3's backward
prefetch (an all-gather of the block before) would queue behind the gradient reduce-scatters already
issued, so the parameter arrives only once the reductions ahead of it are done. A training stage 3
engine therefore opens a second group with the same ranks (`open_gather_group`) and runs every
all-gather on it: the block gathers and prefetches, the post-step gathers of persistent units (the
same `FlatGroup.gather`) and `full_state_dict`'s (nothing is in flight then; one rule is simpler).
Reductions, broadcasts and object gathers stay on the engine's group. Stages 0-2 all-gather only after
the step, when no reduction is in flight, and a second NCCL communicator costs device memory, so they
keep one group. The group is destroyed at engine teardown (`close`, see [Note: engine lifetime] in
grads.py). `dist.new_group` must be entered by every rank of the world in the same order, which an
engine over a sub-group of the world cannot promise: such an engine keeps one group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .timeouts import world_timeout

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveCount:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Calls and payload bytes per collective kind since the last reset."""

    counts: dict[str, CollectiveCount] = field(default_factory=dict)

    def record(self, kind: str, nbytes: int) -> None:
        count = self.counts.setdefault(kind, CollectiveCount())
        count.calls += 1
        count.bytes += nbytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": c.calls, "bytes": c.bytes} for kind, c in sorted(self.counts.items())}

    def reset(self) -> None:
        self.counts.clear()


class _Done:
    """The handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Collectives:
    """The engine's collectives on one process group (default: the world); all-gathers on
    `gather_group`, the same group unless `open_gather_group` made a second (see [Note: gather group])."""

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.gather_group = group
        self.owns_gather_group = False
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.stats = stats if stats is not None else CommStats()

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def open_gather_group(self) -> None:
        """A second group with this group's ranks for the all-gathers, when there is more than one rank and
        the group spans the world. Collective over the world: every rank calls it at the same point."""
        if not self.active or self.owns_gather_group or self.world_size != dist.get_world_size():
            return
        backend = dist.get_backend(self.group) if self.group is not None else None  # None: the world's
        self.gather_group = dist.new_group(
            list(range(self.world_size)), backend=backend, timeout=world_timeout()
        )  # the world's timeout: [Note: group timeouts] in timeouts.py
        self.owns_gather_group = True

    def close(self) -> None:
        """Destroy the gather group this object opened; idempotent. Gathers then use the engine's group."""
        if not self.owns_gather_group:
            return
        group, self.gather_group, self.owns_gather_group = self.gather_group, self.group, False
        if not dist.is_initialized():
            return  # destroy_process_group() of the world destroyed every group, this one too
        # ValueError: the world was destroyed and initialised again since, which took this group with it.
        with contextlib.suppress(ValueError):
            dist.destroy_process_group(group)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """`output` (world_size * shard.numel()) ← every rank's `shard`; in place when `shard` is a view of it."""
        if not self.active:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return _Done() if async_op else None
        self.stats.record("all_gather", output.numel() * output.element_size())
        return _all_gather(output, shard, group=self.gather_group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """`output` ← this rank's 1/world_size piece of the sum of every rank's `full`."""
        if not self.active:
            if output.data_ptr() != full.data_ptr():
                output.copy_(full)
            return _Done() if async_op else None
        self.stats.record("reduce_scatter", full.numel() * full.element_size())
        return _reduce_scatter(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
        if not self.active:
            return _Done() if async_op else None
        self.stats.record("all_reduce", tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        """From `src_rank` of this group (a group rank, translated to the global rank torch wants)."""
        if not self.active:
            return
        self.stats.record("broadcast", tensor.numel() * tensor.element_size())
        source = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
        dist.broadcast(tensor, src=source, group=self.group)

    def all_gather_object(self, obj: object) -> list[object]:
        """Small Python objects from every rank (validation and metadata; not counted as traffic)."""
        if not self.active:
            return [obj]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered
