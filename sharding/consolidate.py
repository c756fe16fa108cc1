"""Offline consolidation: an engine checkpoint (any world size, any stage) → one model's tensors.

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
from pathlib import Path

import torch
from safetensors.torch import save_file

from tnlg.modeling.loading import remove_weight_files, write_checksums

from .checkpoint import UNMANAGED_PREFIX, CheckpointError, ShardReader, read_manifest, saved_params

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
    manifest = read_manifest(checkpoint)
    reader = ShardReader(checkpoint, manifest, verify)
    params = saved_params(manifest)
    names = [*params, *manifest.get("unmanaged", [])]

    def tensor(name: str) -> torch.Tensor:
        if name in params:
            value = reader.full_param(name, params[name])
        else:
            value = reader.tensor(0, UNMANAGED_PREFIX + name)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value

    def nbytes(name: str) -> int:
        if name in params:
            return params[name].numel * (torch.finfo(dtype).bits // 8 if dtype is not None else 4)
        sliced = reader.file(0).get_slice(UNMANAGED_PREFIX + name)
        element = torch.finfo(dtype).bits // 8 if dtype is not None else _element_size(sliced.get_dtype())
        return int(torch.Size(sliced.get_shape()).numel()) * element

    limit = parse_size(max_shard_size)
    sizes = {name: nbytes(name) for name in names}
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        tensor_bytes = sizes[name]
        if shards[-1] and size + tensor_bytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor_bytes
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
            {name: tensor(name).contiguous() for name in members}, output / file, metadata={"format": "pt"}
        )
        written.append(output / file)
        weight_map.update(dict.fromkeys(members, file))
    if len(shards) > 1:
        index_file = output / "model.safetensors.index.json"
        total = sum(sizes.values())
        index_file.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        written.append(index_file)
    written.append(write_checksums(output, [path.name for path in written if path.suffix == ".safetensors"]))
    if (checkpoint / "config.json").is_file():
        shutil.copyfile(checkpoint / "config.json", output / "config.json")
        written.append(output / "config.json")
    return written


def _element_size(safetensors_dtype: str) -> int:
    if safetensors_dtype == "BOOL":
        return 1
    bits = re.search(r"(\d+)", safetensors_dtype)
    if bits is None:
        raise CheckpointError(f"unknown safetensors dtype {safetensors_dtype!r}")
    return max(1, int(bits.group(1)) // 8)
