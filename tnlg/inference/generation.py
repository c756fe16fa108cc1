"""Loading a TNLG model for inference and generating text in batches.

Shared by `scripts/generate.py` and the evaluation code: a model comes either from a checkpoint
directory (with its tokenizer when one was saved) or from a preset with random weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from tnlg.data.tokenizer import load_tokenizer
from tnlg.inference.settings import GenerationSettings
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.loading import check_model_config

logger = logging.getLogger(__name__)

# A prompt is text, or token ids already encoded (e.g. truncated to fit the context window).
Prompt = str | list[int]


def load_model_and_tokenizer(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: str | Path | None = None,
) -> tuple[TNLGForCausalLM, PreTrainedTokenizerBase]:
    """`model` is a checkpoint directory or a preset name (random weights).

    The tokenizer is `load_tokenizer_for(model, tokenizer)`'s.
    """
    loaded = load_tokenizer_for(model, tokenizer)
    if Path(model).is_dir():
        check_model_config(Path(model), TNLGConfig.model_type)
        network = TNLGForCausalLM.from_pretrained(model, dtype=dtype)
    else:
        config = TNLGConfig.from_preset(
            str(model), bos_token_id=loaded.eos_token_id, eos_token_id=loaded.eos_token_id
        )
        logger.info("random %s model: %s", model, config.describe())
        network = TNLGForCausalLM(config).to(dtype)
    check_vocabulary(loaded, network.config.vocab_size)
    return network.to(device).eval(), loaded


def load_tokenizer_for(model: str | Path, tokenizer: str | Path | None = None) -> PreTrainedTokenizerBase:
    """`load_tokenizer(tokenizer, model=model)` (the tokenizer named, else the checkpoint's own, else
    byte-level for a preset) set up for batched generation: padding on the left, EOS as the padding
    token when it has none."""
    loaded = load_tokenizer(tokenizer, model=model)
    if loaded.pad_token is None:
        loaded.pad_token = loaded.eos_token
    loaded.padding_side = "left"  # decoder-only: new tokens must follow the prompt directly
    return loaded


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """A tokenizer with more ids than the model has embedding rows would index past them."""
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab_size} rows"
        )


@torch.inference_mode()
def generate_texts(
    model: TNLGForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    settings: GenerationSettings | None = None,
    batch_size: int = 8,
) -> list[str]:
    """Continuations (without the prompt) of each prompt (text or token ids), decoded; batched with
    left padding. `settings` defaults to greedy decoding (`GenerationSettings()`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (prompts per generate call), got {batch_size}")
    settings = settings or GenerationSettings()
    check_prompts(model, tokenizer, prompts, settings)
    config = generation_config(settings, tokenizer, model)
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        completions.extend(generate_batch(model, tokenizer, prompts[start : start + batch_size], config))
    return completions


def check_prompts(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    settings: GenerationSettings,
) -> None:
    """ValueError naming the first prompt that cannot be continued, before anything is generated: one of
    no tokens (generate() failed deep inside, or in a batch gave '' silently), or one whose tokens and
    `max_new_tokens` pass the model's positions (it failed after the batch was generated, naming neither)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    for index, prompt in enumerate(prompts):
        length = len(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else len(prompt)
        if length == 0:
            raise ValueError(f"prompt {index} ({prompt!r}) has no tokens: there is nothing to continue")
        needed = length + settings.max_new_tokens - 1  # the last new token is never fed back
        if positions is not None and needed > positions:
            raise ValueError(
                f"prompt {index} has {length} tokens: generating max_new_tokens {settings.max_new_tokens} more "
                f"needs {needed} positions, past the model's {positions} (max_position_embeddings): shorten "
                "the prompt or lower max_new_tokens"
            )


def generation_config(
    settings: GenerationSettings, tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module
) -> GenerationConfig:
    """`settings` for `model`: never generating the rows of its vocabulary past the tokenizer's ids."""
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return settings.to_generation_config(tokenizer, vocab_size)


def generate_batch(
    model: TNLGForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    config: GenerationConfig,
    synced_gpus: bool | None = None,
) -> list[str]:
    """One `generate` call over `prompts` (left padded), decoded without the prompts.

    `synced_gpus=True` keeps this process running forward passes after its own sequences are done,
    until every rank's are: what a model whose forward is collective (ZeRO stage 3) needs. None is
    Transformers' default (on for DeepSpeed ZeRO-3 and FSDP models only).
    """
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError("batched generation pads with the tokenizer's pad or eos token; it has neither")
    # Left padding whatever the tokenizer was set up for (a training tokenizer often pads right):
    # new tokens must follow each prompt directly.
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        if all(isinstance(prompt, str) for prompt in prompts):
            batch = tokenizer(list(prompts), return_tensors="pt", padding=True)
        else:
            batch = tokenizer.pad({"input_ids": [list(prompt) for prompt in prompts]}, return_tensors="pt")
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    batch = batch.to(model.device)
    output = model.generate(**batch, generation_config=config, synced_gpus=synced_gpus)
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
