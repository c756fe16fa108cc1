"""Tokenize, pack, mix and shuffle: documents → fixed-length token sequences, resumable exactly.

Each stage is an iterator with `state_dict()` / `load_state_dict()`; the state of the whole
stream is small (positions, counts, the packing remainder, the shuffle buffer and its RNG) and a
restored stream yields exactly what the uninterrupted one would have.

- `PackedSource`: a source's documents, tokenized in batches, an end-of-text token after each,
  concatenated and cut into `seq_len` tokens: no padding, documents cross sequence boundaries.
- `Mixture`: sources interleaved by weight, deterministically: each next sequence comes from the
  source furthest behind its share ([Note: the deficit rule] in blend.py), so the mix is exact at
  every prefix, not only in expectation.
- `ShuffleBuffer`: a buffer of sequences drawn from at random with a seeded generator; unlike
  `datasets`' shuffle buffer its contents and generator state are part of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from .blend import blend_shares, next_corpus
from .sources import DocumentReader
from .tokenizer import encode_texts

TOKENIZE_BATCH = 64  # documents tokenized per call: the fast tokenizer parallelises within a call


class PackedSource:
    """`seq_len`-token sequences of one source's documents (for one rank)."""

    def __init__(self, reader: DocumentReader, tokenizer: PreTrainedTokenizerBase, seq_len: int):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id: documents cannot be separated when packed")
        self.reader, self.tokenizer, self.seq_len = reader, tokenizer, seq_len
        self.eos = tokenizer.eos_token_id
        self._documents = iter(reader)
        self._buffer = np.zeros(0, dtype=np.int64)  # tokenized, not yet emitted

    @property
    def name(self) -> str:
        return self.reader.source.name

    def state_dict(self) -> dict[str, Any]:
        # The reader's position is after the last tokenized document: what it read but has not
        # emitted yet is in the buffer.
        return {"reader": self.reader.state_dict(), "buffer": self._buffer.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reader.load_state_dict(state["reader"])
        self._documents = iter(self.reader)
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        while len(self._buffer) < self.seq_len:
            self._refill()
        sequence, self._buffer = self._buffer[: self.seq_len], self._buffer[self.seq_len :]
        return sequence

    def _refill(self) -> None:
        texts = [next(self._documents).text for _ in range(TOKENIZE_BATCH)]
        encoded = encode_texts(self.tokenizer, texts)  # [Note: special-token text] in tokenizer.py
        pieces = [self._buffer]
        for ids in encoded:
            pieces.append(np.asarray(ids, dtype=np.int64))
            pieces.append(np.asarray([self.eos], dtype=np.int64))
        self._buffer = np.concatenate(pieces)


class Mixture:
    """Sequences from several sources in proportion to their weights, deterministically."""

    def __init__(self, sources: Sequence[PackedSource], weights: Sequence[float]):
        if len(sources) != len(weights) or not sources:
            raise ValueError("a mixture needs one weight per source, and at least one source")
        self.sources = list(sources)
        self.shares = blend_shares(weights)
        self.counts = np.zeros(len(sources), dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts.tolist(), "sources": {s.name: s.state_dict() for s in self.sources}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [s.name for s in self.sources]
        if sorted(state["sources"]) != sorted(names):
            raise ValueError(
                f"data state has sources {sorted(state['sources'])}, the config has {sorted(names)}"
            )
        self.counts = np.asarray(state["counts"], dtype=np.int64)
        for source in self.sources:
            source.load_state_dict(state["sources"][source.name])

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        # The source furthest below its share of the sequences so far ([Note: the deficit rule] in blend.py).
        chosen = next_corpus(self.shares, int(self.counts.sum()), self.counts)
        self.counts[chosen] += 1
        return next(self.sources[chosen])


class ShuffleBuffer:
    """Draws uniformly from a buffer of `size` sequences, refilled from `source`; checkpointable."""

    def __init__(self, source: Iterator[np.ndarray], size: int, seed: int):
        if size < 1:
            raise ValueError(f"shuffle buffer size must be >= 1, got {size}")
        self.source, self.size = source, size
        self.random = np.random.default_rng(seed)
        self.buffer: list[np.ndarray] = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "buffer": [b.tolist() for b in self.buffer],
            "random": self.random.bit_generator.state,
            "source": self.source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.buffer = [np.asarray(b, dtype=np.int64) for b in state["buffer"]]
        self.random.bit_generator.state = state["random"]

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        while len(self.buffer) < self.size:
            self.buffer.append(next(self.source))
        index = int(self.random.integers(len(self.buffer)))
        self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
        return self.buffer.pop()
