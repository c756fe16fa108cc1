"""Byte-level BPE tokenizers trained with `tokenizers`, saved as Transformers tokenizer directories."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tnlg.tokenization import as_transformers_tokenizer, byte_level_tokenizer

logger = logging.getLogger(__name__)


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE with `vocab_size` tokens (the last one `<|endoftext|>`).

    Byte-level: every string is encodable (the 256 byte symbols are in the vocabulary), so no
    unknown token exists. EOS doubles as padding, left-padded for generation.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # end-of-text is added after training
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # End-of-text last, so that it has the same id whatever the merges learned.
    return as_transformers_tokenizer(tokenizer)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """`byte-level` for the 257-token byte tokenizer, else a local Transformers tokenizer directory."""
    if str(name_or_path) == "byte-level":
        return byte_level_tokenizer()
    path = Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer directory at {path} (and it is not 'byte-level')")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {path} has no eos_token: documents cannot be separated when packed"
        )
    return tokenizer
