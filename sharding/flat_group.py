"""`FlatGroup`: the buffers of one optimizer param group, and the parameter views into them.

Which buffers exist is the stage's policy (see [Note: flat layout] in partition.py):

    stage   16-bit params            gradients                       fp32 master (+ optimizer state)
    0       full, persistent         full, persistent (param.grad)   full (num_shards = 1)
    1       full, persistent         full, persistent (param.grad)   this rank's shard
    2       full, persistent         this rank's shard only          this rank's shard
    3       this rank's shard; a     this rank's shard only          this rank's shard
            unit's full buffer only
            while it is gathered

"16-bit" is the compute dtype: fp32 when mixed precision is off. Parameters are views into their
unit's full buffer. With CPU offload the master, the optimizer state, the stage 2-3 gradient shard
and (`offload_param`) stage 3's 16-bit shard live in host memory instead (see [Note: offload]). In stage 3 a released unit keeps its buffer object with a zero-byte storage,
so the views (and tensors autograd saved from them) see the data again once it is re-gathered.
In stages 0-1 autograd accumulates straight into views of the full gradient buffer, which a hook
makes each parameter's `.grad` during backward; between backward passes `.grad` is a placeholder
(see [Note: gradients are the engine's] in grads.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .collectives import Collectives
from .offload import GradientsToHost, Placement, StagedGather, to_device
from .partition import FlatLayout, Unit
from .plan import GroupPlan

# What a placeholder answers: its metadata (memory accounting, shape checks, `.device` grouping, and
# what torch.compile reads to fake a parameter with its .grad: whether it is a view (it is not), its
# conj/neg bits, the grad's own grad). Anything that would read or write values raises.
_PLACEHOLDER_METADATA = frozenset(
    {
        "shape", "dtype", "device", "layout", "ndim", "names", "is_cuda", "is_cpu", "is_meta",
        "is_sparse", "is_quantized", "is_leaf", "requires_grad", "grad_fn", "size", "dim", "numel",
        "nelement", "stride", "storage_offset", "element_size", "untyped_storage", "data_ptr",
        "is_contiguous", "is_pinned", "is_floating_point", "is_complex", "__len__",
        "_is_view", "grad", "is_conj", "is_neg", "is_inference", "is_mkldnn", "is_nested", "_is_zerotensor",
    }
)  # fmt: skip


class GradientPlaceholder(torch.Tensor):
    """What `param.grad` holds between backward passes (see [Note: gradients are the engine's] in
    grads.py): a zero-stride view of one element, of the parameter's shape, that answers metadata
    queries but refuses every operation on values, so that nothing computes silently on it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property (.device, .shape, ...): name the property
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _PLACEHOLDER_METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            f"{name} on the .grad of a parameter trained by the ZeRO engine: the engine keeps gradients in "
            "its own buffers (sharded across ranks, loss-scaled with fp16), so param.grad is a placeholder "
            "and torch.nn.utils.clip_grad_norm_ or any code reading it would get a wrong value. Use "
            "engine.clip_grad_norm_(max_norm) (Accelerator.clip_grad_norm_ calls it) or "
            "ZeroConfig.gradient_clipping to clip, engine.get_global_grad_norm() for the last step's norm"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"GradientPlaceholder(shape={tuple(self.shape)}: the gradient is kept by the ZeRO engine)"


def is_placeholder(grad: torch.Tensor | None) -> bool:
    return type(grad) is GradientPlaceholder


class FlatGroup:
    def __init__(
        self,
        plan: GroupPlan,
        stage: int,
        compute_dtype: torch.dtype,
        placement: Placement,
        collectives: Collectives,
        alignment: int = 1,
        trainable: bool = True,
    ):
        self.index = plan.index
        self.trainable = trainable  # False: an inference-only engine, which needs no gradient buffers
        self.params: list[nn.Parameter] = plan.params
        self.stage = stage
        self.collectives = collectives
        num_shards = collectives.world_size if stage >= 1 else 1
        self.shard_rank = collectives.rank if stage >= 1 else 0
        self.layout = FlatLayout(
            plan.names, [tuple(p.shape) for p in plan.params], plan.units, num_shards, alignment
        )
        self.unit_blocks = plan.unit_blocks  # stage 3: the block each unit belongs to (None: persistent)
        self.persistent = (
            [block is None for block in plan.unit_blocks] if stage == 3 else [True] * len(plan.units)
        )
        self.compute_dtype = compute_dtype
        self.placement = placement
        self.device = placement.device  # where the model computes
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        # Stage 0-1 with the optimizer on the host: the pinned buffer step_gradient copies the gradient
        # into, kept across steps (pinning at exact size is a costly host call, not for every step).
        self.host_step_grad: torch.Tensor | None = None
        self.unit_full: list[torch.Tensor] = []
        self.param_views: list[torch.Tensor | None] = []  # until finish(): each parameter's view
        self.placeholders: list[GradientPlaceholder] = []  # each parameter's .grad between backwards
        # Stages 0-1: each parameter's view of `full_grad`, made once. Both of backward's hooks on each
        # parameter read it (grads.py); making the view in each cost three tensor ops a time, host time a
        # step waits for wherever the host, not the device, sets the pace.
        self.grad_views: list[torch.Tensor] = []
        if self.placement.optimizer_on_host:
            self.master = self.placement.host_zeros(self.layout.shard_numel, torch.float32, transfer=False)
        else:
            self.master = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.device)
        # Stages 2-3 with the optimizer offloaded: reduced pieces on their way into the host shard.
        self.gradients_to_host = (
            GradientsToHost(self.placement) if self.placement.optimizer_on_host and stage >= 2 else None
        )

    # ------------------------------------------------------------------ construction
    def build_from_params(self) -> None:
        """Copy the parameters' current values in, then make the parameters views of the buffers."""
        self.allocate()
        for index, param in enumerate(self.params):
            self.load_slot(index, param.detach())
        self.finish()

    def allocate(self) -> None:
        """The full buffers and every parameter's view into them. In stage 3 a unit that is not
        persistent is released as soon as its views exist, one unit at a time, so building the
        engine never holds more than one such unit in full (views need storage when they are made,
        and keep seeing the buffer's data after it is re-gathered)."""
        layout, dtype = self.layout, self.compute_dtype
        if self.stage < 3:
            self.full = torch.zeros(layout.full_numel, dtype=dtype, device=self.device)
            self.unit_full = [layout.unit_view(self.full, unit) for unit in layout.units]
        else:
            self.unit_full = []
        self.param_views = [None] * len(layout.slots)
        for unit in layout.units:
            if self.stage == 3:
                make = torch.zeros if self.persistent[unit.index] else torch.empty
                self.unit_full.append(make(unit.numel, dtype=dtype, device=self.device))
            for index in unit.slots:
                self.param_views[index] = layout.param_view(self.unit_full[unit.index], layout.slots[index])
            if self.stage == 3 and not self.persistent[unit.index]:
                self.release(unit)

    def keeps_full(self, index: int) -> bool:
        """Whether this rank holds parameter `index` in full outside a gather (stages 0-2, persistent units)."""
        return self.stage < 3 or self.persistent[self.layout.slots[index].unit]

    def load_slot(self, index: int, value: torch.Tensor) -> None:
        """Take parameter `index`'s full value: this rank's part into the fp32 master (before any cast
        to 16 bits), and the whole of it where this rank keeps the full parameter. Also after finish()
        (a `load_state_dict` into the module: see [Note: module loads] in module_loads.py)."""
        layout = self.layout
        slot = layout.slots[index]
        owned = layout.owned_range(slot, self.shard_rank)
        if owned is not None:
            start, end, at = owned
            self.master[at : at + end - start].copy_(value.reshape(-1)[start:end])
        if self.keeps_full(index):
            # Until finish() the views are apart from the parameters; after it the parameters are the views.
            view = self.param_views[index] if self.param_views else self.params[index]
            view.copy_(value)

    def load_owned(self, index: int, owned_value: torch.Tensor) -> None:
        """Take only this rank's part of parameter `index` (flattened, the `owned_range` of its slot),
        for a parameter it does not keep in full: what a stage 3 rank needs from a checkpoint."""
        if self.keeps_full(index):
            raise ValueError(
                f"{self.layout.slots[index].name} is kept in full here: load_slot needs its whole value"
            )
        owned = self.layout.owned_range(self.layout.slots[index], self.shard_rank)
        if owned is None:
            return
        start, end, at = owned
        self.master[at : at + end - start].copy_(owned_value.reshape(-1))

    def finish(self) -> None:
        """Stage 3's 16-bit shard from the master, parameters pointed at the buffers, gradients allocated."""
        if self.stage == 3:
            if self.placement.params_on_host:
                self.shard = self.placement.host_empty(self.layout.shard_numel, self.compute_dtype)
                self.shard.copy_(self.master)
            else:
                self.shard = self.master.to(device=self.device, dtype=self.compute_dtype, copy=True)
        self._point_params_at_buffers()
        self.param_views = []  # the parameters are the views now
        if self.trainable:
            self._allocate_gradients()

    def _point_params_at_buffers(self) -> None:
        for view, param in zip(self.param_views, self.params, strict=True):
            if param.device != view.device or param.is_meta:
                # `.data` cannot change a meta parameter's device: swap in an empty real tensor first.
                # (Swapping in the view itself would share the buffer's version counter, and every
                # all-gather into the buffer would then invalidate what autograd saved.)
                placeholder = torch.empty(0, dtype=view.dtype, device=view.device)
                torch.utils.swap_tensors(param, nn.Parameter(placeholder, requires_grad=param.requires_grad))
            param.data = view

    def _allocate_gradients(self) -> None:
        # One element per placeholder, every stride 0: the parameter's shape at the cost of one element.
        # Made a subclass instance outright, not a view of a plain tensor (expand, as_subclass): a view's
        # `_base`, which torch.compile reads, would hand out a plain tensor to read and write through.
        self.placeholders = [
            torch.Tensor._make_subclass(
                GradientPlaceholder,
                torch.empty_strided(
                    param.shape, (0,) * param.dim(), dtype=self.compute_dtype, device=self.device
                ).zero_(),
                False,
            )
            for param in self.params
        ]
        self.hide_gradients()
        if self.stage <= 1:
            self.full_grad = torch.zeros(self.layout.full_numel, dtype=self.compute_dtype, device=self.device)
            units = [self.layout.unit_view(self.full_grad, unit) for unit in self.layout.units]
            self.grad_views = [self.layout.param_view(units[slot.unit], slot) for slot in self.layout.slots]
        elif self.placement.optimizer_on_host:
            # fp32 on the host: micro-steps accumulate there without 16-bit rounding, as DeepSpeed's offload
            self.shard_grad = self.placement.host_zeros(
                self.layout.shard_numel, torch.float32, transfer=False
            )
        else:
            self.shard_grad = torch.zeros(
                self.layout.shard_numel, dtype=self.compute_dtype, device=self.device
            )

    # ------------------------------------------------------------------ views
    def grad_view(self, index: int) -> torch.Tensor:
        """Stages 0-1: parameter `index`'s gradient, a view of the persistent full gradient buffer."""
        return self.grad_views[index]

    def grad_piece(self, unit: Unit) -> torch.Tensor:
        """This rank's reduced gradient piece of `unit` (what the optimizer step consumes)."""
        if self.stage <= 1:
            return self.layout.piece_view(self.full_grad, unit, self.shard_rank)
        return self.layout.shard_piece(self.shard_grad, unit)

    def owned_gradient(self, index: int) -> torch.Tensor | None:
        """This rank's reduced gradient of the part of parameter `index` it owns (a view; None if it owns
        none of it): in the stage 2-3 shard, or in this rank's piece of the stage 0-1 full buffer."""
        slot = self.layout.slots[index]
        owned = self.layout.owned_range(slot, self.shard_rank)
        if owned is None:
            return None
        start, end, at = owned
        if self.shard_grad is not None:
            return self.shard_grad.narrow(0, at, end - start)
        unit = self.layout.units[slot.unit]
        return self.full_grad.narrow(0, unit.full_offset + slot.offset + start, end - start)

    def grad_pieces(self) -> list[torch.Tensor]:
        return [self.grad_piece(unit) for unit in self.layout.units]

    def grad_tensors(self) -> list[torch.Tensor]:
        """This rank's gradient pieces in as few tensors as possible, for a reduction over all of them
        (one kernel instead of one per unit): the pieces tile the stage 2-3 shard and, with one shard,
        the full buffer (padding included, which stays zero); stage 1's lie apart in its full buffer."""
        if self.shard_grad is not None:
            return [self.shard_grad]
        if self.layout.num_shards == 1:
            return [self.full_grad]
        return self.grad_pieces()

    def add_reduced_gradient(self, unit: Unit, reduced: torch.Tensor) -> None:
        """Stages 2-3: this rank's shard piece of `unit` += `reduced` (a completed reduction's means)."""
        piece = self.grad_piece(unit)
        if self.gradients_to_host is not None:
            self.gradients_to_host.add(piece, reduced)
        else:
            piece.add_(reduced)

    def settle_gradients(self) -> None:
        """Finish moving reduced gradients into the host shard (offload; backward's end)."""
        if self.gradients_to_host is not None:
            self.gradients_to_host.settle()

    def step_gradient(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's gradient shard (unscaled means over the ranks) as one tensor in the shard layout,
        next to the master: the gradient shard itself where it already is one (stages 2-3, `dtype`
        None or its own), else a new tensor (`dtype`, default the compute dtype) the pieces are
        copied into, from the device to the host when the optimizer is offloaded."""
        grad = self.shard_grad
        if self.layout.num_shards == 1 and self.full_grad is not None:
            grad = self.full_grad  # stage 0: one shard, so the full gradient is in the shard layout
        if grad is not None and grad.device == self.master.device and dtype in (None, grad.dtype):
            return grad
        dtype = dtype or (grad.dtype if grad is not None else self.compute_dtype)
        if self.placement.optimizer_on_host:
            if self.host_step_grad is None or self.host_step_grad.dtype != dtype:
                self.host_step_grad = self.placement.host_empty(self.layout.shard_numel, dtype)
            target = self.host_step_grad
        else:
            target = torch.empty(self.layout.shard_numel, dtype=dtype, device=self.master.device)
        for unit, piece in zip(self.layout.units, self.grad_pieces(), strict=True):
            self.layout.shard_piece(target, unit).copy_(piece, non_blocking=target.is_pinned())
        if target.is_pinned():
            torch.cuda.current_stream(self.device).synchronize()  # the host reads it next
        return target

    # ------------------------------------------------------------------ stage 3 gather / release
    def is_gathered(self, unit: Unit) -> bool:
        return self.unit_full[unit.index].untyped_storage().nbytes() > 0

    def gather(self, unit: Unit, async_op: bool = False):
        buffer = self.unit_full[unit.index]
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        piece = self.layout.shard_piece(self.shard, unit)
        if not self.placement.params_on_host:
            return self.collectives.all_gather(buffer, piece, async_op=async_op)
        staged = to_device(piece, self.device)  # offload_param: this rank's piece, just in time
        handle = self.collectives.all_gather(buffer, staged, async_op=async_op)
        return StagedGather(handle, staged) if async_op else handle

    def release(self, unit: Unit) -> None:
        self.unit_full[unit.index].untyped_storage().resize_(0)

    # ------------------------------------------------------------------ after the optimizer step
    def write_back(self, updated: torch.Tensor | None = None) -> None:
        """The updated shard → the 16-bit parameters every rank computes with. `updated` holds the new
        values in the shard layout: the fp32 master (default), or the 16-bit copy an offloaded step
        wrote on the host (which may be stage 3's host shard itself)."""
        layout = self.layout
        updated = self.master if updated is None else updated
        asynchronous = updated.is_pinned()  # host → device, ordered before the all-gathers below
        if self.stage == 0:
            if updated is not self.full:
                self.full.copy_(updated)  # one shard: the shard layout is the full layout
            return
        handles = []
        if self.stage < 3:
            for unit in layout.units:
                piece = layout.piece_view(self.full, unit, self.shard_rank)
                piece.copy_(layout.shard_piece(updated, unit), non_blocking=asynchronous)
                handles.append(
                    self.collectives.all_gather(layout.unit_view(self.full, unit), piece, async_op=True)
                )
        else:
            if updated is not self.shard:
                self.shard.copy_(updated, non_blocking=asynchronous and not self.shard.is_pinned())
            for unit in layout.units:
                if self.persistent[unit.index]:
                    handles.append(self.gather(unit, async_op=True))
        for handle in handles:
            handle.wait()

    def zero_grad(self) -> None:
        if self.full_grad is not None:
            self.full_grad.zero_()
        if self.shard_grad is not None:
            self.shard_grad.zero_()
        self.hide_gradients()

    def hide_gradients(self) -> None:
        """Every parameter's `.grad` becomes its placeholder (see [Note: gradients are the engine's])."""
        if not self.placeholders:  # inference only (no gradients at all), or closed
            return
        for param, placeholder in zip(self.params, self.placeholders, strict=True):
            param.grad = placeholder

    def close(self) -> None:
        """Free the group's buffers (see [Note: engine lifetime] in grads.py): gradients, the master, stage
        3's shard. The parameters keep the storage they view, which the module alone now owns: stages
        0-2 (and stage 3's persistent units) their full 16-bit values; stage 3's other units nothing."""
        if self.gradients_to_host is not None:
            self.gradients_to_host.discard()
        for param in self.params:
            param.grad = None
        self.placeholders = []
        self.grad_views = []
        self.full = self.shard = self.full_grad = self.shard_grad = self.master = self.host_step_grad = None
        self.unit_full = []

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict[str, int]:
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        params = (
            size(self.full) if self.stage < 3 else size(self.shard) + sum(size(b) for b in self.unit_full)
        )
        grads = size(self.full_grad) + size(self.shard_grad) + size(self.host_step_grad)
        return {"params": params, "grads": grads, "master": size(self.master)}  # all 0 once closed

    def host_tensors(self) -> list[torch.Tensor]:
        """The buffers offload keeps in host memory (see [Note: offload]), including gradients in transit."""
        tensors = []
        if self.placement.optimizer_on_host and self.master is not None:  # None: closed
            tensors.append(self.master)
            if self.shard_grad is not None:
                tensors.append(self.shard_grad)
            if self.host_step_grad is not None:
                tensors.append(self.host_step_grad)
        if self.placement.params_on_host and self.shard is not None:
            tensors.append(self.shard)
        if self.gradients_to_host is not None:
            tensors += self.gradients_to_host.staging()
        return tensors
