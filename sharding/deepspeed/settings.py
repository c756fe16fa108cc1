"""A DeepSpeed config as typed values: `DeepSpeedConfig` (what reader.py returns) holds the engine's
`ZeroConfig` and the `TrainingConfig` (batch sizes, `OptimizerSpec`, `SchedulerSpec`) that the engine
applies as DeepSpeed's engine does; `engine_optimizer` builds the optimizer the engine shards."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ..config import ZeroConfig
from .dtypes import check_dtype_keys
from .keys import ADAM_RULES, BATCH_KEYS, FUSED_ADAM_DEFAULTS, integer
from .lr_schedules import SCHEDULERS
from .sections import apply_overrides


@dataclass(frozen=True)
class OptimizerSpec:
    """The `optimizer` section: `type` as DeepSpeed spells it ("Adam" or "AdamW", case-insensitive in the
    JSON) and its checked `params` (which may still hold "auto", refused when the optimizer is built)."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def build(self, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer DeepSpeed's engine builds (`_configure_basic_optimizer`): "Adam" steps with
        decoupled weight decay (AdamW) unless `adam_w_mode` is false, "AdamW" always; FusedAdam's
        defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0) unless `torch_adam`, which
        builds torch's class with torch's defaults (AdamW: weight_decay 0.01). tnlg steps either through
        its fused / CPU Adam kernels (`ZeroConfig.fused_adam`)."""
        params = _concrete("optimizer.params", self.params)
        torch_adam = params.pop("torch_adam", False)
        adam_w_mode = params.pop("adam_w_mode", True)  # DeepSpeed's default: decoupled weight decay
        decoupled = self.type == "AdamW" or adam_w_mode
        for ignored in ADAM_RULES:
            params.pop(ignored, None)
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        kwargs = params if torch_adam else {**FUSED_ADAM_DEFAULTS, **params}
        kind = torch.optim.AdamW if decoupled else torch.optim.Adam
        return kind(parameters, **kwargs)


@dataclass(frozen=True)
class SchedulerSpec:
    """The `scheduler` section: one of `SUPPORTED_SCHEDULERS` and its checked `params`."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def build(self, optimizer: torch.optim.Optimizer) -> LRScheduler:
        params = _concrete("scheduler.params", self.params)
        params.pop("last_batch_iteration", None)
        return SCHEDULERS[self.type](optimizer, **params)


@dataclass(frozen=True)
class BatchSizes:
    """Batch sizes resolved for a world size; the micro and global batch are None where nothing sets them."""

    gradient_accumulation_steps: int
    train_micro_batch_size_per_gpu: int | None
    train_batch_size: int | None


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The training part of a DeepSpeed config (what `ZeroConfig` does not hold); None: not set.

    gradient_accumulation_steps: micro-batches per optimizer step. Call `engine.backward(loss)` and
        `engine.step()` on every micro-batch: backward scales each loss by 1/N (DeepSpeed's default),
        stages 0-1 reduce gradients only in the Nth backward, and only the Nth `step()` updates (clip,
        update, zero the gradients, step the scheduler). Unset: 1, or what the batch sizes imply.
    train_micro_batch_size_per_gpu: samples per rank in one micro-batch. The engine cannot apply it to
        your data loader: build the loader with `engine.train_micro_batch_size_per_gpu()`.
    train_batch_size: samples per optimizer step over all ranks. It must equal micro batch x
        accumulation steps x world size; as in DeepSpeed, a missing one of the three is derived from
        the others (only the global batch: accumulation 1; only the micro batch: accumulation 1).
    optimizer: the `optimizer` section: `initialize(model, None, config)` builds it over the model's
        trainable parameters; passing an optimizer as well is an error.
    scheduler: the `scheduler` section: built over the optimizer and stepped by `engine.step()` after
        each applied update (not after an fp16 overflow skip), as DeepSpeed's engine does.
    """

    gradient_accumulation_steps: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None

    def __post_init__(self) -> None:
        for name in BATCH_KEYS:
            value = getattr(self, name)
            if value is not None and not integer(1)[0](value):
                raise ValueError(f"TrainingConfig.{name} must be an integer >= 1 or None, got {value!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerSpec):
            raise ValueError(f"TrainingConfig.optimizer must be an OptimizerSpec, got {self.optimizer!r}")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerSpec):
            raise ValueError(f"TrainingConfig.scheduler must be a SchedulerSpec, got {self.scheduler!r}")

    def replace(self, **changes: Any) -> TrainingConfig:
        return replace(self, **changes)

    def implied_accumulation(self, world_size: int) -> int | None:
        """The accumulation steps the config sets or implies (global and micro batch both set), else None."""
        if self.gradient_accumulation_steps is not None:
            return self.gradient_accumulation_steps
        if self.train_batch_size is not None and self.train_micro_batch_size_per_gpu is not None:
            return self.train_batch_size // self.train_micro_batch_size_per_gpu // world_size
        return None

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """DeepSpeed's derivation of the missing batch values, then its check train_batch_size ==
        micro x accumulation x world size (a ValueError naming the numbers)."""
        total, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        steps = self.implied_accumulation(world_size)
        if steps is None:
            steps = 1  # DeepSpeed: one batch size (or none) given means no accumulation
        if total is not None and micro is None:
            micro = total // world_size // steps
        elif micro is not None and total is None:
            total = micro * steps * world_size
        if total is not None and (micro < 1 or steps < 1 or total != micro * steps * world_size):
            set_here = [name for name in BATCH_KEYS if getattr(self, name) is not None]
            raise ValueError(
                f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {steps} x world size {world_size} (= {micro * steps * world_size}); "
                f"the config sets {', '.join(set_here)}, the rest is derived as DeepSpeed does"
            )
        return BatchSizes(steps, micro, total)


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config read whole (`load_deepspeed`): the engine's `zero` config, the `training` part,
    the keys read but `ignored` ((key path, why)), which key set each ZeroConfig field (`zero_sources`:
    field -> (key path, value as written)), where it came from (`source`, for errors), and its dtype keys
    as written (`dtype_keys`: communication_data_type, data_types), checked again at a filled precision."""

    zero: ZeroConfig
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ignored: tuple[tuple[str, str], ...] = ()
    zero_sources: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    source: str = "the DeepSpeed config"
    dtype_keys: Mapping[str, Any] = field(default_factory=dict)

    def with_overrides(
        self, overrides: Mapping[str, Any], override_names: Mapping[str, str] | None = None
    ) -> DeepSpeedConfig:
        """This config with ZeroConfig fields set elsewhere (see `zero_config_from_deepspeed`): they fill
        the fields the JSON leaves unset, and one the JSON sets differently is an error naming both."""
        zero = apply_overrides(self.zero, self.zero_sources, self.source, overrides, override_names or {})
        overridden = replace(self, zero=zero)
        return (
            overridden.with_checked_dtypes()
            if zero.mixed_precision != self.zero.mixed_precision
            else overridden
        )

    def with_mixed_precision(self, mixed_precision: str | None, given: str) -> DeepSpeedConfig:
        """This config at the launcher's `mixed_precision` (None or "no": whatever the config enables),
        the one rule every front door follows: it fills a config that enables none, and one that enables
        another is an error naming both (`given` names the launcher's setting, e.g. "train.mixed_precision
        bf16")."""
        zero = self.zero
        if not mixed_precision or mixed_precision == "no" or zero.mixed_precision == mixed_precision:
            return self
        if zero.mixed_precision != "no":
            raise ValueError(
                f"{given} conflicts with {self.stated('mixed_precision')}, which enables {zero.mixed_precision}: "
                "change one of them to agree with the other"
            )
        # the JSON's dtype keys, not checked at the precision it left open, must hold at this one
        return replace(self, zero=zero.replace(mixed_precision=mixed_precision)).with_checked_dtypes(given)

    def with_checked_dtypes(self, given: str | None = None) -> DeepSpeedConfig:
        """This config, its dtype keys checked at its precision as settled: where the engine is built, and
        where a run config is read (a JSON that enables no precision is checked there at fp32, or at the
        launcher's when `with_mixed_precision` fills it; `given` names that setting for the error)."""
        try:
            check_dtype_keys(self.dtype_keys, self.zero.mixed_precision)
        except ValueError as error:
            where = "" if self.source == DeepSpeedConfig.source else f"{self.source}: "
            raise ValueError(
                f"{where}{error}" + (f" (the precision {given} gives)" if given else "")
            ) from error
        return self

    def stated(self, field: str) -> str:
        """Where this config sets ZeroConfig `field`, for errors, as the user wrote it: the DeepSpeed key
        (`bf16.enabled: true in ds.json`), else the ZeroConfig field (`ZeroConfig.mixed_precision='bf16'`)."""
        if field in self.zero_sources:
            key, raw = self.zero_sources[field]
            return f"{key}: {json.dumps(raw, default=str)} in {self.source}"
        where = "" if self.source == DeepSpeedConfig.source else f" in {self.source}"
        return f"ZeroConfig.{field}={getattr(self.zero, field)!r}{where}"

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """`TrainingConfig.batch_sizes`, its error naming the config."""
        try:
            return self.training.batch_sizes(world_size)
        except ValueError as error:
            raise ValueError(f"{self.source}: {error}") from error


def _concrete(path: str, params: Mapping[str, Any]) -> dict[str, Any]:
    auto = [key for key, value in params.items() if value == "auto"]
    if auto:
        raise ValueError(
            f'{path}.{", ".join(auto)} is "auto": only a launcher that owns those settings (the HF Trainer) '
            "fills it, and tnlg is building it from the JSON; write the value"
        )
    return dict(params)


# ---------------------------------------------------------------------------------------------------
# How the engine applies the config.
def engine_optimizer(
    settings: DeepSpeedConfig, module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> torch.optim.Optimizer | None:
    """The optimizer the engine shards: the one passed, or the one the config's section builds over the
    module's trainable parameters; both, or a scheduler without either, is an error."""
    spec = settings.training.optimizer
    if spec is not None and optimizer is not None:
        raise ValueError(
            f"{settings.source} has an optimizer section ({spec.type}) and an optimizer was passed too "
            f"({type(optimizer).__name__}): keep one of them"
        )
    if spec is not None:
        parameters = [p for p in module.parameters() if p.requires_grad]
        if not parameters:
            raise ValueError(
                f"{settings.source} has an optimizer section but the model has no trainable parameters"
            )
        optimizer = spec.build(parameters)
    if optimizer is None and settings.training.scheduler is not None:
        raise ValueError(
            f"{settings.source} has a scheduler section ({settings.training.scheduler.type}) but no optimizer "
            "to schedule: pass an optimizer or add an optimizer section"
        )
    return optimizer
