"""`GenerationSettings`: how to decode, as a plain dataclass.

Apart from generation.py so that config code (the fine-tuning run's `evaluation.generation` section)
can hold it without importing the generation and model-loading code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedTokenizerBase

from tnlg.data.tokenizer import pad_id

SAMPLING_ONLY = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class GenerationSettings:
    """How to decode: greedy by default; sampling when `do_sample`; beam search when `num_beams > 1`.

    `temperature`, `top_k` and `top_p` shape sampling only: None leaves Transformers' default, and
    setting one without `do_sample` is refused (`setting_problems`) rather than ignored, as
    Transformers' GenerationConfig warns and ignores them."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    num_beams: int = 1
    use_cache: bool = True

    def to_generation_config(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None
    ) -> GenerationConfig:
        """Transformers' config for these settings. Given the model's `vocab_size`, the rows past the
        tokenizer's ids (a vocabulary padded to split evenly, e.g. GPT-2's 50257 to 50432) are never
        generated: they decode to nothing, so a drawn one would vanish from the text."""
        problems = setting_problems(self)
        if problems:
            name, value, expected = problems[0]
            raise ValueError(f"GenerationSettings.{name} is {value!r}: it must be {expected}")
        sampling = {name: getattr(self, name) for name in SAMPLING_ONLY if getattr(self, name) is not None}
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=self.do_sample,
            num_beams=self.num_beams,
            use_cache=self.use_cache,
            pad_token_id=pad_id(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
            **padded_rows(tokenizer, vocab_size),
        )


def padded_rows(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None) -> dict[str, list[int]]:
    """{"suppress_tokens": the ids from len(tokenizer) to `vocab_size`}, or {} when there are none
    (left out then, so that a model whose vocabulary fits its tokenizer generates exactly as before)."""
    if vocab_size is None or vocab_size <= len(tokenizer):
        return {}
    return {"suppress_tokens": list(range(len(tokenizer), vocab_size))}


def setting_problems(settings: GenerationSettings) -> list[tuple[str, object, str]]:
    """(field, value, what it must be) for each setting out of range, as Transformers would refuse it
    mid-run, or given for sampling without `do_sample`. One list for the library and the run configs."""
    problems: list[tuple[str, object, str]] = []
    if settings.max_new_tokens < 1:
        problems.append(("max_new_tokens", settings.max_new_tokens, ">= 1"))
    if settings.num_beams < 1:
        problems.append(("num_beams", settings.num_beams, ">= 1 (1: no beam search)"))
    temperature, top_k, top_p = settings.temperature, settings.top_k, settings.top_p
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        problems.append(("temperature", temperature, "a finite number > 0"))
    if top_k is not None and top_k < 0:
        problems.append(("top_k", top_k, ">= 0 (0: no top-k filtering)"))
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(("top_p", top_p, "in (0, 1]"))
    if not settings.do_sample:
        for name in SAMPLING_ONLY:
            if getattr(settings, name) is not None:
                value = getattr(settings, name)
                problems.append((name, value, "left unset without do_sample (it shapes sampling only)"))
    return problems
