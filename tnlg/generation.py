"""Loading a TNLG model for inference and generating text in batches.

Shared by `scripts/generate.py` and the evaluation code: a model comes either from a checkpoint
directory (with its tokenizer when one was saved) or from a preset with random weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.tokenization import byte_level_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationSettings:
    """How to decode: greedy by default; sampling when `do_sample`; beam search when `num_beams > 1`."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    num_beams: int = 1
    use_cache: bool = True

    def to_generation_config(self, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        sampling = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=self.do_sample,
            num_beams=self.num_beams,
            use_cache=self.use_cache,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **(sampling if self.do_sample else {}),
        )


def load_model_and_tokenizer(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: str | Path | None = None,
) -> tuple[TNLGForCausalLM, PreTrainedTokenizerBase]:
    """`model` is a checkpoint directory or a preset name (random weights).

    The tokenizer comes from `tokenizer` (a directory, or `byte-level`), else from the checkpoint
    directory; a preset uses the byte-level tokenizer. A checkpoint saved without a tokenizer needs
    `tokenizer`: guessing one would decode its ids into the wrong text.
    """
    path = Path(model)
    if path.is_dir():
        network = TNLGForCausalLM.from_pretrained(path, dtype=dtype)
        source = tokenizer or (path if _has_tokenizer(path) else None)
        if source is None:
            raise ValueError(
                f"{path} holds no tokenizer files; pass a tokenizer directory (or 'byte-level' for a model "
                "trained on the byte-level tokenizer)"
            )
    elif str(model) in TNLGConfig.presets():
        source = tokenizer or BYTE_LEVEL
        network = None
    else:
        raise ValueError(
            f"{model!r} is neither a checkpoint directory nor a preset; presets: {sorted(TNLGConfig.presets())}"
        )
    loaded = byte_level_tokenizer() if str(source) == BYTE_LEVEL else AutoTokenizer.from_pretrained(source)
    if network is None:
        config = TNLGConfig.from_preset(
            str(model), bos_token_id=loaded.eos_token_id, eos_token_id=loaded.eos_token_id
        )
        logger.info("random %s model: %s", model, config.describe())
        network = TNLGForCausalLM(config).to(dtype)
    if len(loaded) > network.config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(loaded)} tokens but the model's vocabulary has {network.config.vocab_size} rows"
        )
    if loaded.pad_token is None:
        loaded.pad_token = loaded.eos_token
    loaded.padding_side = "left"  # decoder-only: new tokens must follow the prompt directly
    return network.to(device).eval(), loaded


BYTE_LEVEL = "byte-level"


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


@torch.inference_mode()
def generate_texts(
    model: TNLGForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    settings: GenerationSettings = GenerationSettings(),
    batch_size: int = 8,
) -> list[str]:
    """Continuations (without the prompt) of each prompt, decoded; batched with left padding."""
    config = settings.to_generation_config(tokenizer)
    completions: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True)
        batch = batch.to(model.device)
        output = model.generate(**batch, generation_config=config)
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    return completions
