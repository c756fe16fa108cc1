"""A state_dict as JSON plus a safetensors file, decoded to the same structure and values: no pickles.

What `register_for_checkpointing` objects and stateful data loaders hand `save_state` is any nesting of
dicts, lists, tuples, tensors and scalars. JSON alone would change some of it without a word: it turns
a tuple into a list and an integer key into a string, and a torch optimizer registered for
checkpointing (its `state` is keyed by parameter index) then loads its moments under "0", "1", ...,
which it never reads again, and restarts Adam silently. So what JSON cannot say is written as a marked
object, each a JSON object with one key:

    {"__tensor__": "3"}              the tensor stored under key "3" of the safetensors file
    {"__tuple__": [...]}             a tuple
    {"__items__": [[key, value]]}    a dict with a key that is not a string (int, float, bool, None, tuple)

A dict with string keys stays a JSON object, so a file written before the tuple and key markers existed
(tensors only) decodes as it did. What comes back is plain: tensors contiguous on the CPU (not
Parameters, no shared storage, as load_state_dict copies them), named tuples as tuples, enum keys as
their values. A value none of this holds (an open file, a set) is a `CheckpointError`
naming the state, raised while encoding, before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from tnlg.sharding.checkpoint import CheckpointError
from tnlg.sharding.json_files import read_json

TENSOR_KEY = "__tensor__"
TUPLE_KEY = "__tuple__"
ITEMS_KEY = "__items__"
_MARKERS = (TENSOR_KEY, TUPLE_KEY, ITEMS_KEY)


def encoded_state(state: Any, what: str) -> tuple[bytes, bytes | None]:
    """`state` as (JSON bytes, safetensors bytes or None when it holds no tensor); `what` names it in
    the `CheckpointError` for a value neither can hold."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _taken_apart(state, tensors, what)
    try:
        text = json.dumps(structure, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what} cannot be saved: {error}") from error
    if not tensors:
        return text, None
    try:
        return text, safetensors_bytes(tensors)
    except (TypeError, ValueError, SafetensorError) as error:  # a sparse tensor, say
        raise CheckpointError(f"{what} cannot be saved as safetensors: {error}") from error


def decoded_state(json_path: Path, tensor_path: Path) -> Any:
    """What `encoded_state` wrote to `json_path` (and `tensor_path`, when it exists), as it was given."""
    tensors: dict[str, torch.Tensor] = {}
    if tensor_path.exists():
        try:
            tensors = load_file(tensor_path)
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"{tensor_path} cannot be read: {error}") from error
    return _put_together(
        read_json(json_path, CheckpointError, "a file of the checkpoint"), tensors, json_path
    )


def _taken_apart(value: Any, tensors: dict[str, torch.Tensor], what: str) -> Any:
    """`value` with each tensor moved into `tensors` (a CPU copy of its own: safetensors refuses shared
    storage) and tuples and non-string keys marked; other values are left for json to accept or refuse."""
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {TENSOR_KEY: key}
    if isinstance(value, Mapping):
        if all(isinstance(key, str) for key in value):
            _refuse_a_marker_key(value, what)
            return {key: _taken_apart(item, tensors, what) for key, item in value.items()}
        return {
            ITEMS_KEY: [[_key(key, what), _taken_apart(item, tensors, what)] for key, item in value.items()]
        }
    if isinstance(value, tuple):
        return {TUPLE_KEY: [_taken_apart(item, tensors, what) for item in value]}
    if isinstance(value, list):
        return [_taken_apart(item, tensors, what) for item in value]
    return value


def _key(key: Any, what: str) -> Any:
    """A dict key in a form that reads back equal: a scalar as itself, a tuple marked."""
    if key is None or isinstance(key, str | int | float | bool):
        return key
    if isinstance(key, tuple):
        return {TUPLE_KEY: [_key(item, what) for item in key]}
    raise CheckpointError(
        f"{what} cannot be saved: a dict key {key!r} ({type(key).__name__}) is not a scalar or tuple"
    )


def _refuse_a_marker_key(value: Mapping[str, Any], what: str) -> None:
    """A dict of one marker key would read back as the marked value, not as itself."""
    if len(value) == 1 and next(iter(value)) in _MARKERS:
        raise CheckpointError(
            f"{what} cannot be saved: it holds a dict whose only key is {next(iter(value))!r}"
        )


def _put_together(value: Any, tensors: Mapping[str, torch.Tensor], path: Path) -> Any:
    if isinstance(value, list):
        return [_put_together(item, tensors, path) for item in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {TENSOR_KEY}:
        key = value[TENSOR_KEY]
        if key not in tensors:
            raise CheckpointError(
                f"{path} refers to tensor {key!r}, which its .safetensors file does not hold"
            )
        return tensors[key]
    if value.keys() == {TUPLE_KEY}:
        return tuple(_put_together(item, tensors, path) for item in value[TUPLE_KEY])
    if value.keys() == {ITEMS_KEY}:
        return {
            _put_together(key, {}, path): _put_together(item, tensors, path) for key, item in value[ITEMS_KEY]
        }
    return {key: _put_together(item, tensors, path) for key, item in value.items()}
