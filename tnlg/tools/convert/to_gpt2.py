"""TNLG → a plain Transformers GPT-2 directory: the way into the serving and evaluation ecosystem.

A TNLG decoder is GPT-2's architecture (learned positions, fused `[q|k|v]`, tanh GeLU by default,
pre-LayerNorm, tied head), so every `TNLGConfig` field has a `GPT2Config` field and every tensor a
GPT-2 name; the export writes `model_type: gpt2` with no `auto_map` and no modeling code, which
Transformers, lm-evaluation-harness, vLLM, TGI and llama.cpp's converter load with no tnlg installed.

    export_gpt2(model_or_directory, "out/gpt2")   # a TNLGForCausalLM, a saved model, or an engine checkpoint

Tensors are renamed and the matmul weights transposed back to GPT-2's `Conv1D` (in, out) layout
(`gpt2_state_dict_to_tnlg` inverted, from the same name tables). A tied output layer is not written:
GPT-2 ties `lm_head.weight` to `transformer.wte.weight` when it loads, as its own `save_pretrained`
leaves it out. A tensor with no GPT-2 name (an unmerged LoRA adapter's, say) is refused by name,
never dropped. From a saved directory or an engine checkpoint the tensors are read one at a time and
written shard by shard: peak memory is about one output shard.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import GenerationConfig, GPT2Config

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.loading import check_model_config
from tnlg.sharding.checkpoint import MANIFEST
from tnlg.sharding.consolidate import consolidate, write_shards
from tnlg.sharding.pretrained import SafetensorsCheckpoint

from .gpt2 import BLOCK_NAMES, CONFIG_NAMES, TOP_NAMES
from .outputs import refuse_a_used_directory
from .state_dicts import copy_tokenizer_files

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_TOP = {tnlg: gpt2 for gpt2, tnlg in TOP_NAMES.items()}
_IN_BLOCK = {tnlg: (gpt2, transpose) for gpt2, (tnlg, transpose) in BLOCK_NAMES.items()}
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def gpt2_config(config: TNLGConfig) -> GPT2Config:
    """The GPT-2 config computing the same function as `config` (`tnlg_config_from_gpt2` inverted).
    `fused_kernels` has no counterpart: it picks kernels, not results."""
    if getattr(config, "model_type", None) != "tnlg":
        raise ValueError(
            f"a GPT-2 export needs a TNLG config, got model_type {getattr(config, 'model_type', None)!r}"
        )
    return GPT2Config(
        **{gpt2: getattr(config, tnlg) for tnlg, gpt2 in CONFIG_NAMES.items()},
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        use_cache=config.use_cache,
        architectures=["GPT2LMHeadModel"],  # what vLLM and TGI pick the model class by
    )


def gpt2_name(name: str) -> tuple[str, bool] | None:
    """GPT2LMHeadModel's name for TNLG tensor `name` and whether its layout is transposed (Linear's
    (out, in) to Conv1D's (in, out)); None for a name GPT-2 has no place for."""
    if name == "lm_head.weight":
        return name, False
    if name in _TOP:
        return f"transformer.{_TOP[name]}", False
    layer = _LAYER.match(name)
    if layer and layer.group(2) in _IN_BLOCK:
        target, transpose = _IN_BLOCK[layer.group(2)]
        return f"transformer.h.{layer.group(1)}.{target}", transpose
    return None


def tnlg_state_to_gpt2(state: Mapping[str, torch.Tensor], tied: bool = False) -> dict[str, torch.Tensor]:
    """A TNLG state dict in GPT2LMHeadModel's names and layout; with `tied`, without `lm_head.weight`
    (GPT-2 ties it to the token embedding). ValueError naming every tensor GPT-2 has no name for."""
    names = _gpt2_names(state, tied)
    return {
        target: (state[name].t() if transpose else state[name]) for name, (target, transpose) in names.items()
    }


def export_gpt2(
    source: TNLGForCausalLM | str | Path,
    output: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    verify: bool | str = True,
    tokenizer_dir: str | Path | None = None,
) -> list[Path]:
    """Write `source` as a `GPT2LMHeadModel` directory at `output` (which must be empty or absent):
    config.json, safetensors (sharded past `max_shard_size`, with an index), generation_config.json
    and the tokenizer files found in `tokenizer_dir` (default: the source directory). `source` is a
    `TNLGForCausalLM`, a directory it was saved to, or an engine checkpoint directory (any world size,
    stage and layout: consolidated first, next to `output`). `dtype` casts floating tensors; `verify`
    checks the source's sha256 records. Returns the files written."""
    output = Path(output)
    refuse_a_used_directory(output, "export into a new directory")
    if isinstance(source, TNLGForCausalLM):
        written = _export_model(source, output, max_shard_size, dtype)
    else:
        source = Path(source)
        if (source / MANIFEST).is_file():
            written = _export_engine_checkpoint(source, output, max_shard_size, dtype, verify)
        else:
            written = _export_directory(source, output, max_shard_size, dtype, verify)
        tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else source
    if tokenizer_dir is not None:
        written += [output / name for name in copy_tokenizer_files(tokenizer_dir, output)]
    logger.info("exported a GPT2LMHeadModel to %s (%d files)", output, len(written))
    return written


# ---------------------------------------------------------------------------------------------- sources
def _export_model(
    model: TNLGForCausalLM, output: Path, max_shard_size: int | str, dtype: torch.dtype | None
) -> list[Path]:
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    for name, tensor in state.items():
        if tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device: load or materialize the model before exporting it"
            )
    generation = getattr(model, "generation_config", None)
    kinds = {name: (tensor.numel(), tensor.dtype) for name, tensor in state.items()}
    return _write(model.config, state.__getitem__, kinds, output, max_shard_size, dtype, generation)


def _export_directory(
    directory: Path, output: Path, max_shard_size: int | str, dtype: torch.dtype | None, verify: bool | str
) -> list[Path]:
    """A saved TNLG model (`save_pretrained`, a run's `model/`, a consolidated checkpoint), read lazily."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is neither a saved model directory nor an engine checkpoint")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json: a GPT-2 export needs the model's TNLG config next to its weights"
        )
    check_model_config(directory, TNLGConfig.model_type)
    config = TNLGConfig.from_pretrained(directory)
    # The engine's pretrained reader: headers read once, checksums checked, one file open at a time.
    checkpoint = SafetensorsCheckpoint(directory, verify=verify)
    kinds = {
        name: (torch.Size(shape).numel(), _SAFETENSORS_DTYPES[checkpoint.dtypes[name]])
        for name, shape in checkpoint.shapes.items()
    }
    generation = (
        GenerationConfig.from_pretrained(directory)
        if (directory / "generation_config.json").is_file()
        else None
    )
    try:
        return _write(config, checkpoint.read, kinds, output, max_shard_size, dtype, generation)
    finally:
        checkpoint.close()


def _export_engine_checkpoint(
    checkpoint: Path, output: Path, max_shard_size: int | str, dtype: torch.dtype | None, verify: bool | str
) -> list[Path]:
    """Consolidated into a TNLG directory beside `output` (removed after), then exported from it."""
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no config.json (the model had no Transformers config): a GPT-2 export needs it"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.consolidating-", dir=output.parent) as staging:
        consolidate(checkpoint, staging, max_shard_size, dtype, verify=verify)
        # Written just now, with its record: hashing it again would read the whole model twice.
        return _export_directory(Path(staging), output, max_shard_size, None, verify=False)


# ---------------------------------------------------------------------------------------------- writing
def _write(
    config: TNLGConfig,
    read: Callable[[str], torch.Tensor],
    kinds: Mapping[str, tuple[int, torch.dtype]],
    output: Path,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    generation: GenerationConfig | None,
) -> list[Path]:
    """The tensors (`kinds`: name -> (elements, dtype); each `read` when its shard is written) renamed
    to GPT-2's, then its config and generation config."""
    gpt2 = gpt2_config(config)
    renamed = _gpt2_names(kinds, config.tie_word_embeddings)
    source_of = {target: (name, transpose) for name, (target, transpose) in renamed.items()}

    def written_dtype(name: str) -> torch.dtype:
        stored = kinds[name][1]
        return dtype if dtype is not None and stored.is_floating_point else stored

    def convert(target: str) -> torch.Tensor:
        name, transpose = source_of[target]
        tensor = read(name)
        return (tensor.t() if transpose else tensor).to(written_dtype(name))

    sizes = {target: kinds[name][0] * written_dtype(name).itemsize for target, (name, _) in source_of.items()}
    written = write_shards(output, list(source_of), convert, sizes, max_shard_size)
    floating = [written_dtype(name) for name in renamed if kinds[name][1].is_floating_point]
    gpt2.dtype = floating[0] if floating else torch.float32  # what from_pretrained(dtype="auto") loads
    gpt2.save_pretrained(output)
    generation = generation if generation is not None else GenerationConfig.from_model_config(gpt2)
    generation.save_pretrained(output)
    return [*written, output / "config.json", output / "generation_config.json"]


def _gpt2_names(state: Mapping[str, object], tied: bool) -> dict[str, tuple[str, bool]]:
    """{TNLG name: (GPT-2 name, transposed?)} for `state`'s names; a tied output layer left out."""
    names, unknown = {}, []
    for name in state:
        found = gpt2_name(name)
        if found is None:
            unknown.append(name)
        elif not (tied and name == "lm_head.weight"):
            names[name] = found
    if unknown:
        raise ValueError(
            f"these tensors have no place in a GPT-2 model: {unknown} (merge adapters into the weights, e.g. "
            "peft's merge_and_unload, before exporting)"
        )
    return names


__all__ = ["export_gpt2", "gpt2_config", "gpt2_name", "tnlg_state_to_gpt2"]
