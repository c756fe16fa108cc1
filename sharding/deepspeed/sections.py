"""The `ZeroConfig` part of a DeepSpeed config: `SectionReader` walks the zero_optimization, bf16 and fp16
sections (and the top-level gradient_clipping) with the tables of keys.py, and `apply_overrides` sets
fields given elsewhere (a run config, a command line) over what it read. The rest of the JSON (the top
level, optimizer, scheduler): reader.py."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from ..config import OFFLOAD_DEVICES, ZeroConfig, check_field
from .keys import (
    BF16_RULES,
    FP16_KEYS,
    FP16_RULES,
    OFFLOAD_RULES,
    ZERO_KEYS,
    ZERO_RULES,
    KeyRule,
    same_value,
)


class SectionReader:
    """Reads the ZeroConfig part of one DeepSpeed config. It records which key set each field (for
    `apply_overrides`), the keys it reads but ignores (path, why) and every unknown key, so that one
    error can name them all."""

    def __init__(self, auto: Mapping[str, Any], extra_auto: Iterable[str] = ()):
        own = {f.name for f in fields(ZeroConfig)}
        unknown = sorted(set(auto) - own - {"initial_scale_power"} - set(extra_auto))
        if unknown:
            raise TypeError(f'unknown keywords for "auto" values: {", ".join(unknown)}')
        for name, value in auto.items():
            if name in own:
                check_field(name, value)
        self.auto = dict(auto)
        self.values: dict[str, Any] = {}
        self.sources: dict[str, tuple[str, Any]] = {}  # field -> (key path, value as written)
        self.ignored: list[tuple[str, str]] = []
        self.unknown: list[str] = []
        self.enabled: list[str] = []  # the 16-bit sections enabled, after "auto" resolution

    # ------------------------------------------------------------------ values
    def resolve(self, raw: Any, field: str) -> Any:
        if isinstance(raw, str) and raw == "auto":
            return self.auto.get(field, _default(field))
        # JSON writers (and DeepSpeed's docs) spell sizes as 5e8: integral floats are integers.
        if isinstance(raw, float) and raw.is_integer() and type(_default(field)) is int:
            return int(raw)
        return raw

    def set(self, path: str, raw: Any, field: str, value: Any = None, resolved: bool = False) -> None:
        """Field `field` from key `path` (errors name `path`); "auto" leaves the field to the launcher."""
        value = value if resolved else self.resolve(raw, field)
        check_at(path, field, value)
        self.values[field] = value
        if not (isinstance(raw, str) and raw == "auto"):
            self.sources[field] = (path, raw)

    def rule(self, path: str, raw: Any, rule: KeyRule) -> None:
        """A key tnlg reads but does not act on: logged if ignoring it is exact, else an error."""
        if not rule.accepts(raw):
            fix = f"remove it or set it to {rule.expected}" if rule.expected else "remove it"
            raise ValueError(
                f"invalid DeepSpeed config: {path} = {json.dumps(raw, default=str)} is not supported "
                f"({rule.why}); {fix}"
            )
        self.ignored.append((path, rule.why))

    def other(
        self, path: str, key: str, raw: Any, rules: Mapping[str, KeyRule], known: Iterable[str]
    ) -> None:
        """A key the section does not apply: a known one (`rules`), else an unknown one."""
        if key in rules:
            self.rule(path, raw, rules[key])
        else:
            prefix = path[: len(path) - len(key)]
            self.unknown.append(prefix + suggest(key, set(known) | set(rules)))

    # ------------------------------------------------------------------ sections
    def read_zero(self, section: Mapping[str, Any]) -> None:
        for key, raw in section.items():
            path = f"zero_optimization.{key}"
            if key in ZERO_KEYS:
                self.set(path, raw, ZERO_KEYS[key])
            elif key in ("offload_optimizer", "offload_param"):
                self.read_offload(path, key, raw)
            else:
                self.other(path, key, raw, ZERO_RULES, [*ZERO_KEYS, "offload_optimizer", "offload_param"])

    def read_offload(self, path: str, field: str, raw: Any) -> None:
        section = {} if raw is None else as_section(path, raw)  # DeepSpeed: null = no offload
        device = section.get("device", "none")
        if not isinstance(device, str) or device not in OFFLOAD_DEVICES:
            note = " (NVMe offload is not supported)" if device == "nvme" else ""
            raise ValueError(
                f"invalid DeepSpeed config: {path}.device must be one of "
                f"{list(OFFLOAD_DEVICES)}, got {device!r}{note}"
            )
        self.set(f"{path}.device", device, field)
        for key, value in section.items():
            if key != "device":
                self.other(f"{path}.{key}", key, value, OFFLOAD_RULES[field], ["device"])

    def read_precision(self, kind: str, section: Mapping[str, Any]) -> None:
        """`kind`: "bf16" or "fp16" (the section's key, "bfloat16" read as "bf16")."""
        self._read_enabled(kind, section.get("enabled", False))
        for key, raw in section.items():
            path = f"{kind}.{key}"
            if key == "enabled":
                continue
            if kind == "fp16":
                self._read_fp16_key(path, key, raw)
            else:
                self.other(path, key, raw, BF16_RULES, ["enabled"])

    def _read_enabled(self, kind: str, enabled: Any) -> None:
        if enabled == "auto":
            enabled = self.auto.get("mixed_precision", "no") == kind
        elif enabled is True:
            self.sources["mixed_precision"] = (f"{kind}.enabled", True)
        if enabled not in (True, False):
            raise ValueError(
                f'invalid DeepSpeed config: {kind}.enabled must be true, false or "auto", got {enabled!r}'
            )
        if enabled:
            self.enabled.append(kind)
            self.values["mixed_precision"] = kind

    def _read_fp16_key(self, path: str, key: str, raw: Any) -> None:
        """One key of the fp16 section other than `enabled`."""
        if key in FP16_KEYS:
            self.set(path, raw, FP16_KEYS[key])
        elif key == "initial_scale_power":
            power = self.resolve(raw, "initial_scale_power")
            if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power <= 1023:
                raise ValueError(
                    f"invalid DeepSpeed config: {path} must be an integer in [0, 1023], got {power!r}"
                )
            self.set(path, raw, "initial_loss_scale", 2.0**power, resolved=True)
        elif key == "loss_scale":
            scale = self.resolve(raw, "static_loss_scale")
            if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == 0:
                scale = None  # DeepSpeed: 0 means dynamic loss scaling
            self.set(path, raw, "static_loss_scale", scale, resolved=True)
        else:
            self.other(
                path, key, raw, FP16_RULES, ["enabled", "loss_scale", "initial_scale_power", *FP16_KEYS]
            )

    def zero_config(self, defaults: Mapping[str, Any] | None = None) -> ZeroConfig:
        """The ZeroConfig of the keys read, `defaults` filling the fields they leave unset."""
        if len(self.enabled) > 1:
            raise ValueError("invalid DeepSpeed config: bf16.enabled and fp16.enabled are both true")
        try:
            return ZeroConfig(**{**(defaults or {}), **self.values})
        except ValueError as error:
            raise ValueError(f"invalid DeepSpeed config: {error}") from error


def as_section(path: str, raw: Any) -> Mapping[str, Any]:
    """The object at key `path` (a section), else an error naming the key."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"invalid DeepSpeed config: {path} must be an object, got {raw!r}")
    return raw


def check_at(path: str, field: str, value: Any) -> None:
    try:
        check_field(field, value)
    except ValueError as error:
        raise ValueError(f"invalid DeepSpeed config: {path}: {error}") from error


def _default(field: str) -> Any:
    if field == "initial_scale_power":
        return 16
    return next(f.default for f in fields(ZeroConfig) if f.name == field)


# ---------------------------------------------------------------------------------------------------
# Fields given elsewhere, over what a DeepSpeed config set (`DeepSpeedConfig.with_overrides`).


def apply_overrides(
    zero: ZeroConfig,
    sources: Mapping[str, tuple[str, Any]],
    source: str,
    overrides: Mapping[str, Any],
    names: Mapping[str, str],
) -> ZeroConfig:
    """`zero` with `overrides` applied to the fields the DeepSpeed config leaves unset; an override of a
    field it sets (`sources`: field -> (key path, value as written)) must agree with it."""
    own = {f.name for f in fields(ZeroConfig)}
    unknown = sorted(set(overrides) - own)
    if unknown:
        raise TypeError(
            f"overrides that are not ZeroConfig fields: {', '.join(suggest(k, own) for k in unknown)}"
        )
    changes: dict[str, Any] = {}
    for field, value in overrides.items():
        name = names.get(field, field)
        try:
            check_field(field, value)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error
        if field not in sources:
            changes[field] = value
            continue
        current = getattr(zero, field)
        if not same_value(value, current):
            path, raw = sources[field]
            written = f"{path} {raw!r}" + ("" if same_value(raw, current) else f" (= {field} {current!r})")
            raise ValueError(
                f"{name} {value!r} conflicts with {written} in {source}: change one of them to agree "
                "with the other"
            )
    try:
        return zero.replace(**changes)
    except ValueError as error:
        shown = ", ".join(f"{names.get(k, k)}={v!r}" for k, v in changes.items())
        raise ValueError(f"{source} with {shown}: {error}") from error


def suggest(key: str, known: Iterable[str]) -> str:
    """`key`, with the closest known key when there is one: "stgae (did you mean 'stage'?)"."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"{key} (did you mean {close[0]!r}?)" if close else key
