"""The project's one tokenizer module: the byte-level tokenizer that needs no training or download,
byte-level BPEs trained with `tokenizers` (saved as Transformers tokenizer directories), and
`load_tokenizer`, the one loader every script, run, evaluation and generation uses: a tokenizer by name
or directory, or a model's own (its checkpoint directory's; byte-level for a preset).

`byte_level_tokenizer()` maps every byte to one token (256 tokens plus end-of-text), so any text
round-trips exactly with no trained merges: what a freshly initialised model uses when no trained
tokenizer is at hand (tests, byte-level runs).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
BYTE_LEVEL = "byte-level"  # the name that loads `byte_level_tokenizer()`


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


def load_tokenizer(
    name_or_path: str | Path | None = None, *, model: str | Path | None = None
) -> PreTrainedTokenizerBase:
    """The one tokenizer loader: `byte-level` for the 257-token byte tokenizer, else a local
    Transformers tokenizer directory (a run downloads nothing).

    With `model` (a checkpoint directory or a preset name) the name may be left out: it is then the
    model's own tokenizer (see `tokenizer_source`), and `model` is checked to be one of the two.
    """
    source = tokenizer_source(model, name_or_path) if model is not None else name_or_path
    if not source:
        raise ValueError("no tokenizer to load: give a tokenizer directory or 'byte-level', or a model")
    if str(source) == BYTE_LEVEL:
        return byte_level_tokenizer()
    path = Path(source)
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer directory at {path} (and it is not {BYTE_LEVEL!r})")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {path} has no eos_token: documents cannot be separated when packed, "
            "nor a generation ended"
        )
    return tokenizer


def tokenizer_source(model: str | Path, tokenizer: str | Path | None = None) -> str | Path:
    """Where `model`'s tokenizer comes from: `tokenizer` (a directory, or `byte-level`) when given,
    else the checkpoint directory itself; a preset (random weights) uses the byte-level tokenizer.

    A checkpoint saved without a tokenizer needs `tokenizer`: guessing one would decode its ids into
    the wrong text. `model` that is neither a directory nor a preset is a ValueError.
    """
    # Here, not at the top: only this rule needs the model's presets, and the tokenizer module (which
    # GenerationSettings uses) stays importable without the model.
    from tnlg.modeling import TNLGConfig

    path = Path(model)
    if path.is_dir():
        if not tokenizer and not has_tokenizer(path):
            raise ValueError(
                f"{path} holds no tokenizer files; pass a tokenizer directory (or {BYTE_LEVEL!r} for a model "
                "trained on the byte-level tokenizer)"
            )
        return tokenizer or path
    if str(model) in TNLGConfig.presets():
        return tokenizer or BYTE_LEVEL
    raise ValueError(
        f"{model!r} is neither a checkpoint directory nor a preset; presets: {sorted(TNLGConfig.presets())}"
    )


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a checkpoint directory holds a saved tokenizer (fast `tokenizer.json`, or the
    `tokenizer_config.json` every Transformers tokenizer saves)."""
    return any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """The token ids of each text, with special-token text kept as text.

    [Note: special-token text]
    Corpus documents and task fields are data: a document that quotes `<|endoftext|>` must not get a
    real end-of-text token inside it (a false document boundary in packing, a false end in a prompt).
    `split_special_tokens=True` encodes such text as ordinary characters; the one end-of-text token is
    added by the caller where a document (or target) really ends: packing.py, pretokenized.py, tasks.py.
    """
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`encode_texts` for one text."""
    return encode_texts(tokenizer, [text])[0]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the tokenizer's vocabulary (every token and its id, added tokens included):
    equal for tokenizers that map text to the same ids, recorded with pre-tokenized corpora so that a
    run with another tokenizer of the same size is refused ([Note: corpus tokenizer] in pretokenized.py)."""
    vocabulary = json.dumps(
        sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]), ensure_ascii=False
    )
    return "sha256:" + hashlib.sha256(vocabulary.encode("utf-8")).hexdigest()[:16]


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id batches are padded with: the tokenizer's pad token, else EOS (GPT-2's has no pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
