"""`GenerationSettings`: how to decode, as a plain dataclass.

Apart from generation.py so that config code (the fine-tuning run's `evaluation.generation` section)
can hold it without importing the generation and model-loading code.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedTokenizerBase

from tnlg.data.tokenizer import pad_id


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
            pad_token_id=pad_id(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            **(sampling if self.do_sample else {}),
        )
