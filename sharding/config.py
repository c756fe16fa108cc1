"""`ZeroConfig`: every setting of the ZeRO engine, validated, and the DeepSpeed JSON parser.

Sizes are in elements (as in DeepSpeed's JSON), not bytes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STAGES = (0, 1, 2, 3)
MIXED_PRECISIONS = ("no", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What the engine shards and how it communicates.

    stage: 0 = plain data parallel (every rank holds everything, gradients all-reduced);
        1 = fp32 master weights and optimizer state partitioned; 2 = gradients partitioned too;
        3 = 16-bit parameters partitioned too, gathered block by block around their use.
    mixed_precision: `no` (fp32 everywhere), `bf16` or `fp16` (16-bit parameters, gradients and
        communication; fp32 master weights and optimizer state).
    initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale: fp16 dynamic loss scaling:
        start at `initial_loss_scale`; an overflow skips the step and halves the scale once
        `hysteresis` overflows have been absorbed (never below `min_loss_scale`); `loss_scale_window`
        overflow-free steps double it.
    static_loss_scale: a fixed fp16 loss scale instead of the dynamic one.
    gradient_clipping: clip the global gradient norm to this value; 0 disables clipping.
    reduce_bucket_size: elements of gradients reduced in one collective (stages 0-2 group
        consecutive parameters into buckets of this size; stage 3 reduces per block).
    overlap_comm: launch each bucket's reduction asynchronously as soon as its gradients are
        ready, overlapping the rest of backward; False reduces after backward.
    prefetch_bucket_size: stage 3: elements of upcoming blocks gathered ahead of their use.
    param_persistence_threshold: stage 3: parameters with at most this many elements stay
        whole on every rank (gathering them costs more in latency than it saves in memory).
    max_live_parameters: stage 3: upper bound on gathered elements alive at once; prefetching
        stops at it.
    reshard_after_forward: stage 3: free gathered blocks after their forward and gather them
        again in backward (ZeRO-3); False keeps them until their backward (more memory, less
        communication).
    offload_optimizer: `cpu` keeps fp32 master weights and optimizer state in CPU memory (stages 1-3).
    offload_param: `cpu` keeps the partitioned 16-bit parameters in CPU memory (stage 3).
    """

    stage: int = 0
    mixed_precision: str = "no"
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    static_loss_scale: float | None = None
    gradient_clipping: float = 0.0
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    reshard_after_forward: bool = True
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, STAGES)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _check_choice("offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        _check_choice("offload_param", self.offload_param, OFFLOAD_DEVICES)
        for name in (
            "reduce_bucket_size",
            "prefetch_bucket_size",
            "max_live_parameters",
            "loss_scale_window",
            "hysteresis",
        ):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("param_persistence_threshold", self.param_persistence_threshold, minimum=0)
        for name in ("overlap_comm", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroConfig.{name} must be True or False, got {getattr(self, name)!r}")
        _check_number("gradient_clipping", self.gradient_clipping, minimum=0.0)
        _check_number("initial_loss_scale", self.initial_loss_scale, minimum=0.0, inclusive=False)
        _check_number("min_loss_scale", self.min_loss_scale, minimum=0.0, inclusive=False)
        if self.static_loss_scale is not None:
            _check_number("static_loss_scale", self.static_loss_scale, minimum=0.0, inclusive=False)
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"ZeroConfig.min_loss_scale ({self.min_loss_scale}) exceeds initial_loss_scale "
                f"({self.initial_loss_scale})"
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(
                "ZeroConfig.offload_optimizer needs stage 1, 2 or 3 (stage 0 partitions nothing)"
            )
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_param needs stage 3 (parameters are partitioned only there), "
                f"got stage {self.stage}"
            )

    @property
    def partitions_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def partitions_gradients(self) -> bool:
        return self.stage >= 2

    @property
    def partitions_parameters(self) -> bool:
        return self.stage == 3

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def coerce(cls, config: ZeroConfig | Mapping[str, Any] | str | Path | None) -> ZeroConfig:
        """A `ZeroConfig` from itself, a dict of its fields or a DeepSpeed-style dict, or a JSON path."""
        if config is None:
            return cls()
        if isinstance(config, ZeroConfig):
            return config
        if isinstance(config, (str, Path)):
            return cls.from_deepspeed(config)
        if isinstance(config, Mapping):
            own = {f.name for f in fields(cls)}
            if set(config) <= own:
                return cls(**config)
            return cls.from_deepspeed(config)
        raise TypeError(f"expected a ZeroConfig, a dict or a JSON path, got {type(config).__name__}")

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any] | str | Path, **auto: Any) -> ZeroConfig:
        """Parse a DeepSpeed config (dict or JSON file); logs the keys it ignores.

        `"auto"` values take the matching keyword from `auto` (e.g. `mixed_precision="bf16"` from
        the launcher) or else the field's default.
        """
        parsed, ignored = parse_deepspeed(config, **auto)
        if ignored:
            logger.warning("ZeroConfig.from_deepspeed ignores these keys: %s", ", ".join(ignored))
        return parsed


def parse_deepspeed(config: Mapping[str, Any] | str | Path, **auto: Any) -> tuple[ZeroConfig, list[str]]:
    """(`ZeroConfig`, ignored key paths) from a DeepSpeed config dict or JSON file."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(config).__name__}")
    reader = _DeepSpeedReader(auto)
    values = reader.read(config)
    try:
        return ZeroConfig(**values), reader.ignored
    except ValueError as error:
        raise ValueError(f"invalid DeepSpeed config: {error}") from error


# DeepSpeed zero_optimization key → ZeroConfig field.
_ZERO_KEYS = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
}
# Keys whose behaviour tnlg always has (or does not need): accepted silently.
_ZERO_BUILT_IN = {
    "contiguous_gradients",  # gradients always live in contiguous flat buffers
    "reduce_scatter",  # gradients are always reduce-scattered
    "allgather_partitions",  # parameters are always all-gathered
    "stage3_gather_16bit_weights_on_model_save",  # full_state_dict always gathers
    "stage3_gather_fp16_weights_on_model_save",
}
_FP16_KEYS = {
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
}


class _DeepSpeedReader:
    def __init__(self, auto: Mapping[str, Any]):
        self.auto = dict(auto)
        self.ignored: list[str] = []

    def value(self, path: str, raw: Any, field: str) -> Any:
        if raw == "auto":
            return self.auto.get(field, _default(field))
        # JSON writers (and DeepSpeed's docs) spell sizes as 5e8: integral floats are integers.
        if isinstance(raw, float) and raw.is_integer() and isinstance(_default(field), int):
            return int(raw)
        return raw

    def read(self, config: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for key, raw in config.items():
            if key == "zero_optimization":
                values.update(self.read_zero(_section(key, raw)))
            elif key in ("bf16", "fp16"):
                values.update(self.read_precision(key, _section(key, raw)))
            elif key == "gradient_clipping":
                values["gradient_clipping"] = self.value(key, raw, "gradient_clipping")
            elif key == "zero_allow_untested_optimizer":
                continue  # the engine takes any torch optimizer
            else:
                self.ignored.append(key)
        if config.get("bf16", {}).get("enabled") is True and config.get("fp16", {}).get("enabled") is True:
            raise ValueError("invalid DeepSpeed config: bf16.enabled and fp16.enabled are both true")
        return values

    def read_zero(self, section: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for key, raw in section.items():
            path = f"zero_optimization.{key}"
            if key in _ZERO_KEYS:
                field = _ZERO_KEYS[key]
                values[field] = self.value(path, raw, field)
            elif key in ("offload_optimizer", "offload_param"):
                device = _section(path, raw).get("device", "none")
                if device not in OFFLOAD_DEVICES:
                    raise ValueError(
                        f"invalid DeepSpeed config: {path}.device {device!r} is not one of "
                        f"{list(OFFLOAD_DEVICES)} (NVMe offload is not supported)"
                    )
                values[key] = device
                self.ignored.extend(f"{path}.{k}" for k in _section(path, raw) if k != "device")
            elif key not in _ZERO_BUILT_IN:
                self.ignored.append(path)
        return values

    def read_precision(self, kind: str, section: Mapping[str, Any]) -> dict[str, Any]:
        enabled = section.get("enabled", False)
        if enabled == "auto":
            enabled = self.auto.get("mixed_precision", "no") == kind
        if enabled not in (True, False):
            raise ValueError(
                f'invalid DeepSpeed config: {kind}.enabled must be true, false or "auto", got {enabled!r}'
            )
        values: dict[str, Any] = {"mixed_precision": kind} if enabled else {}
        for key, raw in section.items():
            path = f"{kind}.{key}"
            if key == "enabled":
                continue
            if kind == "fp16" and key in _FP16_KEYS:
                values[_FP16_KEYS[key]] = self.value(path, raw, _FP16_KEYS[key])
            elif kind == "fp16" and key == "initial_scale_power":
                power = self.value(path, raw, "initial_scale_power")
                values["initial_loss_scale"] = 2.0**power if isinstance(power, (int, float)) else power
            elif kind == "fp16" and key == "loss_scale":
                scale = self.value(path, raw, "static_loss_scale")
                # DeepSpeed: 0 means dynamic loss scaling.
                values["static_loss_scale"] = None if scale in (0, 0.0, None) else scale
            else:
                self.ignored.append(path)
        return values


def _section(path: str, raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"invalid DeepSpeed config: {path} must be an object, got {raw!r}")
    return raw


def _default(field: str) -> Any:
    if field == "initial_scale_power":
        return 16
    return next(f.default for f in fields(ZeroConfig) if f.name == field)


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or (isinstance(value, bool) and not any(isinstance(a, bool) for a in allowed)):
        raise ValueError(f"ZeroConfig.{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ZeroConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float, inclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ValueError(f"ZeroConfig.{name} must be a number {bound}, got {value!r}")
