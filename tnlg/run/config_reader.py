"""Reading run configurations: YAML files and dotted command-line overrides into typed dataclasses, with
unknown keys and values of the wrong type refused by their dotted path (the sections themselves are in
tnlg.run.config and tnlg.run.finetune_config)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def require(name: str, value: Any, ok: bool, expected: str) -> None:
    """Raise a ValueError naming the setting unless `ok`."""
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def choose(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    require(name, value, value in allowed, f"one of {list(allowed)}")


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """A `cls` config (a dataclass of sections) from a YAML file (or the defaults) with overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml(Path(path))
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(
                f"{path}: a run config must be a mapping of sections, got {type(loaded).__name__}"
            )
        raw = loaded or {}
    for dotted, value in _pairs(overrides or []):
        try:
            parsed = yaml.load(value, Loader=_ConfigLoader)  # a SafeLoader
        except yaml.YAMLError as error:
            raise ValueError(
                f"override --{dotted} {value!r} is not a YAML value: {_first_line(error)}"
            ) from None
        _set_dotted(raw, dotted, parsed)
    return build(cls, raw, "")


@dataclass(frozen=True)
class SpelledBool:
    """A YAML 1.1 boolean (yes / no / on / off / true / false, any case) with the text it was written as.

    [Note: YAML booleans in text fields]
    YAML 1.1 (PyYAML's) reads `no`, `off` and `yes` as booleans, so `mixed_precision: no` (or
    `--train.mixed_precision no`) would reach a text field as False. Config files and command-line
    values are both read with `_ConfigLoader`, which keeps the spelling: a field that takes text gets the
    text the user typed, a boolean field (or a free mapping, e.g. model.overrides) the boolean.
    """

    value: bool
    text: str


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that booleans keep their spelling (see SpelledBool)."""


def _spelled_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> SpelledBool:
    return SpelledBool(loader.construct_yaml_bool(node), node.value)


_ConfigLoader.add_constructor("tag:yaml.org,2002:bool", _spelled_bool)


def _plain(value: Any) -> Any:
    """`value` with every SpelledBool (at any depth) its boolean: what a free-form mapping holds."""
    if isinstance(value, SpelledBool):
        return value.value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_yaml(path: Path) -> Any:
    """A YAML file's contents; a missing, unreadable, binary or malformed file is one ValueError naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        return yaml.load(path.read_bytes().decode("utf-8"), Loader=_ConfigLoader)  # a SafeLoader
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not a YAML file: not UTF-8 text (byte {error.start})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _pairs(arguments: list[str]) -> list[tuple[str, str]]:
    pairs, index = [], 0
    while index < len(arguments):
        key = arguments[index]
        if not key.startswith("--"):
            raise ValueError(f"expected an override like --train.max_steps 20, got {key!r}")
        if "=" in key:
            name, value = key[2:].split("=", 1)
            index += 1
        else:
            if index + 1 >= len(arguments):
                raise ValueError(f"override {key} has no value")
            name, value = key[2:], arguments[index + 1]
            index += 2
        pairs.append((name, value))
    return pairs


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ValueError(f"override --{dotted}: {part} is not a section")
    target[leaf] = value


def build(cls: type, raw: Any, path: str) -> Any:
    """`cls` (a dataclass) from a mapping, recursively; errors name the dotted path of the key."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path or 'config'}: expected a mapping, got {_plain(raw)!r}")
    # a key is a name: `yes:` or `off:` as a key is its text (see SpelledBool)
    raw = {key.text if isinstance(key, SpelledBool) else key: value for key, value in raw.items()}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        where = f"{path}." if path else ""
        moved = getattr(cls, "moved_keys", {}).get(unknown[0])
        close = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1)
        hint = f" (it is {moved})" if moved else f" (did you mean {where}{close[0]}?)" if close else ""
        raise ValueError(
            f"unknown config key {where}{unknown[0]}{hint}; {path or 'the config'} has: {sorted(known)}"
        )
    values = {
        name: _convert(hints[name], value, f"{path}.{name}" if path else name) for name, value in raw.items()
    }
    return cls(**values)


def _convert(hint: Any, value: Any, path: str) -> Any:
    """`value` as the field's type `hint` (a section, an optional, a list, a mapping or a scalar)."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(typing.get_args(hint), value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {_plain(value)!r}")
        (item,) = typing.get_args(hint)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {_plain(value)!r}")
        return _plain(value)
    if hint is Any:
        return _plain(value)
    return _convert_scalar(hint, value, path)


def _convert_union(options: tuple[Any, ...], value: Any, path: str) -> Any:
    """The first option `value` converts to; None where the union allows it; else the first error."""
    if value is None and type(None) in options:
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _convert(option, value, path)
        except ValueError as error:
            errors.append(str(error))
    raise ValueError(errors[0])


def _convert_scalar(hint: Any, value: Any, path: str) -> Any:
    if isinstance(value, SpelledBool):  # see [Note: YAML booleans in text fields]
        if hint is str:
            return value.text
        value = value.value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML reads 1e-3 (no decimal point) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and not (
        isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    ):
        raise ValueError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value
