"""Offline consolidation: an engine checkpoint (any world size, stage, tensor degree, pipeline stages) →
one model's tensors.

    consolidate(checkpoint_dir, output_dir, max_shard_size="5GB", dtype=torch.bfloat16)

writes Transformers' sharded safetensors layout (`model-00001-of-0000N.safetensors` plus
`model.safetensors.index.json`, or one `model.safetensors`), records each file's sha256 in
`tnlg_checksums.json` (as `save_pretrained` does: [Note: checksums] in tnlg/modeling/loading.py) and
copies the checkpoint's `config.json`, so `from_pretrained` loads the result and verifies it. The
output directory's previous weights are removed first: a stale `model.safetensors` next to new
shards would be what `from_pretrained` loads. Tensors are assembled one at a time from the
rank files' slices (see [Note: reshaping] in checkpoint.py) and written shard by shard: peak memory
is about one output shard, never the whole model.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tnlg.modeling.loading import remove_weight_files, write_checksums

from .checkpoint import CheckpointError, SavedCheckpoint

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5GB", "500MB" or "2GiB"."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * UNITS[match.group(2) or ""])


def consolidate(
    checkpoint: str | Path,
    output: str | Path,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> list[Path]:
    """Write the checkpoint's parameters (fp32 masters, or cast to `dtype`) and its unsharded module
    state as a Transformers model directory; returns the files written."""
    checkpoint, output = Path(checkpoint), Path(output)
    _refuse_writing_into(checkpoint, output)
    tensors = _SavedTensors(checkpoint, dtype, verify)
    sizes = {name: tensors.nbytes(name) for name in tensors.names}
    written = write_shards(output, tensors.names, tensors.read, sizes, max_shard_size)
    written.append(write_checksums(output, [path.name for path in written if path.suffix == ".safetensors"]))
    if (checkpoint / "config.json").is_file():
        shutil.copyfile(checkpoint / "config.json", output / "config.json")
        written.append(output / "config.json")
    return written


def _refuse_writing_into(checkpoint: Path, output: Path) -> None:
    """ValueError when `output` is the checkpoint directory or inside it: the previous weights are
    removed from the output first, and its files would be mixed with the checkpoint's."""
    source, target = checkpoint.resolve(), output.resolve()
    if source == target or source in target.parents:
        raise ValueError(
            f"consolidating {checkpoint} into {output} would write into the checkpoint itself: name an "
            "output directory outside it"
        )


def write_shards(
    output: Path,
    names: list[str],
    read: Callable[[str], torch.Tensor],
    sizes: dict[str, int],
    max_shard_size: int | str,
) -> list[Path]:
    """Transformers' safetensors layout of `names` in `output`: one `model.safetensors`, or shards of at
    most `max_shard_size` bytes (`sizes`) with their index. Each tensor is `read` when its shard is
    written, so peak memory is about one shard. The directory's previous weights are removed first."""
    shards = _pack(names, sizes, parse_size(max_shard_size))
    output.mkdir(parents=True, exist_ok=True)
    remove_weight_files(output)
    written, weight_map = [], {}
    for index, members in enumerate(shards):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(
            {name: read(name).contiguous() for name in members}, output / file, metadata={"format": "pt"}
        )
        written.append(output / file)
        weight_map.update(dict.fromkeys(members, file))
    if len(shards) > 1:
        index_file = output / "model.safetensors.index.json"
        index_file.write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2)
        )
        written.append(index_file)
    return written


class _SavedTensors:
    """The checkpoint's tensors by their module names, each assembled on demand from the rank files'
    slices: the sharded parameters from their fp32 masters, the rest from rank 0's file; with tensor
    slicing and pipeline stages, from the sub-checkpoint of the stage and tensor rank holding each (see
    [Note: sliced checkpoints] and [Note: pipeline checkpoints] in checkpoint.py)."""

    def __init__(self, checkpoint: Path, dtype: torch.dtype | None, verify: bool):
        self.saved = SavedCheckpoint(checkpoint, verify)
        self.names = [*self.saved.names, *self.saved.unmanaged]
        self.dtype = dtype

    def read(self, name: str) -> torch.Tensor:
        if name in self.saved.shapes:
            value = self.saved.full_param(name)
        else:
            value = self.saved.unmanaged_tensor(name)
        return value.to(self.dtype) if self.dtype is not None and value.is_floating_point() else value

    def nbytes(self, name: str) -> int:
        """What `read(name)` will hold, from the manifests and the file headers alone."""
        dtype_bytes = torch.finfo(self.dtype).bits // 8 if self.dtype is not None else None
        if name in self.saved.shapes:
            return self.saved.numel(name) * (dtype_bytes or 4)
        sliced = self.saved.unmanaged_slice(name)
        element = dtype_bytes or _element_size(sliced.get_dtype())
        return int(torch.Size(self.saved.unmanaged_shape(name)).numel()) * element


def _pack(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """`names` in order, cut into shards of at most `limit` bytes (a larger tensor gets a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + sizes[name] > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


def _element_size(safetensors_dtype: str) -> int:
    if safetensors_dtype == "BOOL":
        return 1
    bits = re.search(r"(\d+)", safetensors_dtype)
    if bits is None:
        raise CheckpointError(f"unknown safetensors dtype {safetensors_dtype!r}")
    return max(1, int(bits.group(1)) // 8)
