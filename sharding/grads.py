"""Gradient reduction during backward: hooks, per-unit readiness, asynchronous collectives.

[Note: gradient reduction]
A post-accumulate-grad hook on every sharded parameter counts down its unit. When the last
gradient of a unit has been accumulated, the unit's reduction is launched asynchronously
(`overlap_comm`), so it runs while autograd computes the remaining gradients:

    stage 0: all-reduce the unit's slice of the full gradient buffer, in place;
    stage 1: reduce-scatter it in place, so this rank's piece of the buffer holds the mean (the
             rest of the buffer is zeroed);
    stages 2-3: copy the unit's gradients into a bucket, free them, reduce-scatter the bucket
             into a piece that is added to this rank's gradient shard (so micro-steps accumulate;
             with the optimizer offloaded the shard is in host memory, see [Note: offload]).

Each rank divides its gradients by the world size before the reduction, as DeepSpeed's ZeRO and
DDP do, so the reduction sums means: a sum of 16-bit gradients over the ranks can overflow fp16
where none of them does, and then fp16's loss scale would settle up to the world size lower than
DeepSpeed's (more of the small gradients underflowing in backward). Dividing by a power of two is
exact, so at such world sizes fp32 and bf16 sums come out bit for bit as dividing after would.
Stage 1 keeps the mean in its piece of the full buffer, which a second backward before the step
accumulates into again: there each unit's piece is first multiplied back into this rank's share of
the sum (`_share_of_sum`), so that the next reduction adds exactly the new gradients of every rank.
That happens at the unit's first gradient of that backward, in the post-accumulate hook, which runs
only where autograd accumulates (`torch.autograd.grad` runs the tensor hooks too, and accumulates
nothing): the tensor hook hands autograd no destination for such a unit, and the post-accumulate
hook adds the fresh gradient in.

A callback queued on
autograd's engine runs when backward ends: it reduces the units that never completed (parameters
unused in this step, whose gradients count as zero), in unit order, identically on every rank, and
waits for every collective. Under `no_sync` stages 0-1 skip all of this and let gradients accumulate
locally; stages 2-3 keep reducing, since they do not keep full gradients.

[Note: gradients are the engine's]
Between backward passes every parameter's `.grad` is a `GradientPlaceholder` (flat_group.py): the
true gradient is a mean in a stage 1 piece, a shard in stages 2-3, loss-scaled with fp16, so code that
reads `param.grad` (`torch.nn.utils.clip_grad_norm_` returned 0.0 in stages 2-3) would be silently
wrong; the placeholder answers metadata (shape, device, storage) but refuses every operation on
values, naming `engine.clip_grad_norm_`. A tensor
pre-hook puts the real destination back just before autograd accumulates (the stage 0-1 view of the
full gradient buffer, else None), so accumulation across micro-steps is unchanged.

[Note: engine lifetime]
A hook lives as long as the tensor or module it is registered on, which the user may keep (the
model, the optimizer, a loss tensor). Post-accumulate-grad hooks are worse: they are held from C++
autograd metadata, where the garbage collector cannot see them, so a hook holding a bound method of
the reducer made parameter -> hook -> reducer -> groups -> parameter a cycle gc never frees, and
every dropped engine leaked all its buffers. So no hook holds an engine part: each is a `WeakHook`
reaching its object through a weak reference (and plain integers), and the engine registers a
`weakref.finalize` that tears down its parts (waits for collectives in flight, removes hooks, frees
buffers, empties the user's optimizer) when it is collected or closed (`ZeroEngine.close`).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .collectives import Collectives
from .flat_group import FlatGroup, is_placeholder
from .partition import Unit

# Stages 2-3 hold a bucket (a unit's gradients, in the compute dtype) per reduction in flight. At most
# this many reduce buckets' worth of elements stay in flight (always at least the newest bucket,
# however large): enough to overlap communication with the next bucket's copy, never a pile of them.
BUCKETS_IN_FLIGHT = 2


class WeakHook:
    """A hook calling `method(*args, *hook_args)` through a weak reference to the method's object, so
    that registering it keeps nothing of the engine alive (see [Note: engine lifetime]). `args` are
    plain values (indices), never engine objects. Once the object is gone the hook does nothing."""

    def __init__(self, method: Callable[..., Any], *args: int):
        self._method = weakref.WeakMethod(method)
        self._args = args

    def __call__(self, *hook_args: Any) -> Any:
        method = self._method()
        return None if method is None else method(*self._args, *hook_args)


@dataclass
class _InFlight:
    handle: object
    finish: Callable[[], None]
    numel: int = 0  # the bucket's elements (stages 2-3), kept alive until the collective completes


class GradientReducer:
    def __init__(
        self,
        groups: list[FlatGroup],
        stage: int,
        collectives: Collectives,
        overlap_comm: bool,
        reduce_bucket_size: int,
        on_unit_reduced: Callable[[FlatGroup, Unit], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
    ):
        self.groups = groups
        self.stage = stage
        self.collectives = collectives
        self.overlap_comm = overlap_comm
        self.max_in_flight_numel = BUCKETS_IN_FLIGHT * reduce_bucket_size
        self.on_unit_reduced = on_unit_reduced
        self.on_backward_end = on_backward_end
        self.sync = True
        self.backward_passes: set[int] = set()  # autograd runs that produced gradients since the last step
        self._pending: dict[tuple[int, int], int] = {}
        self._reduced: set[tuple[int, int]] = set()
        self._in_flight: deque[_InFlight] = deque()
        self._backward_active = False
        # Stage 1 units whose pieces hold a reduction's means, and those of them a later backward
        # turned back into this rank's share of the sum (see [Note: gradient reduction]).
        self._means: set[tuple[int, int]] = set()
        self._summing: set[tuple[int, int]] = set()
        self._closed = False
        self._hooks = []
        for g, group in enumerate(groups):
            for index, param in enumerate(group.params):
                self._hooks.append(param.register_hook(WeakHook(self._before_accumulation, g, index)))
                self._hooks.append(
                    param.register_post_accumulate_grad_hook(WeakHook(self._on_gradient, g, index))
                )
        self._reset()

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Wait for the reductions in flight (a backward interrupted by an error), then unhook."""
        while self._in_flight:
            self._complete_oldest()
        self.remove_hooks()
        self._closed = True

    @property
    def reducing(self) -> bool:
        """Whether this backward reduces gradients (not a stage 0-1 `no_sync` micro-step)."""
        return self.sync or self.stage >= 2

    def _reset(self) -> None:
        self._pending = {
            (g, unit.index): len(unit.slots)
            for g, group in enumerate(self.groups)
            for unit in group.layout.units
        }
        self._reduced.clear()

    # ------------------------------------------------------------------ hooks
    def _before_accumulation(self, g: int, index: int, grad: torch.Tensor) -> None:
        """Just before autograd accumulates into parameter `index` of group `g`: swap its placeholder
        for the real destination (see [Note: gradients are the engine's])."""
        group = self.groups[g]
        param = group.params[index]
        if (g, group.layout.slots[index].unit) in self._means:
            param.grad = None  # a fresh gradient, which _on_gradient adds in (see [Note: gradient reduction])
        elif is_placeholder(param.grad):
            param.grad = group.grad_view(index) if self.stage <= 1 else None

    def _share_of_sum(self, g: int, unit: int) -> None:
        """Stage 1, before a unit whose piece holds a reduction's means takes new gradients or is reduced
        again: the piece back to this rank's share of the sum (mean * world), which the next reduction
        divides with the new gradients (see [Note: gradient reduction])."""
        if (g, unit) not in self._means:
            return
        self._means.discard((g, unit))
        self._summing.add((g, unit))
        group = self.groups[g]
        group.grad_piece(group.layout.units[unit]).mul_(self.collectives.world_size)

    def forget_reduced(self) -> None:
        """The gradients were zeroed: no piece holds a reduction's means any more."""
        self._means.clear()
        self._summing.clear()

    def _on_gradient(self, g: int, index: int, param: torch.Tensor) -> None:
        self.backward_passes.add(torch._C._current_graph_task_id())
        if not self._backward_active:
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        group = self.groups[g]
        unit = group.layout.slots[index].unit
        key = (g, unit)
        if self.stage <= 1:
            self._share_of_sum(g, unit)
            view = group.grad_view(index)
            if param.grad.data_ptr() != view.data_ptr():  # a fresh gradient: take it into the buffer
                if key in self._summing:
                    view.add_(param.grad)
                else:  # the gradient was set to None since
                    view.copy_(param.grad)
                param.grad = view
        if not self.reducing:
            return
        self._pending[key] -= 1
        if self._pending[key] == 0 and self.overlap_comm:
            self._reduce(g, group.layout.units[unit])

    def _finish_backward(self) -> None:
        if self._closed:  # closed while this backward ran (an error between its start and end)
            return
        if self.reducing:
            self._reduce_remaining()
        self._reset()
        self._backward_active = False
        for group in self.groups:
            group.hide_gradients()
        if self.on_backward_end is not None:
            self.on_backward_end()

    # ------------------------------------------------------------------ reductions
    def _reduce(self, g: int, unit: Unit) -> None:
        group = self.groups[g]
        self._reduced.add((g, unit.index))
        world = self.collectives.world_size
        layout = group.layout
        if self.stage == 0:
            full = layout.unit_view(group.full_grad, unit)
            _divide(full, world)
            handle = self.collectives.all_reduce(full, async_op=True)
            self._in_flight.append(_InFlight(handle, lambda: None))
        elif self.stage == 1:
            self._share_of_sum(g, unit.index)  # a unit this backward gave no gradient
            full = layout.unit_view(group.full_grad, unit)
            _divide(full, world)
            handle = self.collectives.reduce_scatter(group.grad_piece(unit), full, async_op=True)

            def keep_own_mean(full=full, unit=unit) -> None:
                # This rank's piece now holds the mean over ranks; the rest of the buffer still holds
                # this rank's unreduced gradients, which a later backward would add in again: zero it.
                start, end = unit.piece_range(group.shard_rank)
                full.narrow(0, 0, start).zero_()
                full.narrow(0, end, unit.numel - end).zero_()

            self._in_flight.append(_InFlight(handle, keep_own_mean))
        else:
            bucket = torch.empty(unit.numel, dtype=group.compute_dtype, device=group.device)
            used = 0
            for index in unit.slots:
                slot, param = layout.slots[index], group.params[index]
                target = bucket.narrow(0, slot.offset, slot.numel)
                if param.grad is None or is_placeholder(param.grad):  # unused in this step
                    target.zero_()
                elif world > 1 and param.grad.dtype == target.dtype:  # the division folded into the copy
                    torch.div(param.grad.reshape(-1), world, out=target)
                    param.grad = None
                else:
                    target.copy_(param.grad.reshape(-1))
                    _divide(target, world)
                    param.grad = None
                used = slot.offset + slot.numel
            bucket.narrow(0, used, unit.numel - used).zero_()
            reduced = torch.empty(unit.piece, dtype=group.compute_dtype, device=group.device)
            handle = self.collectives.reduce_scatter(reduced, bucket, async_op=True)

            def accumulate(bucket=bucket, reduced=reduced, unit=unit) -> None:
                del bucket  # kept alive until the collective has read it
                group.add_reduced_gradient(unit, reduced)

            self._in_flight.append(_InFlight(handle, accumulate, unit.numel))
            while len(self._in_flight) > 1 and self.in_flight_numel() > self.max_in_flight_numel:
                self._complete_oldest()
        if self.on_unit_reduced is not None:
            self.on_unit_reduced(group, unit)

    def in_flight_numel(self) -> int:
        """Elements of the stage 2-3 buckets whose reduce-scatter has not completed yet."""
        return sum(work.numel for work in self._in_flight)

    def _complete_oldest(self) -> None:
        work = self._in_flight.popleft()
        work.handle.wait()
        work.finish()

    def reduce_accumulated(self) -> None:
        """Stages 0-1: reduce now, outside any backward, the gradients that backwards under `no_sync`
        accumulated (a pipeline schedule's micro-batches, whose last backward this engine does not run):
        what the last backward would have done."""
        if self.stage >= 2:
            raise RuntimeError("reduce_accumulated is for stages 0-1; stages 2-3 reduce in every backward")
        self._reduce_remaining()  # every unit: no backward reduced any since the last reset
        self._reset()

    def _reduce_remaining(self) -> None:
        """Reduce every unit not reduced yet since the last reset, and wait for all of them."""
        for g, group in enumerate(self.groups):
            for unit in group.layout.units:
                if (g, unit.index) not in self._reduced:
                    self._reduce(g, unit)
        while self._in_flight:
            self._complete_oldest()
        for group in self.groups:
            group.settle_gradients()
        # Stage 1's pieces now hold means; recorded only now, since this backward accumulates into no
        # unit it reduced.
        self._summing.clear()
        if self.stage == 1 and self.collectives.world_size > 1:
            self._means = {
                (g, unit.index) for g, group in enumerate(self.groups) for unit in group.layout.units
            }

    def flush(self) -> None:
        """Reduce everything now (a backward that ran without hooks firing still ends consistently)."""
        if self._backward_active:
            self._finish_backward()


def _divide(gradients: torch.Tensor, world: int) -> None:
    """This rank's gradients divided by the world size before they are summed over it (see [Note:
    gradient reduction]). One rank's sum is its mean: dividing by 1 would be a pass over the unit's
    gradients for nothing (0.58 ms a unit for tnlg-1.3b on an H100)."""
    if world > 1:
        gradients.div_(world)
