"""LoRA fine-tuning through peft, composed with the ZeRO engine.

The model is read whole (every rank holds the frozen weights, as DDP would; the engine leaves
frozen parameters unsharded), then peft adds the adapters; only they require grad, so only they
are in the optimizer and sharded by the ZeRO stage: their optimizer state (stage 1+), gradients
(stage 2+) and the adapters themselves (stage 3). The saved model is the adapters merged into the
weights (a plain TNLG checkpoint `from_pretrained` loads), with the adapters alone in `adapter/`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tnlg.modeling import TNLGConfig, TNLGForCausalLM

logger = logging.getLogger(__name__)
ADAPTER_DIRECTORY = "adapter"


def _peft():
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            "lora.enabled needs peft: pip install 'tnlg[lora]' (or pip install peft)"
        ) from error
    return peft


def lora_config(section: Any):
    """peft's LoraConfig from a `LoraSection`."""
    peft = _peft()
    if section.r < 1:
        raise ValueError(f"lora.r must be at least 1, got {section.r}")
    return peft.LoraConfig(
        r=section.r,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def base_model(architecture: TNLGConfig, init_from: str | None, seed: int) -> TNLGForCausalLM:
    """The whole model on the CPU: the checkpoint's weights, or (no checkpoint) the seeded init."""
    if init_from:
        return TNLGForCausalLM.from_pretrained(init_from, config=architecture, dtype=torch.float32)
    torch.manual_seed(seed)
    return TNLGForCausalLM(architecture)


def lora_model(architecture: TNLGConfig, init_from: str | None, section: Any, seed: int) -> nn.Module:
    """The base model with peft's LoRA adapters; only the adapters require grad."""
    peft = _peft()
    model = base_model(architecture, init_from, seed)
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(section.target_modules) - names)
    if unknown:
        raise ValueError(
            f"lora.target_modules {unknown} are not Linear layers of the model; it has {sorted(names)}"
        )
    # peft draws the adapters' A matrices from the global generator: seeded here, and not only when the
    # base is initialized rather than loaded, every rank and every rerun starts from the same adapters
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, lora_config(section))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info("LoRA: %d trainable parameters of %d (%.2f%%)", trainable, total, 100 * trainable / total)
    return wrapped


def save_lora_model(
    accelerator, engine, tokenizer, directory: Path, section: Any, init_from: str | None, seed: int
) -> None:
    """Collective: the trained adapters (consolidated from their shards) into `directory/adapter`, and
    merged into a fresh copy of the base weights as a TNLG checkpoint in `directory`."""
    state = accelerator.get_state_dict(engine)  # every rank takes part
    if accelerator.is_main_process:
        peft = _peft()
        adapters = {k: v for k, v in state.items() if "lora_" in k}
        architecture = engine.module.get_base_model().config
        # The fresh copy's seeded init and adapter draws leave the global generator as it was: the
        # final evaluation (sampling, if asked for) runs after this and draws as it would have before.
        with torch.random.fork_rng(devices=[]):
            fresh = peft.get_peft_model(base_model(architecture, init_from, seed), lora_config(section))
        missing = [k for k in fresh.state_dict() if "lora_" in k and k not in adapters]
        if missing:
            raise RuntimeError(f"the consolidated state lacks adapter weights {missing[:3]}")
        fresh.load_state_dict(adapters, strict=False)
        fresh.save_pretrained(directory / ADAPTER_DIRECTORY)
        merged = fresh.merge_and_unload()
        merged.save_pretrained(directory, max_shard_size="2GB")
        tokenizer.save_pretrained(directory)
    accelerator.wait_for_everyone()
