"""Reading a DeepSpeed config (dict or JSON file) whole, and the front doors that settle any form of engine
config once: `engine_settings` (-> `DeepSpeedConfig`, for `initialize`), `zero_config_from` and
`zero_config_from_deepspeed` (-> its `ZeroConfig` part only). The top level, optimizer and scheduler
sections are read here; the ZeroConfig sections by sections.py; the key tables are keys.py's (see
[Note: DeepSpeed keys] there)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config import ZeroConfig
from ..json_files import read_json
from .dtypes import check_dtype_keys
from .keys import (
    ADAM_PARAMS,
    ADAM_RULES,
    BATCH_KEYS,
    OPTIMIZER_RULES,
    REQUIRED_SCHEDULER_PARAMS,
    SCHEDULER_PARAMS,
    SCHEDULER_RULES,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    TOP_LEVEL_KEYS,
    TOP_RULES,
    TOP_ZERO_KEYS,
    KeyRule,
    integer,
)
from .sections import SectionReader, as_section, suggest
from .settings import DeepSpeedConfig, OptimizerSpec, SchedulerSpec, TrainingConfig

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# The front doors: a config in any of its forms, settled into typed values here and only here.
def engine_settings(
    config: DeepSpeedConfig | ZeroConfig | Mapping[str, Any] | str | Path | None, **auto: Any
) -> DeepSpeedConfig:
    """Any engine config as a `DeepSpeedConfig`: a DeepSpeed config (dict or JSON file, `auto` filling its
    "auto" values), or a ZeroConfig, a dict of its fields or a JSON file of them (no training part)."""
    if isinstance(config, DeepSpeedConfig):
        return config
    if config is None or isinstance(config, ZeroConfig):
        return DeepSpeedConfig(ZeroConfig() if config is None else config)
    if not isinstance(config, (str, Path, Mapping)):
        raise TypeError(f"expected a ZeroConfig, a dict or a JSON path, got {type(config).__name__}")
    config, source = _read_config(config)
    with _naming(source):
        if mapping_kind(config) == "fields":
            return DeepSpeedConfig(ZeroConfig(**config), source=source)
        return _load(config, source, auto)


def zero_config_from(config: ZeroConfig | Mapping[str, Any] | str | Path | None) -> ZeroConfig:
    """A `ZeroConfig` from None (its defaults), itself, a dict (or JSON file) of its fields, or a DeepSpeed
    config dict or JSON file.

    A DeepSpeed config is read whole and checked (see [Note: DeepSpeed keys] in keys.py); only its
    ZeroConfig part is returned: the training part (batch sizes, optimizer, scheduler) is the engine's,
    through `initialize(model, optimizer, path_or_dict)`.
    """
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    # A bare ZeroConfig keeps no dtype keys: they are checked here, at the precision the JSON gives
    return engine_settings(config).with_checked_dtypes().zero


def zero_config_from_deepspeed(
    config: Mapping[str, Any] | str | Path,
    *,
    overrides: Mapping[str, Any] | None = None,
    override_names: Mapping[str, str] | None = None,
    **auto: Any,
) -> ZeroConfig:
    """The ZeroConfig part of a DeepSpeed config (dict or JSON file), every key checked.

    Unknown keys are errors naming the key path; keys that cannot change training results are
    logged once at INFO (see [Note: DeepSpeed keys] in keys.py). `"auto"` values take the
    matching keyword from `auto` (e.g. `mixed_precision="bf16"` from the launcher;
    `initial_scale_power` too) or else the field's default; unknown keywords raise TypeError.

    `overrides` are ZeroConfig fields set elsewhere (a run config, a command line): a field the JSON
    sets to a different value is a ValueError naming both (`override_names` gives each field's
    name in the error, e.g. {"stage": "--zero.stage"}); fields the JSON leaves unset (or "auto")
    take the override.
    """
    return (
        load_deepspeed(config, **auto)
        .with_overrides(overrides or {}, override_names)
        .with_checked_dtypes()
        .zero
    )


def mapping_kind(config: Mapping[str, Any]) -> str:
    """Whether a dict holds ZeroConfig fields ("fields") or is a DeepSpeed config ("deepspeed"); a dict
    that mixes the two, or whose keys are neither, is a ValueError naming the keys."""
    own = {f.name for f in fields(ZeroConfig)}
    keys = {str(key) for key in config}
    # `gradient_clipping` is both a field and a top-level DeepSpeed key: alone, it reads the same either way
    # (the reader keeps ZeroConfig's loss-scale counting for it, whichever way it is read).
    field_keys = sorted(keys & own - {"gradient_clipping"})
    deepspeed_keys = sorted(keys & TOP_LEVEL_KEYS - {"gradient_clipping"})
    if field_keys and deepspeed_keys:
        raise ValueError(
            f"a config dict mixes ZeroConfig fields ({', '.join(field_keys)}) and DeepSpeed keys "
            f"({', '.join(deepspeed_keys)}): use one or the other"
        )
    if deepspeed_keys or keys <= {"gradient_clipping"}:
        return "deepspeed"
    unknown = sorted(keys - own)
    if unknown:
        known = own if field_keys else own | TOP_LEVEL_KEYS
        what = "ZeroConfig fields" if field_keys else "ZeroConfig fields or DeepSpeed keys"
        raise ValueError(f"not {what}: {', '.join(suggest(key, known) for key in unknown)}")
    return "fields"


# ---------------------------------------------------------------------------------------------------
# A DeepSpeed config read whole: the ZeroConfig sections through `SectionReader`, the rest here.
def load_deepspeed(
    config: Mapping[str, Any] | str | Path, *, defaults: Mapping[str, Any] | None = None, **auto: Any
) -> DeepSpeedConfig:
    """Read a DeepSpeed config (dict or JSON file) whole; see [Note: DeepSpeed keys] in keys.py.

    `defaults`: ZeroConfig fields for what the config leaves unset, in place of ZeroConfig's own (a
    run's default stage), applied before the fields are checked together; they do not count as the
    config's own (`zero_sources`).

    `"auto"` values take the matching keyword from `auto` (ZeroConfig fields, `initial_scale_power`,
    and the three batch keys) or else the default (ZeroConfig's; unset for batch keys). In the
    optimizer and scheduler sections "auto" is kept and refused when they are built: a launcher that
    owns those values (the HF Trainer) fills them, tnlg does not.
    """
    config, source = _read_config(config)
    with _naming(source):
        return _load(config, source, auto, defaults)


def parse_deepspeed(config: Mapping[str, Any] | str | Path, **auto: Any) -> tuple[ZeroConfig, list[str]]:
    """(`ZeroConfig`, key paths read and ignored) from a DeepSpeed config dict or JSON file."""
    loaded = load_deepspeed(config, **auto).with_checked_dtypes()  # the ZeroConfig keeps no dtype keys
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


def _load(
    config: Mapping[str, Any], source: str, auto: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> DeepSpeedConfig:
    reader = SectionReader(auto, extra_auto=BATCH_KEYS)
    training: dict[str, Any] = {}
    if "bf16" in config and "bfloat16" in config:
        raise ValueError("invalid DeepSpeed config: bf16 and bfloat16 (its old name) are both set")
    for key, raw in config.items():
        if key == "zero_optimization":
            reader.read_zero(as_section(key, raw))
        elif key in ("bf16", "bfloat16", "fp16"):
            reader.read_precision("fp16" if key == "fp16" else "bf16", as_section(key, raw))
        elif key in TOP_ZERO_KEYS:
            reader.set(key, raw, TOP_ZERO_KEYS[key])
        elif key in BATCH_KEYS:
            training[key] = _read_count(key, raw, auto)
        elif key == "optimizer":
            training["optimizer"] = _read_optimizer(as_section(key, raw), reader)
        elif key == "scheduler":
            training["scheduler"] = _read_scheduler(as_section(key, raw), reader)
        elif key not in ("communication_data_type", "data_types"):  # checked against the precision below
            reader.other(key, key, raw, TOP_RULES, TOP_LEVEL_KEYS)
    if reader.unknown:
        raise ValueError(
            f"invalid DeepSpeed config: unknown keys {', '.join(reader.unknown)}; tnlg refuses keys it does "
            "not know rather than train without them"
        )
    # The JSON's fp16 loss_scale_window counts as DeepSpeed's scaler counts it ([Note: loss-scale
    # counting]); a default, not the JSON's own setting, so that a run config's zero section may change it.
    # A lone gradient_clipping reads as ZeroConfig fields too (`mapping_kind`), and so keeps their count.
    counting = {"loss_scale_counting": "deepspeed"} if set(config) - {"gradient_clipping"} else {}
    zero = reader.zero_config({**counting, **(defaults or {})})
    dtype_keys = _dtype_keys(config, zero)
    loaded = DeepSpeedConfig(
        zero,
        TrainingConfig(**training),
        tuple(reader.ignored),
        dict(reader.sources),
        source,
        dtype_keys,
    )
    if loaded.ignored:
        logger.info(
            "%s: ignoring keys that cannot change training results: %s",
            source,
            "; ".join(f"{path} ({why})" for path, why in loaded.ignored),
        )
    return loaded


def _read_count(key: str, raw: Any, auto: Mapping[str, Any]) -> int | None:
    value = auto.get(key) if raw == "auto" else raw
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is not None and not integer(1)[0](value):
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
            reader.other(f"optimizer.{key}", key, raw, OPTIMIZER_RULES, ["type", "params"])
    params = _check_params(
        "optimizer.params",
        as_section("optimizer.params", section.get("params", {})),
        ADAM_PARAMS,
        ADAM_RULES,
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
        as_section("scheduler.params", section.get("params", {})),
        SCHEDULER_PARAMS[kind],
        SCHEDULER_RULES,
        reader,
    )
    missing = [name for name in REQUIRED_SCHEDULER_PARAMS.get(kind, ()) if name not in params]
    if missing:
        raise ValueError(
            f"invalid DeepSpeed config: scheduler {kind} needs params.{', params.'.join(missing)}"
        )
    return SchedulerSpec(kind, params)


def _dtype_keys(config: Mapping[str, Any], zero: ZeroConfig) -> dict[str, Any]:
    """The JSON's dtype keys, checked now against the precision it enables; a JSON that enables none may
    still have one filled by a launcher: their dtypes are checked where it is settled
    (`with_checked_dtypes`), the rest now."""
    keys = {key: config[key] for key in ("communication_data_type", "data_types") if key in config}
    check_dtype_keys(keys, None if zero.mixed_precision == "no" else zero.mixed_precision)
    return keys
