"""Transformers GPT-2 → TNLG.

GPT-2 stores its projections as `Conv1D` with weights shaped (in, out); TNLG uses `nn.Linear`,
(out, in), so every matmul weight is transposed. GPT-2's fused `c_attn` already has its output
columns in `[q | k | v]` order, which is TNLG's, so QKV needs no reordering.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, GPT2Config, PreTrainedModel
from transformers.utils import GENERATION_CONFIG_NAME

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.configuration_tnlg import TOKEN_ID_FIELDS, in_vocabulary
from tnlg.modeling.loading import check_model_config

from .state_dicts import build_model, load_tensors

logger = logging.getLogger(__name__)

# GPT-2 name (after the `transformer.` prefix) → (TNLG name, transpose?)
BLOCK_NAMES = {
    "ln_1.weight": ("input_layernorm.weight", False),
    "ln_1.bias": ("input_layernorm.bias", False),
    "attn.c_attn.weight": ("self_attn.qkv_proj.weight", True),
    "attn.c_attn.bias": ("self_attn.qkv_proj.bias", False),
    "attn.c_proj.weight": ("self_attn.out_proj.weight", True),
    "attn.c_proj.bias": ("self_attn.out_proj.bias", False),
    "ln_2.weight": ("post_attention_layernorm.weight", False),
    "ln_2.bias": ("post_attention_layernorm.bias", False),
    "mlp.c_fc.weight": ("mlp.fc_in.weight", True),
    "mlp.c_fc.bias": ("mlp.fc_in.bias", False),
    "mlp.c_proj.weight": ("mlp.fc_out.weight", True),
    "mlp.c_proj.bias": ("mlp.fc_out.bias", False),
}
TOP_NAMES = {
    "wte.weight": "model.embed_tokens.weight",
    "wpe.weight": "model.embed_positions.weight",
    "ln_f.weight": "model.final_layernorm.weight",
    "ln_f.bias": "model.final_layernorm.bias",
}
# TNLGConfig field -> GPT2Config field, for the architecture both compute (the token ids are handled
# apart: GPT-2 keeps ids outside its vocabulary). Both directions read this one table.
CONFIG_NAMES = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "n_positions",
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "intermediate_size": "n_inner",
    "hidden_act": "activation_function",
    "layer_norm_epsilon": "layer_norm_epsilon",
    "initializer_range": "initializer_range",
    "embedding_dropout": "embd_pdrop",
    "attention_dropout": "attn_pdrop",
    "hidden_dropout": "resid_pdrop",
    "tie_word_embeddings": "tie_word_embeddings",
}
# Causal-mask buffers that old GPT-2 checkpoints saved; TNLG builds masks on the fly.
_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
_BLOCK = re.compile(r"h\.(\d+)\.(.+)$")


def tnlg_config_from_gpt2(gpt2_config: GPT2Config) -> TNLGConfig:
    """The TNLG config computing the same function as `gpt2_config`; refuses GPT-2 options TNLG lacks."""
    unsupported = {
        "scale_attn_by_inverse_layer_idx": getattr(gpt2_config, "scale_attn_by_inverse_layer_idx", False),
        "add_cross_attention": getattr(gpt2_config, "add_cross_attention", False),
        "scale_attn_weights is False": not getattr(gpt2_config, "scale_attn_weights", True),
    }
    if any(unsupported.values()):
        raise ValueError(
            f"GPT-2 options TNLG does not implement are set: {[k for k, v in unsupported.items() if v]}"
        )
    fields = {tnlg: getattr(gpt2_config, gpt2) for tnlg, gpt2 in CONFIG_NAMES.items()}
    fields["intermediate_size"] = gpt2_config.n_inner or 4 * gpt2_config.n_embd  # GPT-2's None: 4x
    for name in ("embedding_dropout", "attention_dropout", "hidden_dropout"):
        fields[name] = float(fields[name])
    return TNLGConfig(**fields, **_token_ids_in_vocabulary(gpt2_config, gpt2_config.vocab_size, "config"))


def tnlg_generation_config(generation_config: GenerationConfig, vocab_size: int) -> GenerationConfig:
    """GPT-2's generation config for the converted model: its settings (max_new_tokens,
    repetition_penalty, no_repeat_ngram_size, ...) kept, so that `generate()` decodes as GPT-2's does,
    and its token ids outside the vocabulary dropped (None) as `tnlg_config_from_gpt2` drops the
    config's, so the two agree (the export, to_gpt2.py, carries it the other way)."""
    converted = copy.deepcopy(generation_config)
    converted.update(**_token_ids_in_vocabulary(generation_config, vocab_size, "generation config"))
    return converted


def _token_ids_in_vocabulary(source: Any, vocab_size: int, what: str) -> dict[str, int | list[int] | None]:
    """The special token ids of `source` (GPT-2's config or generation config), each outside the
    vocabulary dropped (None) with a warning.

    `GPT2Config` keeps its default end-of-text id 50256 whatever `vocab_size` says (small test and
    retrained models); such an id names no row of the embedding, so no token the model can produce
    ends a sequence, and TNLG refuses an out-of-range id."""
    ids: dict[str, int | list[int] | None] = {}
    for name in TOKEN_ID_FIELDS:
        value = getattr(source, name, None)
        given = [i for i in (value if isinstance(value, list) else [value]) if i is not None]
        kept = [i for i in given if in_vocabulary(i, vocab_size)]
        ids[name] = value
        if len(kept) < len(given):
            ids[name] = (kept or None) if isinstance(value, list) else None
            logger.warning(
                "GPT-2 %s: %s %r is outside its vocabulary of %d tokens; the TNLG model's has %r",
                what, name, value, vocab_size, ids[name],
            )  # fmt: skip
    return ids


def gpt2_state_dict_to_tnlg(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and transpose a GPT-2 state dict (from `GPT2LMHeadModel` or `GPT2Model`) to TNLG names.

    Raises `ValueError` listing every tensor name it does not recognise, rather than dropping it.
    """
    converted: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in state_dict.items():
        if name == "lm_head.weight":
            converted["lm_head.weight"] = tensor
            continue
        short = name.removeprefix("transformer.")
        if _IGNORED.match(short):
            continue
        if short in TOP_NAMES:
            converted[TOP_NAMES[short]] = tensor
            continue
        block = _BLOCK.match(short)
        if block and block.group(2) in BLOCK_NAMES:
            target, transpose = BLOCK_NAMES[block.group(2)]
            converted[f"model.layers.{block.group(1)}.{target}"] = (
                tensor.t().contiguous() if transpose else tensor
            )
            continue
        unknown.append(name)
    if unknown:
        raise ValueError(f"GPT-2 state dict has tensors the converter does not know: {unknown}")
    return converted


def from_gpt2(
    model_or_dir: PreTrainedModel | str | Path, dtype: torch.dtype | None = None
) -> TNLGForCausalLM:
    """A `TNLGForCausalLM` equal to a Transformers GPT-2 model, given the model or its checkpoint dir.

    A directory is read as files (config.json + safetensors, or `pytorch_model.bin` with
    `weights_only=True`); no GPT-2 model is instantiated. `dtype` casts the result (default: keep).
    The generation config (the model's, or the directory's generation_config.json) comes along
    (`tnlg_generation_config`), so `generate()` decodes as GPT-2's does.
    """
    if isinstance(model_or_dir, PreTrainedModel):
        # Cloned: the converted model must not share storage with the caller's GPT-2 model.
        gpt2_config = model_or_dir.config
        tensors = {name: t.detach().clone() for name, t in model_or_dir.state_dict().items()}
        source = type(model_or_dir).__name__
        generation = getattr(model_or_dir, "generation_config", None)
    else:
        path = Path(model_or_dir)
        if not (path / "config.json").is_file():
            # Transformers would take a missing path for a hub name, and a directory without one for
            # GPT-2 small's defaults (then name hundreds of tensors that do not fit them)
            raise FileNotFoundError(
                f"{path} is not a GPT-2 checkpoint directory: it holds no config.json (from_gpt2 reads a "
                "directory saved by save_pretrained; nothing is downloaded)"
            )
        check_model_config(path, "gpt2")
        gpt2_config = GPT2Config.from_pretrained(path)
        tensors, source = load_tensors(path), str(path)
        has_generation = (path / GENERATION_CONFIG_NAME).is_file()
        generation = GenerationConfig.from_pretrained(path) if has_generation else None
    if getattr(gpt2_config, "model_type", None) != "gpt2":
        raise ValueError(f"{source} is a {getattr(gpt2_config, 'model_type', '?')!r} model, not 'gpt2'")
    model = build_model(tnlg_config_from_gpt2(gpt2_config), gpt2_state_dict_to_tnlg(tensors), source)
    if generation is not None:  # without one, the model's own (from its config) is GPT-2's default too
        model.generation_config = tnlg_generation_config(generation, model.config.vocab_size)
    return model.to(dtype) if dtype is not None else model
