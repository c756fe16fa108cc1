"""Pretraining data: corpus sources (files or `datasets`), packing, mixtures, shuffling, the
pre-tokenized format, tokenizer training, and the embedded default corpus."""

from .files import DamagedFileError
from .packing import Mixture, PackedSource, ShuffleBuffer
from .pretokenized import PretokenizedCorpus, PretokenizedStream, write_pretokenized
from .sources import BadRecordError, DocumentReader, SourceConfig
from .stream import StreamConfig, TokenStream

__all__ = [
    "BadRecordError",
    "DamagedFileError",
    "DocumentReader",
    "Mixture",
    "PackedSource",
    "PretokenizedCorpus",
    "PretokenizedStream",
    "ShuffleBuffer",
    "SourceConfig",
    "StreamConfig",
    "TokenStream",
    "write_pretokenized",
]
