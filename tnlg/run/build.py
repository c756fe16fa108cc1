"""What a run is built from: its tokenizer, the model architecture, and the model to shard.

`data.tokenizer` "default" is the checkpoint's own tokenizer when the run starts from one that has it,
else a byte-level BPE of the embedded corpus at the model's vocabulary size (trained once, cached).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from tnlg.data.corpus import cache_root, embedded_corpus
from tnlg.data.pretokenized import read_texts
from tnlg.data.tokenizer import has_tokenizer, load_tokenizer, train_byte_level_bpe
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.loading import config_model_type
from tnlg.run.config import ModelSection


def default_tokenizer(vocab_size: int) -> PreTrainedTokenizerBase:
    """A byte-level BPE of `vocab_size` tokens trained on the embedded corpus, cached after the first run."""
    directory = cache_root() / f"tokenizer-embedded-{vocab_size}"
    if not (directory / "tokenizer.json").is_file():
        tokenizer = train_byte_level_bpe(read_texts(embedded_corpus().files()), vocab_size)
        staging = directory.with_name(directory.name + f".{time.time_ns()}")
        tokenizer.save_pretrained(staging)
        with contextlib.suppress(OSError):  # another process finished first: keep its copy
            staging.rename(directory)
    return load_tokenizer(directory)


def run_tokenizer(name: str, model: ModelSection) -> PreTrainedTokenizerBase:
    """The tokenizer `name` (`data.tokenizer`, loaded by `load_tokenizer`; see the module docs for
    "default")."""
    init_from = model.init_from
    if name != "default":
        return load_tokenizer(name)
    if init_from and has_tokenizer(init_from):
        return load_tokenizer(model=init_from)
    if init_from:
        return default_tokenizer(TNLGConfig.from_pretrained(init_from).vocab_size)
    return default_tokenizer(TNLGConfig.from_preset(model.preset, **model.overrides).vocab_size)


def architecture(section: ModelSection, **preset_defaults: Any) -> TNLGConfig:
    """`model.init_from`'s config (its architecture and special tokens), else the preset with
    `preset_defaults` for what the overrides leave unset; both with `model.overrides`."""
    if section.init_from:
        return TNLGConfig.from_pretrained(section.init_from, **section.overrides)
    return TNLGConfig.from_preset(section.preset, **{**preset_defaults, **section.overrides})


def model_config(section: ModelSection, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> TNLGConfig:
    """The run's `architecture`, a preset's special tokens the tokenizer's end-of-text; checked against
    the tokenizer and the sequence length."""
    eos = tokenizer.eos_token_id
    model = architecture(section, eos_token_id=eos, bos_token_id=eos)
    if len(tokenizer) > model.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {model.vocab_size}"
        )
    if seq_len > model.max_position_embeddings:
        raise ValueError(
            f"the sequence length {seq_len} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}"
        )
    return model


def check_init_from(init_from: str | None) -> None:
    """`model.init_from` must be a local Transformers checkpoint directory: a run downloads nothing, and
    a missing path must not turn into minutes of hub retries or a misleading vocabulary error."""
    if init_from is None:
        return
    path = Path(init_from)
    if not path.exists():
        raise FileNotFoundError(
            f"model.init_from {init_from} does not exist: it must be a local checkpoint directory (the "
            "main job, accelerate launch scripts/pretrain.py, writes runs/pretrain-debug/model)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.init_from {init_from} holds no config.json, so it is no TNLG checkpoint: point it at a "
            "directory written by save_pretrained (a run's model/), or convert one with "
            "scripts/convert_checkpoint.py"
        )
    model_type = config_model_type(path / "config.json")
    if model_type != TNLGConfig.model_type:
        # Transformers would read another model's config.json as a TNLG one, with a warning only: a
        # GPT-2 directory became the default TNLG architecture (estimates of the wrong model, or a
        # misleading vocabulary error)
        convert = (
            f"convert it first (scripts/convert_checkpoint.py --from gpt2 --input {init_from} --output DIR) "
            "and start from DIR"
            if model_type == "gpt2"
            else "tnlg converts GPT-2, Megatron-LM and DeepSpeed checkpoints (scripts/convert_checkpoint.py "
            "--from gpt2 | megatron | deepspeed), and starts from the directory it writes"
        )
        raise ValueError(
            f"model.init_from {init_from} holds a {model_type!r} model, not a {TNLGConfig.model_type!r} one: {convert}"
        )


def meta_model(architecture: TNLGConfig) -> nn.Module:
    """The model on the meta device: the engine builds each rank's shards (from `model.init_from`'s
    slices when the run starts from a checkpoint, else from the seeded initialization)."""
    with torch.device("meta"):
        return TNLGForCausalLM(architecture)
