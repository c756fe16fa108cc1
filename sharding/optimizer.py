"""The sharded optimizer step: global norm, overflow skip, clipping, update of this rank's shard.

The user's optimizer is rebuilt *in place* over this rank's fp32 master shards, one per param
group: its class, every group's hyperparameters (weight decay, betas, lr, ...) and the group
dicts themselves stay, so a learning-rate scheduler built on it before or after `initialize` keeps
turning `param_groups[i]["lr"]`. Only its state is reset (it described the unsharded parameters).

Element-wise optimizers (SGD, Adam, AdamW, ...) compute exactly what they would unsharded.
Optimizers that reduce over whole tensors (LAMB's trust ratio, Adafactor's factored moments) see
shards instead and are not equivalent, as in every ZeRO implementation.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from .collectives import Collectives
from .flat_group import FlatGroup
from .loss_scaler import LossScaler


class ShardedOptimizer:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[FlatGroup],
        collectives: Collectives,
        loss_scaler: LossScaler,
        gradient_clipping: float,
        sharded: bool,
    ):
        self.optimizer = optimizer
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
        # nothing useful (no gradients reduced, no parameters written back), so refuse it.
        optimizer.register_step_pre_hook(self._refuse_direct_step)
        self.global_grad_norm: float | None = None
        self.step_was_skipped = False
        self._clip_request: tuple[float, float] | None = None  # (norm, max_norm) from clip_grad_norm_

    def grad_norm(self) -> float:
        """The global L2 norm of the (unscaled) gradients, over every rank's shard."""
        device = self.groups[0].master.device
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for flat in self.groups:
            pieces = [piece for piece in flat.grad_pieces() if piece.numel()]
            if pieces:
                norms = torch._foreach_norm(pieces, 2, dtype=torch.float32)
                squares += torch.stack(norms).pow(2).sum() / flat.grad_divisor**2
        if self.sharded:
            self.collectives.all_reduce(squares)
        return math.sqrt(squares.item()) / self.loss_scaler.scale

    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        if not self._stepping:
            raise RuntimeError(
                "this optimizer is sharded by the ZeRO engine: call engine.step() (or the optimizer Accelerate "
                "returned), not the original optimizer's step()"
            )

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global norm now; the coming step clips to `max_norm` (instead of the configured value)."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        norm = self.grad_norm()
        self._clip_request = (norm, max_norm)
        return norm

    def step(self) -> bool:
        """Update the shards (and write the 16-bit parameters back); False if the step was skipped.

        A non-finite gradient norm (an fp16 overflow, or a NaN in any precision) skips the step on
        every rank alike, since the norm was reduced over all of them, and lowers the loss scale.
        """
        if self._clip_request is not None:
            (norm, clip), self._clip_request = self._clip_request, None
        else:
            norm, clip = self.grad_norm(), self.gradient_clipping
        self.global_grad_norm = norm
        if not math.isfinite(norm):
            self.step_was_skipped = True
            self.loss_scaler.update(overflow=True)
            return False
        # Unscaling and clipping fold into one multiply of the fp32 gradient copy.
        factor = 1.0 / self.loss_scaler.scale
        if clip > 0:
            # torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when below 1.
            factor *= min(1.0, clip / (norm + 1e-6))
        for flat in self.groups:
            group_factor = factor / flat.grad_divisor
            if flat.shard_grad is not None and flat.shard_grad.dtype == torch.float32:
                # fp32 gradient shard (stages 2-3 without mixed precision): already the right tensor.
                gradient = flat.shard_grad
            else:
                gradient = torch.empty_like(flat.master)
                for unit, piece in zip(flat.layout.units, flat.grad_pieces(), strict=True):
                    flat.layout.shard_piece(gradient, unit).copy_(piece)
            flat.master.grad = gradient.mul_(group_factor) if group_factor != 1.0 else gradient
        self._stepping = True
        try:
            self.optimizer.step()
        finally:
            self._stepping = False
        for flat in self.groups:
            flat.master.grad = None
            flat.write_back()
        self.step_was_skipped = False
        self.loss_scaler.update(overflow=False)
        return True

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (e.g. Adam's two moments) this rank holds."""
        return sum(
            value.untyped_storage().nbytes()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
