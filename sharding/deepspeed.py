"""A DeepSpeed JSON read whole: the engine's `ZeroConfig`, and the training part DeepSpeed's engine also
applies (batch sizes, gradient accumulation, optimizer, learning-rate scheduler).

[Note: DeepSpeed keys]
Every key of a DeepSpeed config, at every level, is one of:
- applied: `zero_optimization`, `bf16` / `fp16` and `gradient_clipping` become `ZeroConfig` fields;
  `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`, `train_batch_size`, `optimizer`
  and `scheduler` become the `TrainingConfig` that `initialize` applies as DeepSpeed's engine does;
- read and ignored, because ignoring it cannot change what is trained (logs, profilers, performance
  knobs of DeepSpeed's own implementation): each has its reason in a table (`KeyRule`), and the
  ignored ones are logged once at INFO when the config is read;
- read and refused unless at the value tnlg behaves like (features tnlg lacks, such as ZeRO++
  quantization or prescaled gradients): an error naming the key, what it does and the value to use;
- unknown (a typo such as "stgae", or a DeepSpeed feature tnlg does not know): an error naming the
  dotted key path and the closest known key. A typo used to train at stage 0 after a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .config import KeyRule, SectionReader, ZeroConfig, apply_overrides, at, disabled, mapping_kind
from .json_files import read_json, write_json_atomic

logger = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW")
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
BATCH_KEYS = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")
SCHEDULER_FILE = "lr_scheduler.json"  # in an engine checkpoint whose engine built the JSON's scheduler

_MONITOR = "DeepSpeed's own monitoring: log through the run's trackers"
_TOP_RULES = {
    "steps_per_print": KeyRule("progress-log cadence"),
    "wall_clock_breakdown": KeyRule("timing logs"),
    "memory_breakdown": KeyRule("memory logs"),
    "dump_state": KeyRule("prints the config"),
    "tensorboard": KeyRule(_MONITOR),
    "wandb": KeyRule(_MONITOR),
    "csv_monitor": KeyRule(_MONITOR),
    "comet": KeyRule(_MONITOR),
    "comms_logger": KeyRule("communication logs (engine.comm_stats() counts collectives)"),
    "flops_profiler": KeyRule("profiler output"),
    "timers": KeyRule("timer logs"),
    "autotuning": KeyRule("read by the `deepspeed --autotuning` launcher, not by training"),
    "zero_allow_untested_optimizer": KeyRule("a permission: the engine takes any torch optimizer"),
    "zero_force_ds_cpu_optimizer": KeyRule("a check: an offloaded Adam / AdamW always steps through CPUAdam"),
    "dataloader_drop_last": KeyRule("applies to data loaders DeepSpeed builds; the engine builds none"),
    "checkpoint": KeyRule("DeepSpeed's checkpoint I/O options: tnlg writes its own format"),
    "aio": KeyRule("NVMe I/O (tnlg offloads to CPU memory only)"),
    "activation_checkpointing": KeyRule(
        "configures deepspeed.checkpointing, which tnlg models do not call "
        "(use the run config's model.activation_checkpointing, or the model's activation_checkpointing_enable())"
    ),
    "seq_parallel_communication_data_type": KeyRule("sequence parallelism only; tnlg has none"),
    "prescale_gradients": KeyRule("divides gradients before the reduction instead of after", **at(False)),
    "gradient_predivide_factor": KeyRule("splits the gradient division around the reduction", **at(1.0)),
    "sparse_gradients": KeyRule("sparse embedding gradients are not implemented", **at(False)),
    "disable_allgather": KeyRule("replaces the parameter all-gather with broadcasts", **at(False)),
    "amp": KeyRule("NVIDIA Apex AMP: use bf16 or fp16", **disabled()),
    "torch_autocast": KeyRule("autocast: tnlg runs 16-bit parameters (bf16 or fp16)", **disabled()),
    "elasticity": KeyRule("elastic batch sizes are not implemented", **disabled()),
    "eigenvalue": KeyRule("eigenvalue-driven quantization is not implemented", **disabled()),
    "progressive_layer_drop": KeyRule("progressive layer dropping is not implemented", **disabled()),
    "curriculum_learning": KeyRule("curriculum learning is not implemented", **disabled()),
    "data_efficiency": KeyRule("data efficiency sampling is not implemented", **disabled()),
    "hybrid_engine": KeyRule("the RLHF hybrid engine is not implemented", **disabled()),
    "nebula": KeyRule("the Nebula checkpoint service is not implemented", **disabled()),
}
_APPLIED = ("zero_optimization", "bf16", "bfloat16", "fp16", "gradient_clipping", "optimizer", "scheduler")
TOP_LEVEL_KEYS = frozenset((*_APPLIED, *BATCH_KEYS, *_TOP_RULES, "communication_data_type"))
_COMMUNICATION_DTYPES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


# ---------------------------------------------------------------------------------------------------
# Value checks: (test, what it must be). "auto" is allowed only where a launcher fills the value.
def _number(minimum: float, inclusive: bool = True) -> tuple[Callable[[Any], bool], str]:
    def test(value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return value >= minimum if inclusive else value > minimum

    return test, f"a finite number {'>=' if inclusive else '>'} {minimum}"


def _integer(minimum: int) -> tuple[Callable[[Any], bool], str]:
    def test(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and value >= minimum

    return test, f"an integer >= {minimum}"


def _number_or_list(minimum: float) -> tuple[Callable[[Any], bool], str]:
    test, what = _number(minimum)
    return (lambda v: test(v) or (isinstance(v, list) and bool(v) and all(map(test, v)))), (
        f"{what}, or a list of them (one per param group)"
    )


_BOOL = (lambda value: isinstance(value, bool)), "true or false"
_BETAS = (
    lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(0.0)[0](b) and b < 1 for b in v),
    "two numbers in [0, 1), e.g. [0.9, 0.999]",
)
_WARMUP_TYPE = (lambda value: value in ("log", "linear")), '"log" or "linear"'

# Adam / AdamW params: name -> (check, "auto" allowed). FusedAdam's defaults are DeepSpeed's.
_ADAM_PARAMS = {
    "lr": (_number(0.0), True),
    "betas": (_BETAS, True),
    "eps": (_number(0.0, inclusive=False), True),
    "weight_decay": (_number(0.0), True),
    "amsgrad": (_BOOL, False),
    "adam_w_mode": (_BOOL, False),
    "torch_adam": (_BOOL, False),
}
_ADAM_RULES = {
    "bias_correction": KeyRule("tnlg's Adam always corrects the moments' bias", **at(True)),
    "fp32_optimizer_states": KeyRule("optimizer states are always fp32", **at(True)),
    "set_grad_none": KeyRule("the engine owns the gradient buffers"),
    "max_grad_norm": KeyRule(
        "DeepSpeed refuses it as an optimizer parameter: use the top-level gradient_clipping",
        accepts=lambda value: False,
    ),
}
_FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_OPTIMIZER_RULES = {"legacy_fusion": KeyRule("DeepSpeed's fp16 optimizer fusion; performance only")}

_WARMUP_PARAMS = {
    "warmup_min_lr": (_number_or_list(0.0), True),
    "warmup_max_lr": (_number_or_list(0.0), True),
    "warmup_num_steps": (_integer(1), True),
    "warmup_type": (_WARMUP_TYPE, False),
}
_TOTAL_STEPS = {"total_num_steps": (_integer(1), True)}
_SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": {**_WARMUP_PARAMS, **_TOTAL_STEPS},
    "WarmupCosineLR": {
        **_TOTAL_STEPS,
        "warmup_min_ratio": (_number(0.0), False),
        "cos_min_ratio": (_number(0.0), False),
        "warmup_num_steps": (_integer(1), True),
        "warmup_type": (_WARMUP_TYPE, False),
    },
}
_REQUIRED_SCHEDULER_PARAMS = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}
_SCHEDULER_RULES = {
    "last_batch_iteration": KeyRule(
        "a schedule resumes from the engine checkpoint (lr_scheduler.json), not from the JSON", **at(-1)
    )
}


# ---------------------------------------------------------------------------------------------------
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
        for ignored in _ADAM_RULES:
            params.pop(ignored, None)
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        kwargs = params if torch_adam else {**_FUSED_ADAM_DEFAULTS, **params}
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
        return _SCHEDULERS[self.type](optimizer, **params)


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
            if value is not None and not _integer(1)[0](value):
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
    field -> (key path, value as written)), and where it came from (`source`, for errors)."""

    zero: ZeroConfig
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ignored: tuple[tuple[str, str], ...] = ()
    zero_sources: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    source: str = "the DeepSpeed config"

    def with_overrides(
        self, overrides: Mapping[str, Any], override_names: Mapping[str, str] | None = None
    ) -> DeepSpeedConfig:
        """This config with ZeroConfig fields set elsewhere (see `ZeroConfig.from_deepspeed`): they fill
        the fields the JSON leaves unset, and one the JSON sets differently is an error naming both."""
        zero = apply_overrides(self.zero, self.zero_sources, self.source, overrides, override_names or {})
        return replace(self, zero=zero)

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """`TrainingConfig.batch_sizes`, its error naming the config."""
        try:
            return self.training.batch_sizes(world_size)
        except ValueError as error:
            raise ValueError(f"{self.source}: {error}") from error


# ---------------------------------------------------------------------------------------------------
def load_deepspeed(config: Mapping[str, Any] | str | Path, **auto: Any) -> DeepSpeedConfig:
    """Read a DeepSpeed config (dict or JSON file) whole; see [Note: DeepSpeed keys].

    `"auto"` values take the matching keyword from `auto` (ZeroConfig fields, `initial_scale_power`,
    and the three batch keys) or else the default (ZeroConfig's; unset for batch keys). In the
    optimizer and scheduler sections "auto" is kept and refused when they are built: a launcher that
    owns those values (the HF Trainer) fills them, tnlg does not.
    """
    config, source = _read_config(config)
    with _naming(source):
        return _load(config, source, auto)


def parse_deepspeed(config: Mapping[str, Any] | str | Path, **auto: Any) -> tuple[ZeroConfig, list[str]]:
    """(`ZeroConfig`, key paths read and ignored) from a DeepSpeed config dict or JSON file."""
    loaded = load_deepspeed(config, **auto)
    return loaded.zero, [path for path, _ in loaded.ignored]


@contextlib.contextmanager
def _naming(source: str) -> Iterator[None]:
    """Errors about a file name the file."""
    try:
        yield
    except ValueError as error:
        if source == DeepSpeedConfig.source:
            raise
        raise ValueError(f"{source}: {error}") from error


def _read_config(config: Mapping[str, Any] | str | Path) -> tuple[Mapping[str, Any], str]:
    """The config dict and the name errors give it: the file's path, or `DeepSpeedConfig.source`."""
    source = DeepSpeedConfig.source
    if isinstance(config, (str, Path)):
        source = str(config)
        config = read_json(Path(config), ValueError, "the DeepSpeed (or ZeroConfig) JSON")
    if not isinstance(config, Mapping):
        raise ValueError(f"{source} must be a JSON object, got {type(config).__name__}")
    return config, source


def _load(config: Mapping[str, Any], source: str, auto: Mapping[str, Any]) -> DeepSpeedConfig:
    reader = SectionReader(auto, extra_auto=BATCH_KEYS)
    training: dict[str, Any] = {}
    if "bf16" in config and "bfloat16" in config:
        raise ValueError("invalid DeepSpeed config: bf16 and bfloat16 (its old name) are both set")
    for key, raw in config.items():
        if key == "zero_optimization":
            reader.read_zero(_section(key, raw))
        elif key in ("bf16", "bfloat16", "fp16"):
            reader.read_precision("fp16" if key == "fp16" else "bf16", _section(key, raw))
        elif key == "gradient_clipping":
            reader.set(key, raw, "gradient_clipping")
        elif key in BATCH_KEYS:
            training[key] = _read_count(key, raw, auto)
        elif key == "optimizer":
            training["optimizer"] = _read_optimizer(_section(key, raw), reader)
        elif key == "scheduler":
            training["scheduler"] = _read_scheduler(_section(key, raw), reader)
        elif key != "communication_data_type":
            reader.other(key, key, raw, _TOP_RULES, TOP_LEVEL_KEYS)
    if reader.unknown:
        raise ValueError(
            f"invalid DeepSpeed config: unknown keys {', '.join(reader.unknown)}; tnlg refuses keys it does "
            "not know rather than train without them"
        )
    zero = reader.zero_config()
    _check_communication_dtype(config.get("communication_data_type"), zero)
    loaded = DeepSpeedConfig(
        zero,
        TrainingConfig(**training),
        tuple(reader.ignored),
        dict(reader.sources),
        source,
    )
    if loaded.ignored:
        logger.info(
            "%s: ignoring keys that cannot change training results: %s",
            source,
            "; ".join(f"{path} ({why})" for path, why in loaded.ignored),
        )
    return loaded


def _section(path: str, raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"invalid DeepSpeed config: {path} must be an object, got {raw!r}")
    return raw


def _read_count(key: str, raw: Any, auto: Mapping[str, Any]) -> int | None:
    value = auto.get(key) if raw == "auto" else raw
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is not None and not _integer(1)[0](value):
        raise ValueError(f"invalid DeepSpeed config: {key} must be an integer >= 1, got {raw!r}")
    return value


def _check_params(
    path: str,
    params: Mapping[str, Any],
    checks: Mapping[str, tuple[tuple[Callable[[Any], bool], str], bool]],
    rules: Mapping[str, KeyRule],
    reader: SectionReader,
) -> dict[str, Any]:
    for key, value in params.items():
        if key not in checks:
            reader.other(f"{path}.{key}", key, value, rules, checks)
            continue
        (test, what), auto_allowed = checks[key]
        if not (test(value) or (auto_allowed and value == "auto")):
            raise ValueError(f"invalid DeepSpeed config: {path}.{key} must be {what}, got {value!r}")
    return dict(params)


def _read_type(path: str, section: Mapping[str, Any], supported: tuple[str, ...], folded: bool) -> str:
    kind = section.get("type")
    names = {name.lower(): name for name in supported} if folded else {name: name for name in supported}
    if not isinstance(kind, str) or (kind.lower() if folded else kind) not in names:
        raise ValueError(
            f"invalid DeepSpeed config: {path}.type {kind!r} is not supported; tnlg builds "
            f"{', '.join(supported)} (or pass your own to initialize)"
        )
    return names[kind.lower() if folded else kind]


def _read_optimizer(section: Mapping[str, Any], reader: SectionReader) -> OptimizerSpec:
    kind = _read_type("optimizer", section, SUPPORTED_OPTIMIZERS, folded=True)  # DeepSpeed lower-cases it
    for key, raw in section.items():
        if key not in ("type", "params"):
            reader.other(f"optimizer.{key}", key, raw, _OPTIMIZER_RULES, ["type", "params"])
    params = _check_params(
        "optimizer.params",
        _section("optimizer.params", section.get("params", {})),
        _ADAM_PARAMS,
        _ADAM_RULES,
        reader,
    )
    if params.get("amsgrad") and not params.get("torch_adam"):
        raise ValueError(
            "invalid DeepSpeed config: optimizer.params.amsgrad needs torch_adam: true (DeepSpeed's "
            "FusedAdam refuses AMSGrad too)"
        )
    return OptimizerSpec(kind, params)


def _read_scheduler(section: Mapping[str, Any], reader: SectionReader) -> SchedulerSpec:
    kind = _read_type("scheduler", section, SUPPORTED_SCHEDULERS, folded=False)  # DeepSpeed: exact names
    for key, raw in section.items():
        if key not in ("type", "params"):
            reader.other(f"scheduler.{key}", key, raw, {}, ["type", "params"])
    params = _check_params(
        "scheduler.params",
        _section("scheduler.params", section.get("params", {})),
        _SCHEDULER_PARAMS[kind],
        _SCHEDULER_RULES,
        reader,
    )
    missing = [name for name in _REQUIRED_SCHEDULER_PARAMS.get(kind, ()) if name not in params]
    if missing:
        raise ValueError(
            f"invalid DeepSpeed config: scheduler {kind} needs params.{', params.'.join(missing)}"
        )
    return SchedulerSpec(kind, params)


def _check_communication_dtype(raw: Any, zero: ZeroConfig) -> None:
    """tnlg reduces gradients in the compute dtype, as DeepSpeed does by default: any other is refused."""
    expected = _COMMUNICATION_DTYPES[zero.mixed_precision]
    if raw is None or raw == "auto" or raw == expected:
        return
    raise ValueError(
        f"invalid DeepSpeed config: communication_data_type = {json.dumps(raw)} is not supported (tnlg "
        f"communicates in the compute dtype, here {expected}); remove it or set it to {expected!r}"
    )


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
def engine_settings(
    config: DeepSpeedConfig | ZeroConfig | Mapping[str, Any] | str | Path | None, **auto: Any
) -> DeepSpeedConfig:
    """Any engine config as a `DeepSpeedConfig`: a DeepSpeed config (dict or JSON file, `auto` filling its
    "auto" values), or a ZeroConfig, a dict of its fields or a JSON file of them (no training part)."""
    if isinstance(config, DeepSpeedConfig):
        return config
    if config is None or isinstance(config, ZeroConfig):
        return DeepSpeedConfig(ZeroConfig.coerce(config))
    if not isinstance(config, (str, Path, Mapping)):
        raise TypeError(f"expected a ZeroConfig, a dict or a JSON path, got {type(config).__name__}")
    config, source = _read_config(config)
    with _naming(source):
        if mapping_kind(config) == "fields":
            return DeepSpeedConfig(ZeroConfig(**config), source=source)
        return _load(config, source, auto)


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


def save_scheduler_state(scheduler: LRScheduler, directory: Path) -> None:
    """Rank 0 writes the schedule's position before the checkpoint's manifest (which appears last)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_json_atomic(directory / SCHEDULER_FILE, scheduler.state_dict())


def read_scheduler_state(scheduler: LRScheduler | None, directory: Path) -> dict[str, Any] | None:
    """The saved schedule for `scheduler`, read before anything is restored; a missing one is an error
    (the schedule would restart at step 0), a saved one with no scheduler to take it a warning."""
    path = directory / SCHEDULER_FILE
    if scheduler is None:
        if path.is_file():
            logger.warning("%s: this engine has no DeepSpeed JSON scheduler to restore it into", path)
        return None
    if not path.is_file():
        raise ValueError(
            f"{directory} has no {SCHEDULER_FILE}: it was saved by an engine without the DeepSpeed JSON's "
            f"scheduler, and this engine's {type(scheduler).__name__} would restart at step 0"
        )
    return read_json(path, ValueError, "the DeepSpeed JSON scheduler's state")


# ---------------------------------------------------------------------------------------------------
# DeepSpeed's learning-rate schedules (deepspeed/runtime/lr_schedules.py), as torch LRSchedulers.
class DeepSpeedSchedule(LRScheduler):
    """DeepSpeed counts `last_batch_iteration` from -1 (the lr set at construction) and steps once per
    optimizer update; torch's constructor already steps once, so `last_epoch` is that count + 1."""

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1


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


_SCHEDULERS: dict[str, type[DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
