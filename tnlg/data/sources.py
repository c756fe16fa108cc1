"""Reading the documents of one corpus source, one rank's share, with an exact resumable position.

A source is a list of files (globs allowed): `.jsonl`, `.jsonl.zst`, `.jsonl.gz`, `.json` (Pile-style:
one JSON object per line, or in a `.json` file a JSON array of them; the text under `text_field`, the
Pile's subset name under `meta.pile_set_name`), or `.parquet` (read through `datasets` streaming, one row per record).
Instead of files, a source can name a `datasets` dataset (`dataset=`, with `dataset_config` and
`split`): a hub name when the hub is reachable, or a local dataset directory; it is read with
`load_dataset(..., streaming=True)`, its rows numbered in the split's order like one file's lines.
Only parquet files and `dataset=` sources need `datasets`, and only `.jsonl.zst` files `zstandard`
([Note: optional datasets] in optional.py).

[Note: record sharding]
Records (lines, rows) are numbered across the source's files in the epoch's file order; rank r of
W reads records r, r+W, r+2W, ...: every record is read by exactly one rank per epoch, at every
world size, and a rank decides which records are its own without parsing anyone else's. The
position (epoch, file, record within file, records seen) is the whole state: resuming re-opens the
file and skips to it. Each epoch visits the files in an order shuffled by (seed, epoch).

Bad records (malformed JSON, a missing or non-string text field, empty text, bytes that are not
UTF-8) are counted per source and reason, and logged with file and line; `on_bad_record="fatal"`
raises instead. An unreadable or damaged file (a truncated or corrupt `.zst` / `.gz`, a parquet file
that is not one) is always fatal: see [Note: damaged files] in files.py. Paths that exist are taken
literally, globs only when they do not ([Note: literal paths first]); a file that two paths name is
refused ([Note: each file once] in files.py).
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import random
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .blend import check_weight
from .files import DamagedFileError, expand_path, file_named_twice, read_lines
from .optional import loaded_error_types, require_datasets

logger = logging.getLogger(__name__)

FORMATS = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json", ".parquet")
BAD_RECORD_POLICIES = ("skip", "fatal")
MAX_LOGGED_PER_SOURCE = 20  # the first bad records of a source are logged with file and line; all are counted


class EmptyEpochError(ValueError):
    """A whole epoch of a source gave this rank no document (every record skipped, filtered or absent)."""


class BadRecordError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One corpus source: files, its weight in the mixture, and where its text is.

    `pile_set_name` keeps only the documents of that Pile subset (`meta.pile_set_name`), so that a
    mixture can weight the subsets of the same files, as Megatron's data blends do.
    """

    name: str
    paths: tuple[str, ...] = ()
    dataset: str | None = None  # a `datasets` name (hub) or local dataset directory, instead of paths
    dataset_config: str | None = None
    split: str = "train"
    weight: float = 1.0
    text_field: str = "text"
    pile_set_name: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SourceConfig.name must not be empty")
        if bool(self.paths) == bool(self.dataset):
            raise ValueError(
                f"source {self.name!r}: give either paths (files or globs) or dataset (a datasets name), "
                f"got paths={list(self.paths)} dataset={self.dataset!r}"
            )
        check_weight(f"source {self.name!r}", self.weight)

    def files(self) -> list[Path | DatasetSplit]:
        """The source's files, globs expanded, sorted (or its one dataset split); raises naming what
        matched nothing, and a file that two paths name ([Note: each file once] in files.py)."""
        if self.dataset:
            return [DatasetSplit(self.dataset, self.dataset_config, self.split)]
        matches = [(pattern, expand_path(pattern)) for pattern in self.paths]
        found: list[Path | DatasetSplit] = []
        for pattern, files in matches:
            if not files:
                raise FileNotFoundError(f"source {self.name!r}: {pattern} matches no file")
            found.extend(files)
        for path in found:
            if path.is_dir():
                raise ValueError(
                    f"source {self.name!r}: {path} is a directory: give its files, or a glob such as {path}/*.jsonl.zst"
                )
            if not path.name.endswith(FORMATS):
                raise ValueError(f"source {self.name!r}: {path} is not one of {list(FORMATS)}")
        if twice := file_named_twice(matches):
            raise ValueError(
                f"source {self.name!r}: {twice}, so its records would be read twice each epoch: name each file "
                "once (a source's weight in the mixture is how to read it more often)"
            )
        return found


@dataclass(frozen=True)
class DatasetSplit:
    """One split of a `datasets` dataset, read as one stream of records."""

    name: str
    config: str | None
    split: str

    def __str__(self) -> str:
        return f"{self.name}{f'[{self.config}]' if self.config else ''}:{self.split}"


@dataclass
class SourceStats:
    documents: int = 0
    skipped: Counter = field(default_factory=Counter)  # bad records: reason -> count
    filtered: int = 0  # records of other Pile subsets


@dataclass
class Document:
    text: str
    pile_set_name: str | None


class DocumentReader:
    """One rank's documents of one source, endlessly (epoch after epoch), resumable exactly."""

    def __init__(
        self,
        source: SourceConfig,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        on_bad_record: str = "skip",
    ):
        if on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(
                f"on_bad_record must be one of {list(BAD_RECORD_POLICIES)}, got {on_bad_record!r}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.source = source
        self.files = source.files()
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.on_bad_record = on_bad_record
        self.stats = SourceStats()
        self._skipped_when_logged = 0  # skipped and filtered records at the last epoch's log line
        self.epoch = 0
        self.file_index = 0  # position in this epoch's file order
        self.record = 0  # next record (line / row) to read in the current file
        self.seen = 0  # records of this epoch before the current file's `record`, all ranks'
        self._logged = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "source": self.source.name,
            "epoch": self.epoch,
            "file_index": self.file_index,
            "record": self.record,
            "seen": self.seen,
            "documents": self.stats.documents,
            "skipped": dict(self.stats.skipped),
            "filtered": self.stats.filtered,
            "files": self.file_listing(),
        }

    def file_listing(self) -> list[list[Any]]:
        """[name, size in bytes] of each file (size None for a dataset split): what a position is into.

        [Note: resumed file list]
        The position (file index, record) means the same documents only over the same files: a glob
        that matches other files after a restart (one added, one removed, one rewritten) would resume
        silently into other documents. The state records the files and `load_state_dict` refuses another
        list; a state without it (saved before) is accepted with a warning.
        """
        return [[str(f), f.stat().st_size if isinstance(f, Path) else None] for f in self.files]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["source"] != self.source.name:
            raise ValueError(f"reader state is for source {state['source']!r}, not {self.source.name!r}")
        self._check_same_files(state.get("files"))
        self.epoch, self.file_index = int(state["epoch"]), int(state["file_index"])
        self.record, self.seen = int(state["record"]), int(state["seen"])
        self.stats = SourceStats(int(state["documents"]), Counter(state["skipped"]), int(state["filtered"]))

    def _check_same_files(self, saved: list[list[Any]] | None) -> None:
        """[Note: resumed file list]: refuse a resume over other files than the saved position's."""
        if saved is None:
            logger.warning(
                "source %r: the saved data position does not record its files (saved by an older version): "
                "resuming assumes %s are the same files as then",
                self.source.name,
                _some(self.files),
            )
            return
        before, now = {name: size for name, size in saved}, {name: size for name, size in self.file_listing()}
        added, removed = sorted(now.keys() - before.keys()), sorted(before.keys() - now.keys())
        resized = sorted(name for name in now.keys() & before.keys() if now[name] != before[name])
        if added or removed or resized:
            raise ValueError(
                f"source {self.source.name!r}: its files changed since the data position was saved (added: "
                f"{added or 'none'}; removed: {removed or 'none'}; changed size: {resized or 'none'}), so the "
                "position would point into other documents; restore those files, or start the data from the "
                "beginning (a new run)"
            )

    # ------------------------------------------------------------------ reading
    def file_order(self, epoch: int) -> list[Path | DatasetSplit]:
        order = list(self.files)
        if epoch > 0:  # epoch 0 reads in sorted order; later epochs in a seeded shuffle
            random.Random(f"{self.seed}:{self.source.name}:{epoch}").shuffle(order)
        return order

    def first_epoch_texts(self) -> Iterator[str]:
        """The texts of the current epoch only (for one-pass jobs: tokenizer training, pre-tokenizing).
        It stops at the epoch's end: reading on to find that a next one had begun counted the next
        epoch's bad records before its first document into the statistics (and logged them again)."""
        for document in self._rest_of_epoch():
            yield document.text

    def __iter__(self) -> Iterator[Document]:
        while True:
            yield from self._rest_of_epoch()

    def _rest_of_epoch(self) -> Iterator[Document]:
        """The documents from the current position to the end of the epoch; the position then moves on
        to the next epoch's start (an epoch read whole that gave no document is an EmptyEpochError)."""
        whole_epoch = self.file_index == 0 and self.record == 0
        produced = False
        order = self.file_order(self.epoch)
        while self.file_index < len(order):
            path = order[self.file_index]
            for document in self._read_file(path):
                produced = True
                yield document
            self.file_index += 1
            self.record = 0
        if whole_epoch and not produced:
            # Endless reading would otherwise spin over an epoch that can never give a document.
            raise EmptyEpochError(
                f"source {self.source.name!r} ({_some(order)}) gives rank {self.rank} of "
                f"{self.world_size} no document in a whole epoch ({self.seen} records, skipped: "
                f"{dict(self.stats.skipped)}, other Pile subsets: {self.stats.filtered})"
            )
        self._log_epoch_end()
        self.epoch += 1
        self.file_index = 0
        self.seen = 0

    def _log_epoch_end(self) -> None:
        # Only the first bad records are logged one by one: the totals reach the user here. At info the
        # first time a source starts over and whenever an epoch skipped more records; other epochs at
        # debug (a small corpus starts over every few steps: 137 lines in the README's 300-step run).
        skipped = sum(self.stats.skipped.values()) + self.stats.filtered
        news = self.epoch == 0 or skipped > self._skipped_when_logged
        self._skipped_when_logged = skipped
        logger.log(
            logging.INFO if news else logging.DEBUG,
            "source %r (rank %d of %d): epoch %d read, starting epoch %d; so far %d documents, bad records "
            "skipped: %s, other Pile subsets: %d",
            self.source.name,
            self.rank,
            self.world_size,
            self.epoch,
            self.epoch + 1,
            self.stats.documents,
            dict(self.stats.skipped) or "none",
            self.stats.filtered,
        )

    def _read_file(self, path: Path | DatasetSplit) -> Iterator[Document]:
        if isinstance(path, DatasetSplit):
            records = _dataset_records(path)
        elif path.name.endswith(".parquet"):
            records = _parquet_records(path)
        elif path.name.endswith(".json"):
            records = _json_records(path)
        else:
            records = read_lines(path)
        resumed_at, available = self.record, 0
        try:
            for index, raw in enumerate(records):
                available = index + 1
                if index < self.record:
                    continue  # before the resumed position (already consumed)
                mine = (self.seen + index) % self.world_size == self.rank
                self.record = index + 1
                if not mine:
                    continue
                document = self._parse(raw, path, index + 1)
                if document is not None:
                    self.stats.documents += 1
                    yield document
        except OSError as error:
            raise OSError(f"source {self.source.name!r}: cannot read {path}: {error}") from error
        if available < resumed_at:
            raise ValueError(
                f"source {self.source.name!r}: {path} holds {available} records, but the saved data position "
                f"is at record {resumed_at} of it: the file changed since; restore it, or start the data anew"
            )
        self.seen += self.record

    def _parse(self, raw: bytes | dict, path: Path | DatasetSplit, line: int) -> Document | None:
        if isinstance(raw, bytes):
            try:
                text_line = raw.decode("utf-8")
            except UnicodeDecodeError:
                return self._bad("not UTF-8", path, line)
            if not text_line.strip():
                return self._bad("empty line", path, line)
            try:
                record = json.loads(text_line)
            except json.JSONDecodeError as error:
                return self._bad(f"malformed JSON ({error.msg})", path, line)
        else:
            record = raw
        if not isinstance(record, dict):
            return self._bad("not a JSON object", path, line)
        text = record.get(self.source.text_field)
        if text is None:
            return self._bad(f"no {self.source.text_field!r} field", path, line)
        if not isinstance(text, str):
            return self._bad(f"{self.source.text_field!r} is not a string", path, line)
        if not text.strip():
            return self._bad("empty document", path, line)
        meta = record.get("meta")
        subset = meta.get("pile_set_name") if isinstance(meta, dict) else None
        subset = subset if isinstance(subset, str) else None
        if self.source.pile_set_name is not None and subset != self.source.pile_set_name:
            self.stats.filtered += 1
            return None
        return Document(text, subset)

    def _bad(self, reason: str, path: Path | DatasetSplit, line: int) -> None:
        self.stats.skipped[reason] += 1
        message = f"source {self.source.name!r}: {path}:{line}: {reason}"
        if self.on_bad_record == "fatal":
            raise BadRecordError(message)
        if self._logged < MAX_LOGGED_PER_SOURCE:
            self._logged += 1
            logger.warning("skipping %s", message)
        return None


def _json_records(path: Path) -> Iterator[bytes | dict]:
    """A `.json` file's records: the elements of a JSON array (as `datasets`' json loader reads one),
    else its lines (JSON lines under a .json name). An array is read whole, as `datasets` does."""
    with open(path, "rb") as file:
        head = file.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from read_lines(path)
        return
    try:
        rows = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedFileError(path, f"it starts as a JSON array but is not valid JSON ({error})") from error
    if not isinstance(rows, list):
        raise DamagedFileError(path, f"it holds a JSON {type(rows).__name__}, not an array of records")
    yield from rows


def _parquet_records(path: Path) -> Iterator[dict]:
    datasets = require_datasets(f"reading the parquet file {path}")
    import pyarrow  # a dependency of datasets: imported after it, so its absence is named first

    try:
        # Escaped: datasets globs data_files, and the path is an existing file, taken literally.
        yield from datasets.load_dataset(
            "parquet", data_files=glob.escape(str(path)), split="train", streaming=True
        )
    except pyarrow.ArrowException as error:
        raise DamagedFileError(path, f"it cannot be read as parquet ({error})") from error


def _dataset_records(split: DatasetSplit) -> Iterator[dict]:
    """The rows of a `datasets` split, streamed (no download of the whole dataset first)."""
    datasets = require_datasets(f"reading the dataset {split}")
    try:
        rows = datasets.load_dataset(split.name, split.config, split=split.split, streaming=True)
    except Exception as error:  # datasets raises many types (offline, not found, bad config, bad split)
        raise OSError(f"the dataset cannot be opened ({type(error).__name__}: {error})") from error
    try:
        yield from rows
    except (EOFError, zlib.error, gzip.BadGzipFile, *loaded_error_types(("zstandard", "ZstdError"))) as error:
        # datasets decompresses the dataset's files itself: a damaged one surfaces as one of these. The
        # tuple is built when an error arrives: a ZstdError implies zstandard was imported by then, and a
        # dataset without .zst files must not need it ([Note: optional datasets] in optional.py).
        raise DamagedFileError(
            split, f"a compressed file in it cannot be read ({type(error).__name__}: {error})"
        ) from error


def _some(files: list[Path | DatasetSplit], shown: int = 3) -> str:
    """The first few of a list of files, for a message."""
    names = ", ".join(map(str, files[:shown]))
    return names if len(files) <= shown else f"{names} and {len(files) - shown} more"
