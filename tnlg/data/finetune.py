"""Fine-tuning data: rows from any `datasets` source → encoded examples → resumable batches per rank.

Sources (the fine-tuning config's `data` section): local json / jsonl / csv / parquet files, a
`datasets` builder with `data_files`, a local `save_to_disk` directory, a hub dataset (when the hub is
reachable), or an embedded example set ("embedded:docstrings", "embedded:qa"; no download). All are
read through `datasets`, imported when rows are loaded ([Note: optional datasets] in optional.py).

Batches: every epoch the examples are shuffled (seeded by the run seed and the epoch); with packing
they are then laid, in that order, into rows of `max_length` tokens, each example in one piece with
its positions starting at 0, so that Transformers' mask building (positions restarting without an
attention mask) keeps every example attending only to itself. Without packing a batch is padded to
its longest example. Each optimizer-step slice is `micro_batch_size` rows for each rank, the same
count on every rank (a ZeRO step is collective); the epoch's last incomplete slice is dropped.
The position (epoch, rows consumed) is world-size independent, so a run resumes at another size at
exactly the next row: rows are never repeated or skipped, except that the epoch's last incomplete
slice at the new size is dropped, as at any size.

Files: a path that exists is read as itself, a glob only when it does not (see [Note: literal paths
first] in files.py). Each file is loaded on its own so that every row keeps its file and row number
(counting from 0, as `datasets` does) for messages. A file that is empty or holds no rows, or a
compressed one that is truncated or corrupt, is refused by name (checked in full before `datasets`
reads it, which would read a truncated `.zst` as far as it goes). CSV cells are read as text, as
written: "007" stays "007", never the number 7.

Bad rows (a null, non-text or empty field, a SQuAD row without answers, a target that cannot fit,
an extractive-QA answer that cannot fit its context's room):
`on_long_example="stop"` refuses the first, naming it; `"skip"` drops them, counted by reason.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import logging
import numbers
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tnlg.data.files import (
    DamagedFileError,
    check_compressed,
    compression_of,
    expand_path,
    file_named_twice,
)
from tnlg.data.optional import require_datasets
from tnlg.data.tasks import IGNORE_INDEX, BadExampleError, TaskFormat, encode_example, pad_batch

logger = logging.getLogger(__name__)

# File suffix → the `datasets` builder that reads it (compressed json too).
BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".jsonl.zst": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
EMBEDDED_PREFIX = "embedded:"
MAX_LOGGED_SKIPS = 10  # the first skipped rows are logged by name; all are counted


class Rows(Sequence):
    """The rows of one split, each traceable to where it came from: a file (and its row number) or a
    dataset split. Indexing gives one row as a dict; `table` is the `datasets.Dataset` itself."""

    def __init__(self, table: Any, parts: Sequence[tuple[str, int]]):
        self.table = table
        self.names = [name for name, _ in parts]
        self.starts = list(itertools.accumulate((count for _, count in parts), initial=0))[:-1]

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not isinstance(index, numbers.Integral):  # a Dataset would give a column for a name
            raise TypeError(f"rows are indexed by int, got {type(index).__name__}: use .column(name)")
        return self.table[int(index)]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.table)

    @property
    def column_names(self) -> list[str]:
        return list(self.table.column_names)

    def column(self, name: str) -> list[Any]:
        return list(self.table[name])

    def origin(self, index: int) -> str:
        """Where row `index` came from: "FILE row N" (N counting from 0 in that file)."""
        part = bisect.bisect_right(self.starts, index) - 1
        return f"{self.names[part]} row {index - self.starts[part]}"


def row_name(rows: Any, index: int) -> str:
    """Row `index` of `rows` for a message: its file and row number when `rows` knows them."""
    return rows.origin(index) if isinstance(rows, Rows) else f"row {index}"


def builder_for(paths: Sequence[str]) -> str:
    """The one builder that reads every file in `paths`, from their suffixes."""
    builders = set()
    for path in paths:
        name = Path(path).name
        match = next((b for suffix, b in BUILDERS.items() if name.endswith(suffix)), None)
        if match is None:
            raise ValueError(
                f"{path}: cannot tell the file format from its name; known suffixes: {sorted(BUILDERS)} "
                "(or set data.dataset to the datasets builder: json, csv, parquet)"
            )
        builders.add(match)
    if len(builders) > 1:
        raise ValueError(f"data files of several formats ({sorted(builders)}): use one format per split")
    return builders.pop()


def load_rows(
    dataset: str | None, paths: Sequence[str], split: str, dataset_config: str | None = None
) -> Rows:
    """The raw rows of a split (see the module docstring for what `dataset` may be); ValueError
    naming the file or split when there are none."""
    if dataset is None and not paths:
        raise ValueError("no data source: set data.dataset or data.paths")
    if dataset is not None and dataset.startswith(EMBEDDED_PREFIX):
        from tnlg.data.embedded_tasks import embedded_dataset_files

        require_datasets(f"reading the embedded set {dataset!r}")  # asked before building the set
        return _load_files("json", None, [Path(f) for f in embedded_dataset_files(dataset, split)])
    if paths:
        files = data_files(paths)
        return _load_files(dataset or builder_for([str(f) for f in files]), dataset_config, files)
    datasets = require_datasets(f"reading the fine-tuning dataset {dataset!r}")
    local = Path(dataset)
    if is_saved_dataset(dataset):
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{dataset} has splits {sorted(loaded)}, not {split!r}")
            loaded = loaded[split]
    else:
        if local.is_dir():  # a directory of data files: datasets would read a damaged one as far as it goes
            for path in sorted(local.rglob("*")):
                if path.is_file() and compression_of(path) is not None:
                    check_compressed(path)
        loaded = datasets.load_dataset(dataset, dataset_config, split=split)
    name = f"{dataset}:{split}"
    if len(loaded) == 0:
        raise ValueError(f"{name} holds no rows: no examples")
    return Rows(loaded, [(name, len(loaded))])


def is_saved_dataset(dataset: str) -> bool:
    """Whether `dataset` is a directory `save_to_disk` wrote (read with `load_from_disk`)."""
    local = Path(dataset)
    return local.is_dir() and any((local / n).is_file() for n in ("dataset_info.json", "dataset_dict.json"))


def validation_rows(
    dataset: str | None,
    validation_paths: Sequence[str],
    validation_split: str | None,
    dataset_config: str | None = None,
) -> Rows | None:
    """The held-out rows: the `validation_paths` files (read with `dataset` as their builder when it
    is one), else the `validation_split` of `dataset`; None when neither is given."""
    if validation_paths:
        # An embedded set is no builder for files: read them by their extension (passing it on would
        # score the embedded training rows in place of the files).
        builder = None if dataset is not None and dataset.startswith(EMBEDDED_PREFIX) else dataset
        return load_rows(builder, validation_paths, "train", dataset_config)
    if validation_split:
        return load_rows(dataset, [], validation_split, dataset_config)
    return None


def data_files(paths: Sequence[str]) -> list[Path]:
    """The files `paths` name, each existing path itself, else its glob matches (see the module
    docstring); FileNotFoundError naming every path that matches nothing, ValueError naming a file
    that two paths name ([Note: each file once] in files.py)."""
    matches = [(pattern, expand_path(pattern)) for pattern in paths]
    missing = [pattern for pattern, found in matches if not found]
    if missing:
        raise FileNotFoundError(f"no data files match {missing}")
    files = [path for _, found in matches for path in found]
    for path in files:
        if path.is_dir():
            raise IsADirectoryError(
                f"{path} is a directory: give its files, or a glob such as {path}/*.jsonl"
            )
    if twice := file_named_twice(matches):
        raise ValueError(f"{twice}, so its rows would be read twice: name each file once")
    return files


def _load_files(builder: str, dataset_config: str | None, files: Sequence[Path]) -> Rows:
    datasets = require_datasets("reading fine-tuning data files")

    tables = [_load_file(builder, dataset_config, path) for path in files]
    try:
        table = tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)
    except ValueError as error:
        raise ValueError(
            f"the files {[str(f) for f in files]} do not have the same columns ({error})"
        ) from error
    return Rows(table, [(str(path), len(t)) for path, t in zip(files, tables, strict=True)])


def _load_file(builder: str, dataset_config: str | None, path: Path) -> Any:
    """One file's rows, refusing an empty, damaged or unreadable file by name."""
    datasets = require_datasets(f"reading the fine-tuning file {path}")

    if compression_of(path) is not None:
        if check_compressed(path) == 0:  # a 0-byte compressed file is damaged (DamagedFileError)
            raise ValueError(f"{path} holds no data once decompressed: no examples")
    elif path.stat().st_size == 0:
        raise ValueError(f"{path} is empty (0 bytes): no examples")
    options = _csv_as_text(path) if builder == "csv" else {}
    try:
        # Escaped: datasets globs data_files, and this is an existing file, taken literally.
        rows = datasets.load_dataset(
            builder, dataset_config, data_files=[glob.escape(str(path))], split="train", **options
        )
    except Exception as error:  # datasets wraps what its builders raise (pyarrow, pandas, json) in many types
        cause = error.__cause__ or error
        # No rows: the json builder finds no table at all (StopIteration), and a split of 0 rows cannot
        # be read back ('Instruction "train" corresponds to no data!').
        if isinstance(cause, StopIteration) or "corresponds to no data" in str(cause):
            raise ValueError(f"{path} holds no rows: no examples") from error
        if builder == "parquet" and _is_arrow_error(cause):
            raise DamagedFileError(path, f"it cannot be read as parquet ({cause})") from error
        raise ValueError(
            f"{path} cannot be read as {builder} data ({type(cause).__name__}: {cause})"
        ) from error
    if len(rows) == 0:
        raise ValueError(f"{path} holds no rows: no examples")
    return rows


def _csv_as_text(path: Path) -> dict[str, Any]:
    """`load_dataset` options reading every CSV column as text: letting pandas guess the types would
    turn "007" into 7 and "1e3" into 1000.0."""
    datasets = require_datasets(f"reading the CSV file {path}")
    import pandas  # a dependency of datasets: imported after it, so its absence is named first

    columns = pandas.read_csv(path, nrows=0).columns  # the header alone
    return {"features": datasets.Features({str(c): datasets.Value("string") for c in columns})}


def _is_arrow_error(error: BaseException) -> bool:
    import pyarrow

    return isinstance(error, pyarrow.ArrowException)


def encode_rows(
    rows: Any,
    task: TaskFormat,
    tokenizer,
    *,
    on_long_example: str = "stop",
    max_examples: int | None = None,
    where: str = "data",
) -> list[dict[str, list[int]]]:
    """Every row through `encode_example`. A row that cannot make an example (`BadExampleError`:
    a null, non-text or empty field, no answer, a target that cannot fit) stops the run naming the
    row, or with `on_long_example="skip"` is dropped and counted by reason. A missing column or a
    bad template is never skipped: every row would fail alike."""
    examples: list[dict[str, list[int]]] = []
    skipped: Counter[str] = Counter()
    for index, row in enumerate(rows):
        if max_examples is not None and len(examples) >= max_examples:
            break
        try:
            examples.append(encode_example(row, task, tokenizer))
        except BadExampleError as error:
            if on_long_example != "skip":
                raise BadExampleError(
                    f"{where}: {row_name(rows, index)}: {error} (data.on_long_example: skip drops such rows)",
                    error.reason,
                ) from error
            if sum(skipped.values()) < MAX_LOGGED_SKIPS:
                logger.warning("%s: skipping %s: %s", where, row_name(rows, index), error)
            skipped[error.reason] += 1
        except (KeyError, ValueError) as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            raise ValueError(f"{where}: {row_name(rows, index)}: {message}") from error
    if skipped:
        logger.warning("%s: %d examples skipped (%s)", where, sum(skipped.values()), _reasons(skipped))
    if not examples:
        detail = f": all {sum(skipped.values())} rows were skipped ({_reasons(skipped)})" if skipped else ""
        raise ValueError(f"{where}: no examples{detail}")
    return examples


def _reasons(counts: Counter[str]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in counts.most_common())


def pack_examples(examples: Sequence[Mapping[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Examples laid in order into rows of at most `max_length` tokens, never split; `position_ids`
    restart at 0 with each example, so each attends only to itself (see the module docstring)."""
    rows: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for example in examples:
        length = len(example["input_ids"])
        if length > max_length:
            raise ValueError(f"an example of {length} tokens is longer than the row ({max_length})")
        if len(current["input_ids"]) + length > max_length:
            rows.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += example["input_ids"]
        current["labels"] += example["labels"]
        current["position_ids"] += list(range(length))
    if current["input_ids"]:
        rows.append(current)
    return rows


def collate_packed(rows: Sequence[Mapping[str, list[int]]], max_length: int, pad_token_id: int) -> dict:
    """Packed rows padded to `max_length`; the padding is one more sequence (its own positions from 0)
    with no loss, so no attention mask is needed."""
    batch = {
        "input_ids": torch.full((len(rows), max_length), pad_token_id, dtype=torch.long),
        "labels": torch.full((len(rows), max_length), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), max_length), dtype=torch.long),
    }
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(row["input_ids"])
        batch["labels"][i, :n] = torch.tensor(row["labels"])
        batch["position_ids"][i, :n] = torch.tensor(row["position_ids"])
        batch["position_ids"][i, n:] = torch.arange(max_length - n)
    return batch


class FinetuneBatches:
    """This rank's endless batches over the encoded examples, epoch after epoch (see the module
    docstring); `state_dict` / `load_state_dict` resume mid-epoch."""

    def __init__(
        self,
        examples: Sequence[Mapping[str, list[int]]],
        *,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        pad_token_id: int,
        packing: bool = False,
        max_length: int | None = None,
    ):
        if packing and max_length is None:
            raise ValueError("packing needs max_length")
        self.examples, self.micro_batch_size = list(examples), micro_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.pad_token_id, self.packing, self.max_length = pad_token_id, packing, max_length
        self.epoch, self.consumed = 0, 0  # rows of this epoch consumed by all ranks together
        self._shuffled: tuple[int, list] | None = None  # (epoch, its rows): packed once per epoch
        rows = len(self._rows(0))
        if rows < micro_batch_size * world_size:
            raise ValueError(
                f"{len(self.examples)} examples make {rows} rows, fewer than one step needs "
                f"(micro_batch_size {micro_batch_size} x {world_size} processes)"
            )

    def _rows(self, epoch: int) -> list[Mapping[str, list[int]]]:
        if self._shuffled is None or self._shuffled[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.examples), generator=generator).tolist()
            shuffled = [self.examples[i] for i in order]
            self._shuffled = (epoch, pack_examples(shuffled, self.max_length) if self.packing else shuffled)
        return self._shuffled[1]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        slice_rows = self.micro_batch_size * self.world_size
        while True:
            rows = self._rows(self.epoch)
            while self.consumed + slice_rows <= len(rows):
                start = self.consumed + self.rank * self.micro_batch_size
                mine = rows[start : start + self.micro_batch_size]
                self.consumed += slice_rows
                if self.packing:
                    yield collate_packed(mine, self.max_length, self.pad_token_id)
                else:
                    yield pad_batch(mine, self.pad_token_id)
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "examples": len(self.examples)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["examples"] != len(self.examples):
            raise ValueError(
                f"the checkpoint's data had {state['examples']} examples, this run has {len(self.examples)}: "
                "resume with the same data settings"
            )
        # Each slice takes the next micro_batch_size x world_size rows of the epoch from `consumed`, whatever
        # that is: a position saved at another size (6 rows, by 2 processes of 3, resumed on 4) resumes at
        # exactly that row, and the rows follow in the uninterrupted order.
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        rows = len(self._rows(epoch))
        if not 0 <= consumed <= rows:
            raise ValueError(
                f"the checkpoint's data position (row {consumed} of epoch {epoch}) is outside the epoch's "
                f"{rows} rows: resume with the same data settings (task.max_length, data.packing)"
            )
        self.epoch, self.consumed = epoch, consumed
