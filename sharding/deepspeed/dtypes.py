"""A DeepSpeed JSON's dtype keys (`communication_data_type`, `data_types`), checked against the compute
precision wherever that is settled: when the JSON is read, and again when a launcher fills a precision
the JSON leaves to it (`DeepSpeedConfig.with_mixed_precision`), so that neither "auto" nor a missing
precision section lets a dtype through that the run does not train with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .keys import COMMUNICATION_DTYPES
from .sections import as_section, suggest

# DeepSpeed's names for each dtype (its DtypeEnum), by the name tnlg's errors use.
DTYPE_NAMES = {
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "fp32": ("fp32", "float32", "float", "torch.float32"),
}
# data_types' dtype keys → what the engine does instead of casting, for the errors.
_DATA_TYPES = {
    "grad_accum_dtype": "accumulates gradients in the compute dtype's buffers",
    "param_dtype": "holds the parameters in the compute dtype",
}
_DATA_TYPE_KEYS = (*_DATA_TYPES, "buffer_dtype", "keep_in_fp32_modules")


def check_dtype_keys(keys: Mapping[str, Any], mixed_precision: str | None) -> None:
    """`keys`: the JSON's `communication_data_type` and `data_types` (absent: unset), checked at
    `mixed_precision` (a ZeroConfig's); None, a precision not settled yet: what holds at any precision
    (the keys' names and values), the dtypes against it later."""
    compute = None if mixed_precision is None else COMMUNICATION_DTYPES[mixed_precision]
    if compute is not None:
        _check_communication_dtype(keys.get("communication_data_type"), compute)
    _check_data_types(keys.get("data_types"), compute)


def _check_communication_dtype(raw: Any, compute: str) -> None:
    """tnlg reduces gradients in the compute dtype, as DeepSpeed does by default: any other is refused
    (named in any case, as DeepSpeed lower-cases it)."""
    if raw is None or raw == "auto" or (isinstance(raw, str) and raw.lower() == compute):
        return
    raise ValueError(
        f"invalid DeepSpeed config: communication_data_type = {json.dumps(raw)} is not supported (tnlg "
        f"communicates in the compute dtype, here {compute}); remove it or set it to {compute!r}"
    )


def _check_data_types(raw: Any, compute: str | None) -> None:
    """DeepSpeed's `data_types`: each dtype unset (null) or the compute dtype, which is what the engine
    does. fp32 gradient accumulation under bf16 (DeepSpeed's BF16_Optimizer at stage 1) is refused: the
    engine accumulates in the 16-bit buffers. A checkpoint DeepSpeed saved with it still loads."""
    if raw is None:
        return
    section = as_section("data_types", raw)
    unknown = [key for key in section if key not in _DATA_TYPE_KEYS]
    if unknown:
        named = ", ".join(f"data_types.{suggest(key, set(_DATA_TYPE_KEYS))}" for key in unknown)
        raise ValueError(
            f"invalid DeepSpeed config: unknown keys {named}; tnlg refuses keys it does not know rather than "
            "train without them"
        )
    for key in _DATA_TYPES:
        value = section.get(key)
        known = any(value in names for names in DTYPE_NAMES.values())
        if value is not None and not known:
            raise ValueError(
                f"invalid DeepSpeed config: data_types.{key} = {json.dumps(value)} is not a dtype (one of "
                f"{', '.join(names[0] for names in DTYPE_NAMES.values())}, or DeepSpeed's other names for them)"
            )
        if value is not None and compute is not None and value not in DTYPE_NAMES[compute]:
            raise ValueError(
                f"invalid DeepSpeed config: data_types.{key} = {json.dumps(value)} is not supported (tnlg "
                f"{_DATA_TYPES[key]}, here {compute}); remove it or set it to {compute!r}"
            )
    if section.get("buffer_dtype") is not None:
        raise ValueError(
            f"invalid DeepSpeed config: data_types.buffer_dtype = {json.dumps(section['buffer_dtype'])} is not "
            "supported (the engine leaves every buffer in the dtype it was loaded in); remove it or set it to null"
        )
    # Which buffers DeepSpeed's zero.Init keeps in fp32: the engine leaves every buffer in its own dtype,
    # so any valid value trains the same; DeepSpeed's own check of the value is kept.
    keep = section.get("keep_in_fp32_modules", "auto")
    if keep != "auto" and not (isinstance(keep, list) and all(isinstance(name, str) for name in keep)):
        raise ValueError(
            f'invalid DeepSpeed config: data_types.keep_in_fp32_modules must be "auto" or a list of name '
            f"patterns, got {json.dumps(keep)}"
        )
