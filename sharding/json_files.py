"""JSON files of checkpoints and configs: read with an error that names the file, written durably.

One reader serves every JSON a checkpoint or a config is made of (the engine's manifest, a DeepSpeed
config, a run checkpoint's state files): each caller passes the error type its own callers catch
(`CheckpointError`, which the engine's ranks agree on; `ValueError` for a config), so a missing,
truncated or binary file never surfaces as a bare `JSONDecodeError` that names no file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json(path: Path, error: type[Exception], what: str) -> Any:
    """The JSON value in `path`. A missing file, one that cannot be read, or one that is not UTF-8 JSON
    raises `error` with a message naming the file and `what` it holds (e.g. "the engine manifest")."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path} is missing ({what})") from None
    except OSError as problem:  # permissions, a directory in its place: named as a missing one is
        raise error(f"{path} cannot be read ({what}): {type(problem).__name__}: {problem}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as problem:
        raise error(f"{path} is not valid JSON ({problem}): {what} is truncated or damaged") from None


def write_json(path: Path, value: Any, **options: Any) -> None:
    """`value` as JSON in `path` (`options`: `json.dumps`'s), on disk before this returns: a checkpoint
    that says it is complete is. A value JSON cannot hold raises (TypeError, ValueError) before the file
    is opened, so no partial file is left."""
    text = json.dumps(value, **options)
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_json_atomic(path: Path, value: Any, **options: Any) -> None:
    """`write_json` into a staging file renamed over `path`: a reader sees the old file or the new one."""
    staging = path.with_name(path.name + ".tmp")
    write_json(staging, value, **options)
    os.replace(staging, path)
