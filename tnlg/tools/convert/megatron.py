"""Megatron-LM GPT checkpoints → TNLG.

Handles both naming schemes Megatron has used:
- Megatron-core `GPTModel` (`decoder.layers.N.self_attention.linear_qkv.weight`, with the local or the
  Transformer-Engine spec, whose LayerNorms are fused into the next linear as `layer_norm_weight`);
- legacy Megatron-LM (`language_model.encoder.layers.N.self_attention.query_key_value.weight`,
  older `transformer`/`attention` spellings, nested-dict checkpoints).

Tensor-parallel shards are concatenated along the dimension each layer was split on (column
parallel: output rows; row parallel: input columns; norms and row-parallel biases replicated);
pipeline stages are stacked in order. The fused QKV rows are stored per head, `[nh, 3, hd]` (legacy
checkpoint_version 1.0 used `[nh, hd, 3]`, version 0 `[3, nh, hd]`); TNLG wants `[3, nh, hd]`.
The padded vocabulary is trimmed to `vocab_size` when given.

What the tensors cannot tell comes from the checkpoint's saved `args` (heads, epsilon, which GeLU,
zero-centred LayerNorm gains) and its `checkpoint_version`; options that change the computed function
without changing a name or a shape are refused by name (`_UNSUPPORTED_ARGS`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tnlg.modeling import GPT2_VOCAB_SIZE, TNLGConfig, TNLGForCausalLM

from .megatron_args import (
    activation_from_args,
    refuse_unsupported_architecture,
    settled_checkpoint_version,
    settled_heads,
    shift_layernorm_weights,
    zero_centered_gamma,
)
from .state_dicts import build_model, load_tensors, load_torch_file


@dataclass(frozen=True)
class _Role:
    tnlg_name: str  # with `{layer}` for per-layer tensors
    tp_dim: int | None  # dimension split across tensor-parallel ranks; None = replicated


_LAYER_ROLES: dict[str, _Role] = {
    "ln1.weight": _Role("model.layers.{layer}.input_layernorm.weight", None),
    "ln1.bias": _Role("model.layers.{layer}.input_layernorm.bias", None),
    "qkv.weight": _Role("model.layers.{layer}.self_attn.qkv_proj.weight", 0),
    "qkv.bias": _Role("model.layers.{layer}.self_attn.qkv_proj.bias", 0),
    "proj.weight": _Role("model.layers.{layer}.self_attn.out_proj.weight", 1),
    "proj.bias": _Role("model.layers.{layer}.self_attn.out_proj.bias", None),
    "ln2.weight": _Role("model.layers.{layer}.post_attention_layernorm.weight", None),
    "ln2.bias": _Role("model.layers.{layer}.post_attention_layernorm.bias", None),
    "fc1.weight": _Role("model.layers.{layer}.mlp.fc_in.weight", 0),
    "fc1.bias": _Role("model.layers.{layer}.mlp.fc_in.bias", 0),
    "fc2.weight": _Role("model.layers.{layer}.mlp.fc_out.weight", 1),
    "fc2.bias": _Role("model.layers.{layer}.mlp.fc_out.bias", None),
}
_TOP_ROLES: dict[str, _Role] = {
    "embed": _Role("model.embed_tokens.weight", 0),
    "pos": _Role("model.embed_positions.weight", None),
    "final_ln.weight": _Role("model.final_layernorm.weight", None),
    "final_ln.bias": _Role("model.final_layernorm.bias", None),
    "output": _Role("lm_head.weight", 0),
}
# Suffix of a per-layer name (core and legacy spellings) → role, with `weight|bias` kept.
_LAYER_SUFFIXES = [
    (re.compile(r"input_layernorm\.(weight|bias)$"), "ln1"),
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), "ln1"),
    (re.compile(r"self_attention\.linear_qkv\.(weight|bias)$"), "qkv"),
    (re.compile(r"(?:self_attention|attention)\.query_key_value\.(weight|bias)$"), "qkv"),
    (re.compile(r"self_attention\.linear_proj\.(weight|bias)$"), "proj"),
    (re.compile(r"(?:self_attention|attention)\.dense\.(weight|bias)$"), "proj"),
    (re.compile(r"(?:pre_mlp_layernorm|post_attention_layernorm)\.(weight|bias)$"), "ln2"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_(weight|bias)$"), "ln2"),
    (re.compile(r"mlp\.(?:linear_fc1|dense_h_to_4h)\.(weight|bias)$"), "fc1"),
    (re.compile(r"mlp\.(?:linear_fc2|dense_4h_to_h)\.(weight|bias)$"), "fc2"),
]
_LAYER = re.compile(r"^(?:decoder|language_model\.(?:encoder|transformer))\.layers\.(\d+)\.(.+)$")
_CORE_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.\d+\.")  # megatron-core GPTModel, any wrapper prefix
_TOP = [
    (re.compile(r"^(?:language_model\.)?embedding\.word_embeddings\.weight$"), "embed"),
    (re.compile(r"^(?:language_model\.)?embedding\.position_embeddings\.weight$"), "pos"),
    (
        re.compile(r"^(?:decoder|language_model\.(?:encoder|transformer))\.final_(?:layer)?norm\.(weight)$"),
        "final_ln.weight",
    ),
    (
        re.compile(r"^(?:decoder|language_model\.(?:encoder|transformer))\.final_(?:layer)?norm\.(bias)$"),
        "final_ln.bias",
    ),
    (re.compile(r"^(?:language_model\.)?output_layer\.weight$"), "output"),
]
# Transformer-Engine metadata and the legacy last-stage copy of the tied embedding.
_IGNORED = re.compile(r"(_extra_state$|word_embeddings_for_head\.weight$)")
_WRAPPER_PREFIXES = ("module.", "model.")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested dicts of tensors (legacy Megatron's `model['language_model']['encoder']...`) → dotted names."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def _classify(name: str) -> tuple[str, int | None] | None:
    """(role, layer) for a Megatron tensor name; None if ignorable; raises KeyError if unknown.

    A DDP / Float16Module wrapper prefix (`module.`, `model.`) is stripped when the name is not
    recognised with it.
    """
    if _IGNORED.search(name):
        return None
    layer = _LAYER.match(name)
    if layer:
        for pattern, role in _LAYER_SUFFIXES:
            match = pattern.fullmatch(layer.group(2))
            if match:
                return f"{role}.{match.group(1)}", int(layer.group(1))
    for pattern, role in _TOP:
        if pattern.match(name):
            return role, None
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return _classify(name[len(prefix) :])
    raise KeyError(name)


def _merge_qkv(shards: list[torch.Tensor], num_heads: int, checkpoint_version: float) -> torch.Tensor:
    """Tensor-parallel QKV shards (rows in Megatron's per-head order) → TNLG's `[q | k | v]` rows.

    Each rank holds the rows of its own heads in the checkpoint's order; every shard is brought to
    `[3, local heads, hd]` first and the ranks are then joined along the head dimension, so the
    merge is right for every order, including version 0's per-rank `[3, local heads, hd]`.
    """
    rows = sum(shard.shape[0] for shard in shards)
    head_dim = rows // (3 * num_heads)
    if head_dim * 3 * num_heads != rows or num_heads % len(shards):
        raise ValueError(
            f"fused QKV has {rows} rows over {len(shards)} tensor-parallel shards, not 3 x num_attention_heads "
            f"({num_heads}) x head_dim; grouped-query attention checkpoints are not supported by TNLG"
        )
    local_heads = num_heads // len(shards)
    rest = shards[0].shape[1:]
    trailing = tuple(range(3, 3 + len(rest)))
    per_rank = []
    for shard in shards:
        if checkpoint_version == 0:  # [3, nh, hd]
            per_rank.append(shard.view(3, local_heads, head_dim, *rest))
        elif checkpoint_version < 2.0:  # [nh, hd, 3]
            per_rank.append(shard.view(local_heads, head_dim, 3, *rest).permute(2, 0, 1, *trailing))
        else:  # [nh, 3, hd]
            per_rank.append(shard.view(local_heads, 3, head_dim, *rest).transpose(0, 1))
    return torch.cat(per_rank, dim=1).reshape(rows, *rest).contiguous()


def _uses_core_names(shards: Mapping[Any, Mapping[str, torch.Tensor]]) -> bool:
    """Whether the tensors carry megatron-core `GPTModel` names (`decoder.layers.N...`), not legacy ones."""
    return any(_CORE_LAYER.search(name) for shard in shards.values() for name in shard)


def megatron_state_dict_to_tnlg(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
    num_attention_heads: int,
    checkpoint_version: float = 3.0,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Merge `{(tp_rank, pp_rank): flat state dict}` into one TNLG-named state dict.

    `checkpoint_version` orders legacy `query_key_value` rows only: Megatron's loader
    (`fix_query_key_value_ordering`) never reorders megatron-core's `linear_qkv`, per head in every version.
    """
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size {vocab_size} is not a number of rows to keep: give a positive one")
    if _uses_core_names(shards):
        checkpoint_version = 3.0
    tp_size, pp_size = _parallel_sizes(shards)
    converted: dict[str, torch.Tensor] = {}
    for (role, layer), tensors in _pieces_by_role(shards, tp_size, pp_size).items():
        spec = _LAYER_ROLES[role] if layer is not None else _TOP_ROLES[role]
        if len(tensors) != tp_size:
            raise ValueError(
                f"{role} (layer {layer}) has {len(tensors)} tensor-parallel shards, expected {tp_size}"
            )
        if role.startswith("qkv"):
            merged = _merge_qkv(tensors, num_attention_heads, checkpoint_version)
        elif spec.tp_dim is None:  # replicated: every rank holds the same tensor
            merged = tensors[0]
        else:
            merged = torch.cat(tensors, dim=spec.tp_dim)
        converted[spec.tnlg_name.format(layer=layer)] = _trim_vocabulary(
            role, merged, vocab_size
        ).contiguous()
    return converted


def _parallel_sizes(shards: Mapping[tuple[int, int], Any]) -> tuple[int, int]:
    """(tensor-parallel size, pipeline-parallel size), every (tp, pp) rank's shard checked present."""
    tp_size = 1 + max(tp for tp, _ in shards)
    pp_size = 1 + max(pp for _, pp in shards)
    missing_shards = [(tp, pp) for tp in range(tp_size) for pp in range(pp_size) if (tp, pp) not in shards]
    if missing_shards:
        raise ValueError(f"Megatron checkpoint lacks (tensor, pipeline) rank shards {missing_shards}")
    return tp_size, pp_size


def _pieces_by_role(
    shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], tp_size: int, pp_size: int
) -> dict[tuple[str, int | None], list[torch.Tensor]]:
    """Each tensor's tensor-parallel pieces in rank order, by (role, layer; None outside the layers).

    Pipeline stages number their layers from 0, so a stage's layers follow those of the stages
    before it. Every tensor the converter does not know is named in one error.
    """
    pieces: dict[tuple[str, int | None], list[torch.Tensor]] = {}
    unknown: list[str] = []
    layer_offset = 0
    for pp in range(pp_size):
        stage_layers = 0
        for tp in range(tp_size):
            classified, not_known = _classify_all(shards[(tp, pp)])
            unknown += not_known
            for role, layer, tensor in classified:
                if layer is not None:
                    stage_layers = max(stage_layers, layer + 1)
                    layer += layer_offset
                elif len(pieces.get((role, None), ())) == tp_size:
                    continue  # a later pipeline stage's copy (tied embedding on the last stage)
                pieces.setdefault((role, layer), []).append(tensor)
        layer_offset += stage_layers
    if unknown:
        raise ValueError(f"Megatron state dict has tensors the converter does not know: {sorted(unknown)}")
    if ("pos", None) not in pieces:
        raise ValueError(
            "Megatron checkpoint has no learned position embeddings (rotary models are not TNLG models)"
        )
    return pieces


def _classify_all(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[list[tuple[str, int | None, torch.Tensor]], list[str]]:
    """(role, layer within its stage, tensor) for each tensor to convert, and the unknown names;
    ignorable tensors are in neither."""
    classified: list[tuple[str, int | None, torch.Tensor]] = []
    unknown: list[str] = []
    for name, tensor in state_dict.items():
        try:
            role_and_layer = _classify(name)
        except KeyError:
            unknown.append(name)
            continue
        if role_and_layer is not None:
            classified.append((*role_and_layer, tensor))
    return classified, unknown


def _trim_vocabulary(role: str, merged: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """The embedding and output rows cut to `vocab_size` (Megatron pads the vocabulary for TP)."""
    if role not in ("embed", "output") or vocab_size is None:
        return merged
    if vocab_size > merged.shape[0]:
        raise ValueError(f"vocab_size {vocab_size} exceeds the checkpoint's {merged.shape[0]} rows")
    return merged[:vocab_size]


def _config_from_tensors(
    tensors: Mapping[str, torch.Tensor], num_attention_heads: int, **overrides: Any
) -> TNLGConfig:
    embed = tensors["model.embed_tokens.weight"]
    layers = 1 + max(int(n.split(".")[2]) for n in tensors if n.startswith("model.layers."))
    head = tensors.get("lm_head.weight")
    fields: dict[str, Any] = {
        "vocab_size": embed.shape[0],
        "hidden_size": embed.shape[1],
        "num_hidden_layers": layers,
        "num_attention_heads": num_attention_heads,
        "max_position_embeddings": tensors["model.embed_positions.weight"].shape[0],
        "intermediate_size": tensors["model.layers.0.mlp.fc_in.weight"].shape[0],
        "tie_word_embeddings": head is None or torch.equal(head, embed),
    }
    if embed.shape[0] <= GPT2_VOCAB_SIZE - 1:
        # Megatron checkpoints carry no token ids; GPT-2's end-of-text id does not fit this vocabulary.
        fields["bos_token_id"] = fields["eos_token_id"] = None
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return TNLGConfig(**fields)


def read_megatron_checkpoint(path: str | Path) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], dict]:
    """Shards `{(tp, pp): flat state dict}` and the metadata of a checkpoint: `args` and
    `checkpoint_version` where its files record them, and `megatron_checkpoint`, whether they are
    Megatron's checkpoint dicts (a `model` entry beside them) rather than bare state dicts.

    `path` is a Megatron save directory (with `latest_checkpointed_iteration.txt`), an `iter_*`
    directory of `mp_rank_TT[_PPP]/model_optim_rng.pt` files, one such file, or a directory of
    safetensors holding a Megatron-named state dict.
    """
    path = Path(path)
    if path.is_dir() and (path / "latest_checkpointed_iteration.txt").is_file():
        tag = (path / "latest_checkpointed_iteration.txt").read_text().strip()
        if tag != "release" and not tag.isdigit():
            raise ValueError(
                f"{path / 'latest_checkpointed_iteration.txt'} names neither an iteration nor 'release': {tag[:40]!r}"
            )
        path = path / (tag if tag == "release" else f"iter_{int(tag):07d}")
    if path.is_dir() and any(path.glob("*.distcp")):
        raise ValueError(
            f"{path} is a torch_dist (distributed) checkpoint; convert it to the legacy per-rank format with "
            "Megatron's `--ckpt-convert-format torch` first"
        )
    rank_dirs = sorted(path.glob("mp_rank_*")) if path.is_dir() else []
    files: dict[tuple[int, int], Path] = {}
    for rank_dir in rank_dirs:
        ranks = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", rank_dir.name)
        candidates = [
            rank_dir / n for n in ("model_optim_rng.pt", "model_rng.pt") if (rank_dir / n).is_file()
        ]
        if ranks and candidates:
            files[(int(ranks.group(1)), int(ranks.group(2) or 0))] = candidates[0]
    if not files and path.is_file() and path.suffix != ".safetensors":
        files[(0, 0)] = path
    if not files:  # a plain state dict (safetensors / .bin) with Megatron names
        return {(0, 0): load_tensors(path)}, {}

    shards, metadata = {}, {}
    for ranks, file in files.items():
        loaded = load_torch_file(file)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{file} holds a {type(loaded).__name__}, not a checkpoint dict")
        if "model0" in loaded:
            raise ValueError(f"{file} is a virtual-pipeline checkpoint (model0, model1, ...), not supported")
        model = loaded.get("model", loaded)
        shards[ranks] = flatten(model)
        if not metadata:
            metadata = {k: loaded[k] for k in ("args", "checkpoint_version") if k in loaded}
            metadata["megatron_checkpoint"] = "model" in loaded
    _check_saved_layout(path, set(files), metadata.get("args"))
    return shards, metadata


def _check_saved_layout(path: Path, found: set[tuple[int, int]], args: Any) -> None:
    """ValueError naming the rank directories a checkpoint lacks, by its saved args' tensor and pipeline
    sizes: without them the sizes come from the directories present, and a missing last rank would make
    a smaller model that fails later on a shape, not on what is missing."""
    tensor = getattr(args, "tensor_model_parallel_size", None)
    pipeline = getattr(args, "pipeline_model_parallel_size", None)
    if not isinstance(tensor, int) or not isinstance(pipeline, int):
        return
    expected = {(tp, pp) for tp in range(tensor) for pp in range(pipeline)}
    missing = sorted(expected - found)
    if missing:
        names = [f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pipeline > 1 else "") for tp, pp in missing]
        raise ValueError(
            f"{path} lacks {', '.join(names)}: its saved args say tensor {tensor} x pipeline {pipeline} ranks, "
            f"and {len(found)} of the {len(expected)} rank directories are there"
        )


def from_megatron(
    source: str | Path | Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    *,
    num_attention_heads: int | None = None,
    vocab_size: int | None = None,
    checkpoint_version: float | None = None,
    hidden_act: str | None = None,
    layer_norm_epsilon: float | None = None,
    dtype: torch.dtype | None = None,
) -> TNLGForCausalLM:
    """A `TNLGForCausalLM` from a Megatron GPT checkpoint.

    `source`: a checkpoint path (see `read_megatron_checkpoint`), one state dict, or a list of
    state dicts, one per tensor-parallel rank in rank order. Facts about the tensors come from the
    checkpoint when it records them, and a keyword argument that contradicts the record is refused:
    `num_attention_heads` (from the saved args; required without them) and `checkpoint_version` (the
    legacy QKV order; without a record Megatron's own default, 0, for a Megatron checkpoint file and
    3.0 for bare state dicts). Settings the keyword arguments override by intent: `layer_norm_epsilon`
    (default: the args', else 1e-5) and `hidden_act` (default: the GeLU Megatron ran, from the args, see
    [Note: which GeLU Megatron ran]; `gelu_new` without args). Architecture options TNLG does not
    implement are refused by name; zero-centred LayerNorm weights (`apply_layernorm_1p`,
    `layernorm_zero_centered_gamma`) are converted to plain ones (+1, in fp32).
    `vocab_size` trims the padded embedding rows (e.g. 50257 for the GPT-2 tokenizer).
    """
    metadata: dict = {}
    if isinstance(source, (str, Path)):
        shards, metadata = read_megatron_checkpoint(source)
    elif isinstance(source, Mapping):
        shards = {(0, 0): flatten(source)}
    else:
        shards = {(tp, 0): flatten(shard) for tp, shard in enumerate(source)}
    args = metadata.get("args")
    refuse_unsupported_architecture(args)
    core_names = _uses_core_names(shards)
    if hidden_act is None:
        hidden_act = activation_from_args(args, core_names)
    num_attention_heads = settled_heads(num_attention_heads, args)
    checkpoint_version = settled_checkpoint_version(checkpoint_version, metadata, core_names)
    if layer_norm_epsilon is None:
        layer_norm_epsilon = getattr(args, "norm_epsilon", getattr(args, "layernorm_epsilon", 1e-5))
    tensors = megatron_state_dict_to_tnlg(shards, num_attention_heads, checkpoint_version, vocab_size)
    if zero_centered_gamma(args):
        tensors = shift_layernorm_weights(tensors, dtype)
    config = _config_from_tensors(
        tensors, num_attention_heads, hidden_act=hidden_act, layer_norm_epsilon=layer_norm_epsilon
    )
    model = build_model(
        config, tensors, source=str(source) if isinstance(source, (str, Path)) else "Megatron state dict"
    )
    return model.to(dtype) if dtype is not None else model
