"""The sharded optimizer step: global norm, overflow skip, clipping, update of this rank's shard.

The user's optimizer is rebuilt *in place* over this rank's fp32 master shards, one per param
group: its class, every group's hyperparameters (weight decay, betas, lr, ...) and the group
dicts themselves stay, so a learning-rate scheduler built on it before or after `initialize` keeps
turning `param_groups[i]["lr"]`. Only its state is reset (it described the unsharded parameters).

Element-wise optimizers (SGD, Adam, AdamW, ...) compute exactly what they would unsharded.
Optimizers that reduce over whole tensors (LAMB's trust ratio, Adafactor's factored moments) see
shards instead and are not equivalent, as in every ZeRO implementation.

With the optimizer offloaded (see [Note: offload]) the master shards are host tensors. Adam and
AdamW then step through `CPUAdam` over the same param groups and state, which also writes the
16-bit copy that goes back to the device; other optimizers step the host tensors themselves.
On the device, Adam and AdamW step through a fused kernel (`ZeroConfig.fused_adam`; by default on
CUDA): one launch per param group reads the 16-bit gradient shard as it is, scaled as it reads it,
and in stages 0 and 3 writes the 16-bit parameters straight into the buffer they are gathered from.
Either way the user's optimizer keeps torch's state, and its `step()` still runs, with no
gradients, so that its hooks and a learning-rate scheduler see the step.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .collectives import Collectives
from .flat_group import FlatGroup
from .grads import WeakHook
from .kernels.fused_adam import fused_adam_group, steps_like_adam
from .loss_scaler import LossScaler
from .offload import host_adam_for, host_adam_step

logger = logging.getLogger(__name__)

# [Note: gradient norm precision]
# One fp32 reduction over a whole gradient piece loses accuracy with its length: on CPU,
# `torch._foreach_norm` of 16M elements was off by 6e-4 (relative), of 64M by 5e-3. Rows of NORM_ROW
# elements are each reduced in fp32 and the rows' squares summed in fp64. At 64M elements the norm is
# then off by 1e-10 (fp32; 1e-8 for bf16, 3e-8 for fp16 gradients), in 5 ms instead of 9 (fp32; 14 ms
# instead of 88 for bf16); an fp64 reduction is ~15x slower on CPU. Rows longer than 256 elements let
# torch's fp32 row norm drift by up to 1e-6 on 16-bit values.
# Where the 16-bit values are widened differs by device. A CPU reduction with an fp32 `dtype` first
# casts a copy of its whole input, so there 16-bit gradients are widened NORM_BLOCK elements at a
# time and no fp32 copy of a whole shard is ever made. A CUDA reduction reads bf16/fp16 and
# accumulates in fp32 inside the kernel (torch's reduction path for low-precision inputs with a float
# result), so on CUDA each piece is one row-norm kernel plus a few over its 1/256-long result: a
# blocked walk there launched ~1,900 small kernels per step for 1.3B parameters.
NORM_ROW = 256
NORM_BLOCK = 1 << 22


def squared_norm(tensor: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The sum of squares of `tensor`'s elements, as a float64 scalar on its device (see
    [Note: gradient norm precision]); non-finite when any element is. `block` (elements widened at a
    time) defaults to NORM_BLOCK on the CPU and the whole tensor on CUDA."""
    flat = tensor.reshape(-1)
    if block is None:
        block = flat.numel() if flat.is_cuda else NORM_BLOCK
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for piece in flat.split(max(block, 1)):
        _add_squares_in_rows(total, piece)
    return total


def _add_squares_in_rows(total: torch.Tensor, values: torch.Tensor) -> None:
    """total += Σ x² over `values`, reduced in NORM_ROW-element fp32 rows whose squares sum in fp64."""
    if values.device.type == "cpu":
        values = values.float()  # the blocked copy (fp32 stays as it is): see the note
    whole = values.numel() - values.numel() % NORM_ROW
    if whole:
        rows = torch.linalg.vector_norm(values[:whole].view(-1, NORM_ROW), 2, dim=1, dtype=torch.float32)
        total += rows.double().square().sum()
    if whole < values.numel():
        total += torch.linalg.vector_norm(values[whole:], 2, dtype=torch.float32).double().square()


def _refuse_step_after_close(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    raise RuntimeError(
        "this optimizer was sharded by a ZeRO engine that has been closed (engine.close(), or the engine "
        "was garbage-collected): its parameters and state were the engine's and are gone; build a new "
        "optimizer (and engine) to train again"
    )


# [Note: one clipping value]
# A run clips to one value, as DeepSpeed's engine does: its JSON's `gradient_clipping` is what the step
# applies (Accelerate's DeepSpeed path ignores clip_grad_norm_'s max_norm; the HF Trainer fills "auto"
# from max_grad_norm and refuses a different value). So a configured clipping > 0 governs every step;
# `clip_grad_norm_` with another finite max_norm is an error naming both (inf only asks for the norm,
# as the HF Trainer does to log it when max_grad_norm is 0), and without configured clipping the
# call's max_norm applies to the coming step. ZeroTrainer settles max_grad_norm against the config
# before the engine is built (tnlg/trainer.py).
class ShardedOptimizer:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[FlatGroup],
        collectives: Collectives,
        loss_scaler: LossScaler,
        gradient_clipping: float,
        sharded: bool,
        offloaded: bool = False,
        fused_adam: str = "none",
        model_parallel: ModelParallelNorm | None = None,
    ):
        self.optimizer = optimizer
        self.model_parallel = model_parallel
        self.groups = groups
        self.collectives = collectives
        self.loss_scaler = loss_scaler
        self.gradient_clipping = gradient_clipping
        self.sharded = sharded  # gradient pieces differ per rank: norms need an all-reduce
        for group, flat in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = [flat.master]
        optimizer.state = defaultdict(dict)
        self._stepping = False
        # The user's optimizer object now holds this rank's shards: stepping it directly would do
        # nothing useful (no gradients reduced, no parameters written back), so refuse it. Weakly: the
        # user may keep the optimizer after dropping the engine (see [Note: engine lifetime] in grads.py).
        self._step_hook = optimizer.register_step_pre_hook(WeakHook(self._refuse_direct_step))
        self.global_grad_norm: float | None = None
        self.step_was_skipped = False
        # (norm, max_norm) from clip_grad_norm_; norm None: gradients changed since, the step recomputes it
        self._clip_request: tuple[float | None, float] | None = None
        self.host_adam = host_adam_for(optimizer) if offloaded else None
        if offloaded:
            kind = "CPUAdam" if self.host_adam is not None else f"{type(optimizer).__name__} itself"
            logger.info("optimizer offloaded to the CPU: the step runs %s on host memory", kind)
        # Where the offloaded step writes the updated 16-bit values: stage 3's host shard itself when
        # parameters are offloaded too, else a pinned host buffer copied to the device (fp32: the master).
        self._updated16 = [_host_16bit_shard(flat) if self.host_adam is not None else None for flat in groups]
        # The device's fused Adam kernel ("auto", "cuda", "triton", "reference"), or None.
        self.fused_backend = (
            fused_adam if not offloaded and fused_adam != "none" and steps_like_adam(optimizer) else None
        )

    def grad_norm(self) -> float:
        """The global L2 norm of the (unscaled) gradients, over every rank's shard, accumulated in
        float64 (see [Note: gradient norm precision])."""
        device = self.groups[0].device  # where the collectives run (offloaded pieces are on the host)
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for flat in self.groups:
            pieces = [piece for piece in flat.grad_tensors() if piece.numel()]
            if pieces:
                group_squares = torch.stack([squared_norm(piece) for piece in pieces]).sum()
                squares += group_squares.to(device)
        if self.model_parallel is not None:
            squares -= self.model_parallel.excess(self.groups)
        if self.sharded:
            self.collectives.all_reduce(squares)
        for reduction in self.model_parallel.reductions if self.model_parallel is not None else []:
            reduction.all_reduce(squares)
        return math.sqrt(squares.item()) / self.loss_scaler.scale

    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        if not self._stepping:
            raise RuntimeError(
                "this optimizer is sharded by the ZeRO engine: call engine.step() (or the optimizer Accelerate "
                "returned), not the original optimizer's step()"
            )

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global norm now, reused by the coming step. See [Note: one clipping value]: the configured
        clipping governs that step; without one, the step clips to `max_norm` (inf: no clipping)."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        configured = self.gradient_clipping
        if configured > 0 and math.isfinite(max_norm) and max_norm != configured:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) conflicts with the engine's gradient_clipping "
                f"{configured} (ZeroConfig.gradient_clipping or the DeepSpeed JSON's): pass max_norm={configured} "
                "(or inf to read the norm only), or change gradient_clipping"
            )
        norm = self.grad_norm()
        self._clip_request = (norm, configured if configured > 0 else max_norm)
        return norm

    def gradients_changed(self) -> None:
        """A backward ran since `clip_grad_norm_` (a call inside an accumulation window): the coming step
        still clips to that call's max_norm, but measures the norm of the complete gradients."""
        if self._clip_request is not None:
            self._clip_request = (None, self._clip_request[1])

    def step(self) -> bool:
        """Update the shards (and write the 16-bit parameters back); False if the step was skipped.

        A non-finite gradient norm (an fp16 overflow, or a NaN in any precision) skips the step on
        every rank alike, since the norm was reduced over all of them, and lowers the loss scale.
        """
        if self._clip_request is not None:
            (norm, clip), self._clip_request = self._clip_request, None
            norm = self.grad_norm() if norm is None else norm
        else:
            norm, clip = self.grad_norm(), self.gradient_clipping
        self.global_grad_norm = norm
        if not math.isfinite(norm):
            self.step_was_skipped = True
            attempted = self.loss_scaler.scale
            self.loss_scaler.update(overflow=True)
            if self.collectives.rank == 0:  # every rank skips alike: one line says so
                logger.info(
                    "step skipped: the gradient norm is %s at loss scale %g (now %g)",
                    norm, attempted, self.loss_scaler.scale,
                )  # fmt: skip
            return False
        # Unscaling and clipping fold into one multiply of the fp32 gradient copy.
        factor = 1.0 / self.loss_scaler.scale
        if clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when below 1.
            factor *= min(1.0, clip / (norm + 1e-6))
        if self.host_adam is not None:
            self._host_adam_step(factor)
        elif self.fused_backend is not None and steps_like_adam(self.optimizer):
            # asked again each step: a checkpoint's hyperparameters (maximize) may have left the kernel's reach
            self._fused_adam_step(factor)
        else:
            self._optimizer_step(factor)
        self.step_was_skipped = False
        self.loss_scaler.update(overflow=False)
        return True

    def _optimizer_step(self, factor: float) -> None:
        """The user's optimizer over fp32 gradients (a fp32 gradient shard is used in place)."""
        for flat in self.groups:
            gradient = flat.step_gradient(torch.float32)
            flat.master.grad = gradient.mul_(factor) if factor != 1.0 else gradient
        with self._user_step():
            self.optimizer.step()
        for flat in self.groups:
            flat.master.grad = None
            flat.write_back()

    def _host_adam_step(self, factor: float) -> None:
        """CPUAdam reads the gradient shards as they are, scaled as it reads them, and writes the 16-bit copies."""
        grads = [flat.step_gradient() for flat in self.groups]
        device = self.groups[0].device
        if device.type == "cuda":
            # The host buffers CPUAdam writes (the 16-bit copies, stage 3's host shard) were read by
            # asynchronous copies to the device after the last step: let those finish first. (The
            # gradient norm's .item() has already waited for them; this does not rely on it.)
            torch.cuda.current_stream(device).synchronize()
        with self._user_step():
            host_adam_step(self.host_adam, self.optimizer, grads, self._updated16, factor)
            # No gradients are set, so this updates nothing: it runs the optimizer's step hooks and
            # the bookkeeping a learning-rate scheduler checks (that optimizer.step() was called).
            self.optimizer.step()
        for flat, updated in zip(self.groups, self._updated16, strict=True):
            flat.write_back(updated)

    def _fused_adam_step(self, factor: float) -> None:
        """A fused Adam kernel per param group on the device shards (see the module docstring)."""
        with self._user_step():
            for flat, group in zip(self.groups, self.optimizer.param_groups, strict=True):
                state = self.optimizer.state[flat.master]
                out16 = _device_16bit_target(flat)
                fused_adam_group(
                    flat.master, flat.step_gradient(), group, state,
                    grad_scale=factor, out16=out16, backend=self.fused_backend,
                )  # fmt: skip
                flat.write_back(out16)
            self.optimizer.step()  # no gradients: hooks and scheduler bookkeeping only

    @contextlib.contextmanager
    def _user_step(self) -> Iterator[None]:
        """The engine's own calls of the user's optimizer (which `_refuse_direct_step` lets through)."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def close(self) -> None:
        """Hand the user's optimizer back emptied (see [Note: engine lifetime] in grads.py): no tensors
        in its param groups, no state (both were this rank's shards), and a step that raises."""
        self._step_hook.remove()
        for group in self.optimizer.param_groups:
            group["params"] = []
        self.optimizer.state = defaultdict(dict)
        self.optimizer.register_step_pre_hook(_refuse_step_after_close)
        self.host_adam = None
        self._updated16 = [None] * len(self._updated16)
        self._clip_request = None

    def host_copies(self) -> list[torch.Tensor]:
        """The host buffers the offloaded step writes 16-bit parameters into (other than stage 3's shard)."""
        return [
            buffer
            for buffer, flat in zip(self._updated16, self.groups, strict=True)
            if buffer is not None and buffer is not flat.shard
        ]

    def state_tensors(self) -> list[torch.Tensor]:
        return [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (e.g. Adam's two moments) this rank holds."""
        return sum(value.untyped_storage().nbytes() for value in self.state_tensors())


@dataclass
class ModelParallelNorm:
    """The gradient norm over the model-parallel groups too (see [Note: parallel layout] in parallel.py):
    every tensor rank holds different slices of the cut parameters and every pipeline stage different
    layers, so the squares are summed over those groups (`reductions`, the tensor group then the
    pipeline group). Parameters held by more than one of those ranks must be counted once: `counted`
    gives, per flat group, {parameter index: the fraction of this rank's squares that the sum counts}
    for them (1/t for what the tensor plan leaves whole, 0 for a later stage's copy of the tied
    embedding); every other parameter counts whole."""

    reductions: list[Collectives]
    counted: list[dict[int, float]]

    def excess(self, groups: list[FlatGroup]) -> torch.Tensor:
        """What the sum over `reductions` of this rank's squares counts more than once (fp64)."""
        excess = torch.zeros((), dtype=torch.float64, device=groups[0].device)
        for flat, fractions in zip(groups, self.counted, strict=True):
            owned = [
                (view, 1 - fraction)
                for index, fraction in fractions.items()
                if (view := flat.owned_gradient(index)) is not None and view.numel()
            ]
            if owned:  # one reduction per group; offloaded shards are on the host: one scalar moves
                squares = torch.stack([squared_norm(view) for view, _ in owned])
                weights = torch.tensor([w for _, w in owned], dtype=squares.dtype, device=squares.device)
                excess += (squares * weights).sum().to(excess.device)
        return excess


def _host_16bit_shard(flat: FlatGroup) -> torch.Tensor | None:
    if flat.compute_dtype == torch.float32:
        return None  # no 16-bit copy: the fp32 master is what goes back to the device
    if flat.placement.params_on_host:
        return flat.shard
    return flat.placement.host_empty(flat.layout.shard_numel, flat.compute_dtype)


def _device_16bit_target(flat: FlatGroup) -> torch.Tensor | None:
    """Where a device fused step can write the 16-bit parameters in the shard layout: stage 3's shard
    and stage 0's full buffer (one shard: the same layout); stages 1-2 cast from the master instead."""
    if flat.compute_dtype == torch.float32:
        return None
    if flat.stage == 3 and not flat.placement.params_on_host:
        return flat.shard
    return flat.full if flat.stage == 0 else None
