"""Tokenizers that need no download.

`byte_level_tokenizer()` maps every byte to one token (256 tokens plus end-of-text), so any text
round-trips exactly with no trained merges. It is what a freshly initialised model uses when no
trained tokenizer is at hand (tests, the default CPU run); trained BPE tokenizers come from
`tokenizers` and load with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


def byte_level_tokenizer(eos_token: str = END_OF_TEXT) -> PreTrainedTokenizerFast:
    """A 257-token byte-level tokenizer: ids 0-255 are bytes (in ByteLevel's alphabet order), 256 is EOS.

    EOS doubles as the padding token, padding on the left, which is what batched generation with a
    decoder-only model needs.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting is needed when every byte is its own token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return as_transformers_tokenizer(tokenizer, eos_token)


def as_transformers_tokenizer(tokenizer: Tokenizer, eos_token: str = END_OF_TEXT) -> PreTrainedTokenizerFast:
    """A `tokenizers` tokenizer as a Transformers one, with `eos_token` appended as the last id.

    End-of-text doubles as BOS and padding, padding on the left: what a decoder-only model needs
    for packing and for batched generation.
    """
    tokenizer.add_special_tokens([eos_token])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos_token,
        bos_token=eos_token,
        pad_token=eos_token,
        padding_side="left",
    )
