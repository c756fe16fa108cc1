"""DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py), as torch LRSchedulers: what a
DeepSpeed JSON's `scheduler` section builds (`SchedulerSpec.build`, settings.py), by its `type`
(`SCHEDULERS`)."""

from __future__ import annotations

import logging
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)


class DeepSpeedSchedule(LRScheduler):
    """DeepSpeed counts `last_batch_iteration` from -1 (the lr set at construction) and steps once per
    optimizer update; torch's constructor already steps once, so `last_epoch` is that count + 1."""

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def load_deepspeed_state(self, state: dict) -> None:
        """DeepSpeed's own state of this schedule, `{"last_batch_iteration": n}`, as a DeepSpeed
        checkpoint holds it: the count and the lr it gives, set on the optimizer's groups."""
        iteration = state.get("last_batch_iteration") if isinstance(state, dict) else None
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < -1:
            raise ValueError(
                f"a DeepSpeed scheduler state should hold last_batch_iteration >= -1, got {state!r}"
            )
        self.last_epoch = iteration + 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def _per_group(value: float | list[float], groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"scheduler.params.{name} has {len(value)} values for {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class WarmupLR(DeepSpeedSchedule):
    """From `warmup_min_lr` to `warmup_max_lr` (default: the first param group's lr) over
    `warmup_num_steps` (at least 2), logarithmically (log(i + 1) / log(W)) or linearly (i / W), then flat.
    Every param group gets the same lr unless the bounds are lists, as in DeepSpeed."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ):
        groups = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(warmup_min_lr, groups, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, groups, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) = 0 would divide by zero
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        iteration = self.last_batch_iteration
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to `warmup_min_lr` at `total_num_steps`: gamma = max(0, (T - i) /
    max(1, T - W)). `warmup_max_lr` defaults to 0.001 here, as in DeepSpeed (not the optimizer's lr)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ):
        self.total_num_steps = total_num_steps
        if total_num_steps < warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d < warmup_num_steps %d", total_num_steps, warmup_num_steps
            )
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(
            0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps)
        )


class WarmupCosineLR(DeepSpeedSchedule):
    """The optimizer's own lrs times a ratio: 0 at construction, from `warmup_min_ratio` to 1 over the
    warmup (log or linear), then a cosine to `cos_min_ratio` at `total_num_steps`, held there after."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ):
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %d < warmup_num_steps %d", total_num_steps, warmup_num_steps
            )
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = (iteration - self.warmup_num_steps + 1) / max(
            1, self.total_num_steps - self.warmup_num_steps
        )
        cosine = (1 + math.cos(math.pi * min(1.0, progress))) / 2  # held at the floor past the end
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.ratio(self.last_batch_iteration)
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS: dict[str, type[DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
