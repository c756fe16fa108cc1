"""DeepSpeed ZeRO checkpoints (stage 1-3, any world size) into a TNLG model: the fp32 master weights,
read as `engine.load_checkpoint` reads them (see [Note: DeepSpeed ZeRO checkpoint layout] in
sharding/deepspeed/zero_checkpoint.py), for a model trained by DeepSpeed as a TNLG model or as a
Transformers GPT-2 (`GPT2LMHeadModel` under the Trainer's DeepSpeed integration)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.loading import config_model_type
from tnlg.sharding.deepspeed.zero_checkpoint import deepspeed_tag_directory, read_deepspeed_checkpoint

from .gpt2 import gpt2_state_dict_to_tnlg, tnlg_config_from_gpt2
from .state_dicts import build_model

CONFIG = "config.json"


def from_deepspeed(
    checkpoint: str | Path, config: str | Path | None = None, dtype: torch.dtype | None = None
) -> TNLGForCausalLM:
    """A `TNLGForCausalLM` holding a DeepSpeed ZeRO checkpoint's fp32 master weights.

    `checkpoint`: DeepSpeed's save directory (with its `latest`; the Trainer's `checkpoint-N/`) or the
    tag directory. `config`: the model's config.json or its directory, a TNLG or a GPT-2 one (default:
    the config.json the Trainer saves beside DeepSpeed's files; DeepSpeed itself saves none).
    `dtype` casts the result (default: fp32, the masters' own)."""
    checkpoint = Path(checkpoint)
    state = read_deepspeed_checkpoint(checkpoint)
    config_path = _config_path(checkpoint, config)
    model_type = config_model_type(config_path)
    source = str(state.directory)
    if model_type == "tnlg":
        model = build_model(TNLGConfig.from_json_file(config_path), state.masters, source)
    elif model_type == "gpt2":
        gpt2 = GPT2Config.from_json_file(config_path)
        model = build_model(tnlg_config_from_gpt2(gpt2), gpt2_state_dict_to_tnlg(state.masters), source)
    else:
        raise ValueError(
            f"{config_path} is a {model_type!r} model's config: DeepSpeed checkpoints convert from TNLG "
            "and GPT-2 models"
        )
    return model.to(dtype) if dtype is not None else model


def _config_path(checkpoint: Path, config: str | Path | None) -> Path:
    if config is not None:
        path = Path(config)
        path = path / CONFIG if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"--config {config}: no {CONFIG} there")
        return path
    tag = deepspeed_tag_directory(checkpoint)
    for directory in dict.fromkeys([checkpoint, tag.parent if tag is not None else checkpoint]):
        if (directory / CONFIG).is_file():
            return directory / CONFIG
    raise FileNotFoundError(
        f"{checkpoint} has no {CONFIG} (DeepSpeed saves none; the Transformers Trainer writes one beside "
        "its files): pass the model's config with --config"
    )
