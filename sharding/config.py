"""`ZeroConfig`: every setting of the ZeRO engine, validated, and the DeepSpeed JSON parser.

Sizes are in elements (as in DeepSpeed's JSON), not bytes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STAGES = (0, 1, 2, 3)
MIXED_PRECISIONS = ("no", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu")
FUSED_ADAM_CHOICES = ("auto", "cuda", "triton", "reference", "none")


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
    prefetch_bucket_size: stage 3: elements of upcoming blocks gathered ahead of their use; 0
        disables prefetching.
    param_persistence_threshold: stage 3: parameters with at most this many elements stay
        whole on every rank (gathering them costs more in latency than it saves in memory).
    max_live_parameters: stage 3: prefetching never takes the gathered elements above this; the
        block about to run is always gathered, and blocks kept for backward
        (`reshard_after_forward=False`) are not counted against it.
    reshard_after_forward: stage 3: free gathered blocks after their forward and gather them
        again in backward (ZeRO-3); False keeps them until their backward (more memory, less
        communication).
    offload_optimizer: `cpu` keeps fp32 master weights and optimizer state in CPU memory (stages 1-3).
    offload_param: `cpu` keeps the partitioned 16-bit parameters in CPU memory (stage 3).
    fused_adam: how a torch Adam / AdamW steps the device shards (offloaded ones always use
        `CPUAdam`): `auto` runs the fused kernel on CUDA (the CUDA extension, else Triton) and torch's
        own step elsewhere; `cuda`, `triton` or `reference` force that kernel (Triton on CPU tensors
        needs TRITON_INTERPRET=1); `none` always runs the user's optimizer.
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
    fused_adam: str = "auto"

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_field(field.name, getattr(self, field.name))
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
            # `gradient_clipping` is also a top-level DeepSpeed key: alone, it reads the same either way.
            if set(config) & (own - {"gradient_clipping"}):
                unknown = sorted(str(key) for key in set(config) - own)
                if unknown:
                    raise ValueError(f"not ZeroConfig fields: {', '.join(unknown)}")
                return cls(**config)
            return cls.from_deepspeed(config)
        raise TypeError(f"expected a ZeroConfig, a dict or a JSON path, got {type(config).__name__}")

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any] | str | Path, **auto: Any) -> ZeroConfig:
        """Parse a DeepSpeed config (dict or JSON file); logs the keys it ignores.

        `"auto"` values take the matching keyword from `auto` (e.g. `mixed_precision="bf16"` from
        the launcher; `initial_scale_power` too) or else the field's default; unknown keywords
        raise TypeError.
        """
        parsed, ignored = parse_deepspeed(config, **auto)
        if ignored:
            logger.warning("ZeroConfig.from_deepspeed ignores these keys: %s", ", ".join(ignored))
        return parsed


def parse_deepspeed(config: Mapping[str, Any] | str | Path, **auto: Any) -> tuple[ZeroConfig, list[str]]:
    """(`ZeroConfig`, ignored key paths) from a DeepSpeed config dict or JSON file."""
    source = "a DeepSpeed config"
    if isinstance(config, (str, Path)):
        path = Path(config)
        source = f"DeepSpeed config {path}"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, Mapping):
        raise ValueError(f"{source} must be a JSON object, got {type(config).__name__}")
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
        own = {f.name for f in fields(ZeroConfig)}
        unknown = sorted(set(auto) - own - {"initial_scale_power"})
        if unknown:
            raise TypeError(f'unknown keywords for "auto" values: {", ".join(unknown)}')
        for name, value in auto.items():
            if name in own:
                _check_field(name, value)
        self.auto = dict(auto)
        self.ignored: list[str] = []
        self.enabled: list[str] = []  # the 16-bit sections enabled, after "auto" resolution

    def resolve(self, raw: Any, field: str) -> Any:
        if isinstance(raw, str) and raw == "auto":
            return self.auto.get(field, _default(field))
        # JSON writers (and DeepSpeed's docs) spell sizes as 5e8: integral floats are integers.
        if isinstance(raw, float) and raw.is_integer() and type(_default(field)) is int:
            return int(raw)
        return raw

    def value(self, path: str, raw: Any, field: str) -> Any:
        """The resolved value of key `path` for `field`, checked (errors name `path`)."""
        value = self.resolve(raw, field)
        _check_at(path, field, value)
        return value

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
        if len(self.enabled) > 1:
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
                section = {} if raw is None else _section(path, raw)  # DeepSpeed: null = no offload
                device = section.get("device", "none")
                if not isinstance(device, str) or device not in OFFLOAD_DEVICES:
                    note = " (NVMe offload is not supported)" if device == "nvme" else ""
                    raise ValueError(
                        f"invalid DeepSpeed config: {path}.device must be one of "
                        f"{list(OFFLOAD_DEVICES)}, got {device!r}{note}"
                    )
                values[key] = device
                self.ignored.extend(f"{path}.{k}" for k in section if k != "device")
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
        if enabled:
            self.enabled.append(kind)
        for key, raw in section.items():
            path = f"{kind}.{key}"
            if key == "enabled":
                continue
            if kind == "fp16" and key in _FP16_KEYS:
                values[_FP16_KEYS[key]] = self.value(path, raw, _FP16_KEYS[key])
            elif kind == "fp16" and key == "initial_scale_power":
                power = self.resolve(raw, "initial_scale_power")
                if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power <= 1023:
                    raise ValueError(
                        f"invalid DeepSpeed config: {path} must be an integer in [0, 1023], got {power!r}"
                    )
                values["initial_loss_scale"] = 2.0**power
            elif kind == "fp16" and key == "loss_scale":
                scale = self.resolve(raw, "static_loss_scale")
                if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == 0:
                    scale = None  # DeepSpeed: 0 means dynamic loss scaling
                _check_at(path, "static_loss_scale", scale)
                values["static_loss_scale"] = scale
            else:
                self.ignored.append(path)
        return values


def _section(path: str, raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"invalid DeepSpeed config: {path} must be an object, got {raw!r}")
    return raw


def _check_at(path: str, field: str, value: Any) -> None:
    try:
        _check_field(field, value)
    except ValueError as error:
        raise ValueError(f"invalid DeepSpeed config: {path}: {error}") from error


def _default(field: str) -> Any:
    if field == "initial_scale_power":
        return 16
    return next(f.default for f in fields(ZeroConfig) if f.name == field)


_CHOICES = {
    "stage": STAGES,
    "mixed_precision": MIXED_PRECISIONS,
    "offload_optimizer": OFFLOAD_DEVICES,
    "offload_param": OFFLOAD_DEVICES,
    "fused_adam": FUSED_ADAM_CHOICES,
}
_INT_MINIMUMS = {
    "reduce_bucket_size": 1,
    "prefetch_bucket_size": 0,
    "max_live_parameters": 1,
    "loss_scale_window": 1,
    "hysteresis": 1,
    "param_persistence_threshold": 0,
}
_BOOLS = ("overlap_comm", "reshard_after_forward")
# field → (minimum, inclusive)
_NUMBERS = {
    "gradient_clipping": (0.0, True),
    "initial_loss_scale": (0.0, False),
    "min_loss_scale": (0.0, False),
    "static_loss_scale": (0.0, False),
}


def _check_field(name: str, value: Any) -> None:
    """Raise a ValueError naming the field unless `value` is valid for it (on its own)."""
    if name in _CHOICES:
        _check_choice(name, value, _CHOICES[name])
    elif name in _INT_MINIMUMS:
        _check_int(name, value, _INT_MINIMUMS[name])
    elif name in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"ZeroConfig.{name} must be True or False, got {value!r}")
    elif name == "static_loss_scale" and value is None:
        return
    else:
        _check_number(name, value, *_NUMBERS[name])


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    # Same type as well as equal: 2.0 or True is not a stage, whatever `2.0 == 2` says.
    if isinstance(value, bool) or not any(isinstance(value, type(a)) and value == a for a in allowed):
        raise ValueError(f"ZeroConfig.{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ZeroConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float, inclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (isinstance(value, int) or math.isfinite(value))
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ValueError(f"ZeroConfig.{name} must be a finite number {bound}, got {value!r}")
