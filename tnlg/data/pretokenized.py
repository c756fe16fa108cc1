"""A pre-tokenized, memory-mapped corpus format for fast pretraining, and its sampler.

On disk, for a prefix P:
- `P.bin`: every document's tokens followed by end-of-text, concatenated (uint16 when the
  vocabulary fits, else uint32);
- `P.idx`: int64 document start offsets into `P.bin` (one more than the documents: the end);
- `P.json`: metadata (dtype, vocabulary size, end-of-text id, counts, the tokenizer used).

Sequence i of length L is tokens[i*L : (i+1)*L]: documents are packed with no padding, read
with random access from the memory map. `PretokenizedStream` orders the sequences of one or more
such corpora globally (a seeded permutation per corpus and epoch, blended by weight with the same
deterministic rule as the streaming path) and gives rank r of W the global samples r, r+W, ...:
the position is one integer, so resuming is exact, and the global order is the same at every
world size. The saved position is the number of global samples taken (every rank takes as many
as the others), so a run saved at world size N resumes at world size M on the very next global
sample: with the same global batch (micro-batch x accumulation x world), it trains on exactly
the batches the uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .blend import blend_shares, check_weight, counts_before, next_corpus
from .files import DamagedFileError
from .tokenizer import encode_texts, tokenizer_fingerprint

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
WRITE_BATCH = 256  # documents tokenized per call
MAX_SCANNED_BYTES = 64 << 20  # a corpus without a recorded largest id is scanned when this small


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class NoDocumentsError(ValueError):
    """`write_pretokenized` was given no text: nothing to write (a reader's own errors pass through)."""


def write_pretokenized(
    texts: Iterable[str], tokenizer: PreTrainedTokenizerBase, prefix: str | Path, progress=None
) -> dict[str, Any]:
    """Tokenize `texts` into `prefix`.bin/.idx/.json (written to temporary names, renamed at the end).

    Nothing is left behind when reading the texts fails (a damaged input file) or there are none:
    an earlier corpus at `prefix` stays as it was."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: documents cannot be separated")
    staged = {suffix: prefix.with_name(prefix.name + suffix + ".tmp") for suffix in (".bin", ".idx", ".json")}
    try:
        meta = _write_staged(texts, tokenizer, staged, progress)
    except BaseException:
        for path in staged.values():
            path.unlink(missing_ok=True)
        raise
    if meta["documents"] == 0:
        for path in staged.values():
            path.unlink()
        raise NoDocumentsError(f"no documents to write to {prefix}: the input holds no text")
    for suffix, path in staged.items():
        os.replace(path, prefix.with_name(prefix.name + suffix))
    return meta


def _write_staged(
    texts: Iterable[str], tokenizer: PreTrainedTokenizerBase, staged: dict[str, Path], progress
) -> dict[str, Any]:
    eos = tokenizer.eos_token_id
    dtype = token_dtype(len(tokenizer))
    offsets = [0]
    max_id = [eos]
    with open(staged[".bin"], "wb") as tokens_file:
        batch: list[str] = []

        def flush() -> None:
            for ids in encode_texts(tokenizer, batch):  # [Note: special-token text] in tokenizer.py
                array = np.asarray([*ids, eos], dtype=dtype)
                tokens_file.write(array.tobytes())
                offsets.append(offsets[-1] + len(array))
                max_id[0] = max(max_id[0], int(array.max()))
            if progress is not None:
                progress.update(len(batch))
            batch.clear()

        for text in texts:
            batch.append(text)
            if len(batch) == WRITE_BATCH:
                flush()
        if batch:
            flush()
    np.asarray(offsets, dtype=np.int64).tofile(staged[".idx"])
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "documents": len(offsets) - 1,
        "tokens": offsets[-1],
        "max_token_id": max_id[0],  # checked when the corpus is opened, without reading it whole
        "tokenizer": getattr(tokenizer, "name_or_path", "") or "",
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
    }
    staged[".json"].write_text(json.dumps(meta, indent=2))
    return meta


class PretokenizedCorpus:
    """Random access to the `seq_len`-token sequences of one pre-tokenized corpus."""

    def __init__(self, prefix: str | Path, seq_len: int):
        self.prefix = Path(prefix)
        meta_path = self.prefix.with_name(self.prefix.name + ".json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"no pre-tokenized corpus at {self.prefix} ({meta_path} is missing)")
        self.meta = read_meta(meta_path)
        bin_path = self.prefix.with_name(self.prefix.name + ".bin")
        expected = self.meta["tokens"] * np.dtype(self.meta["dtype"]).itemsize
        if not bin_path.is_file():
            raise FileNotFoundError(f"{bin_path} is missing ({meta_path} describes it): truncated or missing")
        if bin_path.stat().st_size != expected:
            raise DamagedFileError(
                bin_path,
                f"it should hold {expected} bytes ({self.meta['tokens']} tokens), it holds "
                f"{bin_path.stat().st_size}: truncated or missing data",
            )
        self.tokens = np.memmap(bin_path, dtype=np.dtype(self.meta["dtype"]), mode="r")
        self._check_token_ids(bin_path)
        self.seq_len = seq_len
        self.num_sequences = len(self.tokens) // seq_len
        if self.num_sequences == 0:
            raise ValueError(
                f"{self.prefix} holds {len(self.tokens)} tokens, fewer than one sequence of {seq_len}"
            )

    def __len__(self) -> int:
        return self.num_sequences

    def _check_token_ids(self, bin_path: Path) -> None:
        """An id at or above the vocabulary would fail deep in the model (an index error, a device
        assert): refuse it here, naming the file. Files record their largest id; for older ones only a
        small file is scanned (np.max over a memmap reads it whole)."""
        largest = self.meta.get("max_token_id")
        if largest is None and self.tokens.nbytes <= MAX_SCANNED_BYTES and len(self.tokens):
            largest = int(self.tokens.max())
        if largest is not None and largest >= self.meta["vocab_size"]:
            raise DamagedFileError(
                bin_path,
                f"it holds token id {largest}, beyond its vocabulary of {self.meta['vocab_size']} tokens",
            )

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Refuse a run tokenizer other than the one this corpus was written with.

        [Note: corpus tokenizer]
        A corpus's ids mean text only under the tokenizer that wrote them: training on them with
        another one (even of the same size) teaches the model the wrong text, and its end-of-text id
        marks no document end. The metadata records the vocabulary size, the end-of-text id and (files
        written since) a fingerprint of the vocabulary (tokenizer.py); all that is recorded must match.
        """
        recorded = {
            "vocab_size": (self.meta["vocab_size"], len(tokenizer)),
            "eos_token_id": (self.meta["eos_token_id"], tokenizer.eos_token_id),
        }
        if "tokenizer_fingerprint" in self.meta:  # files written before fingerprints: what is recorded
            recorded["vocabulary fingerprint"] = (
                self.meta["tokenizer_fingerprint"],
                tokenizer_fingerprint(tokenizer),
            )
        differ = [f"{key} {corpus} vs {run}" for key, (corpus, run) in recorded.items() if corpus != run]
        if differ:
            raise ValueError(
                f"{self.prefix} was tokenized with another tokenizer ({self.meta.get('tokenizer') or 'unnamed'}) "
                f"than this run's ({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}): corpus vs run "
                f"{', '.join(differ)}; set data.tokenizer to the corpus's tokenizer, or prepare the corpus again "
                "with this one (scripts/prepare_data.py)"
            )

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len], dtype=np.int64)


def read_meta(path: Path) -> dict[str, Any]:
    """A corpus's metadata, checked: DamagedFileError naming the file when it is not what
    `write_pretokenized` writes."""
    try:
        meta = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedFileError(path, f"it is not valid JSON ({error})") from error
    if not isinstance(meta, dict):
        raise DamagedFileError(path, f"it holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    missing = [
        key for key in ("dtype", "tokens", "documents", "vocab_size", "eos_token_id") if key not in meta
    ]
    if missing:
        raise DamagedFileError(path, f"it lacks {missing}")
    if meta["dtype"] not in ("uint16", "uint32") or not isinstance(meta["tokens"], int) or meta["tokens"] < 0:
        raise DamagedFileError(path, f"dtype {meta['dtype']!r} / tokens {meta['tokens']!r} are not valid")
    counts = {key: meta.get(key) for key in ("documents", "vocab_size", "eos_token_id", "max_token_id")}
    wrong = {key: value for key, value in counts.items() if key in meta and not _is_count(value)}
    if wrong:  # compared with integers later, where a string raised TypeError naming no file
        raise DamagedFileError(
            path, "; ".join(f"{key} {value!r} is not a whole number >= 0" for key, value in wrong.items())
        )
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class PretokenizedStream(torch.utils.data.IterableDataset):
    """Endless `{"input_ids", "labels"}` batches for one rank from weighted pre-tokenized corpora."""

    def __init__(
        self,
        corpora: Sequence[PretokenizedCorpus],
        weights: Sequence[float],
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        if len(corpora) != len(weights) or not corpora:
            raise ValueError("one weight per corpus, and at least one corpus")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        for corpus, weight in zip(corpora, weights, strict=True):
            hint = "; leave the corpus out instead of weighting it 0"
            check_weight(f"pre-tokenized corpus {corpus.prefix}", weight, hint)
        self.corpora, self.batch_size, self.seed = list(corpora), batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.shares = blend_shares(weights)
        self.start = 0  # the global sample this world size started from (after a resume)
        self.sample = 0  # this rank's samples taken since then
        self._permutations: dict[tuple[int, int], np.ndarray] = {}
        self._memo = (0, np.zeros(len(self.corpora), dtype=np.int64))  # blend counts before a sample index

    def state_dict(self) -> dict[str, Any]:
        """The position as global samples taken, the same on every rank (they take equal numbers)."""
        return {
            "global_samples": self.start + self.sample * self.world_size,
            "seed": self.seed,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the next global sample, at this stream's world size whatever the saved one."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"data state was saved with seed {state['seed']}, this stream has seed {self.seed}"
            )
        if "global_samples" in state:
            self.start = int(state["global_samples"])
        else:  # written before positions were global: that rank's count at its world size
            self.start = int(state["sample"]) * int(state["world_size"])
        self.sample = 0

    def global_sample(self, index: int) -> np.ndarray:
        """Sample `index` of the global order (the same whatever the world size)."""
        corpus, nth = self._blend(index)
        size = len(self.corpora[corpus])
        epoch, within = divmod(nth, size)
        return self.corpora[corpus][int(self._permutation(corpus, epoch, size)[within])]

    def _blend(self, index: int) -> tuple[int, int]:
        """(corpus, how many samples that corpus gave before) for global sample `index`, by the deficit
        rule ([Note: the deficit rule] in blend.py). The counts before `index` come from the last index
        asked (the next sample of this rank is `world_size` further: a short replay), or, resumed far
        from it, from `counts_before`, whose cost [Note: blend counts at any index] states."""
        if len(self.corpora) == 1:
            return 0, index
        counts = self._counts_before(index)
        chosen = next_corpus(self.shares, index, counts)
        return chosen, int(counts[chosen])

    def _counts_before(self, index: int) -> np.ndarray:
        start, counts = self._memo
        if index < start:
            start, counts = 0, None
        counts = counts_before(self.shares, index, start, counts)
        self._memo = (index, counts)
        return counts

    def _permutation(self, corpus: int, epoch: int, size: int) -> np.ndarray:
        key = (corpus, epoch)
        if key not in self._permutations:
            self._permutations = {k: v for k, v in self._permutations.items() if k[1] >= epoch - 1}
            self._permutations[key] = np.random.default_rng([self.seed, corpus, epoch]).permutation(size)
        return self._permutations[key]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            rows = []
            for _ in range(self.batch_size):
                rows.append(self.global_sample(self.start + self.sample * self.world_size + self.rank))
                self.sample += 1
            input_ids = torch.from_numpy(np.stack(rows))
            yield {"input_ids": input_ids, "labels": input_ids.clone()}


def read_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Helper for tests and scripts: the texts of JSON-lines sources, in order (bad lines skipped)."""
    from .sources import DocumentReader, SourceConfig

    for path in paths:
        yield from DocumentReader(SourceConfig(name=str(path), paths=(str(path),))).first_epoch_texts()
