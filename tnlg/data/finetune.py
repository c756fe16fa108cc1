"""Fine-tuning data: rows from any `datasets` source → encoded examples → resumable batches per rank.

Sources (tnlg.finetune_config.FinetuneDataSection): local json / jsonl / csv / parquet files, a
`datasets` builder with `data_files`, a local `save_to_disk` directory, a hub dataset (when the hub is
reachable), or an embedded example set ("embedded:docstrings", "embedded:qa"; no download).

Batches: every epoch the examples are shuffled (seeded by the run seed and the epoch); with packing
they are then laid, in that order, into rows of `max_length` tokens, each example in one piece with
its positions starting at 0, so that Transformers' mask building (positions restarting without an
attention mask) keeps every example attending only to itself. Without packing a batch is padded to
its longest example. Each optimizer-step slice is `micro_batch_size` rows for each rank, the same
count on every rank (a ZeRO step is collective); the epoch's last incomplete slice is dropped.
The position (epoch, rows consumed) is world-size independent, so a run resumes at another size.
"""

from __future__ import annotations

import glob
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tnlg.data.tasks import IGNORE_INDEX, TaskFormat, encode_example, pad_batch

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


def load_rows(dataset: str | None, paths: Sequence[str], split: str, dataset_config: str | None = None):
    """A `datasets.Dataset` of raw rows (see the module docstring for what `dataset` may be)."""
    import datasets

    if dataset is not None and dataset.startswith(EMBEDDED_PREFIX):
        from tnlg.data.embedded_tasks import embedded_dataset_files

        return datasets.load_dataset("json", data_files=embedded_dataset_files(dataset, split), split="train")
    if paths:
        missing = [p for p in paths if not glob.glob(p)]
        if missing:
            raise FileNotFoundError(f"no data files match {missing}")
        builder = dataset or builder_for(paths)
        return datasets.load_dataset(builder, dataset_config, data_files=list(paths), split="train")
    if dataset is None:
        raise ValueError("no data source: set data.dataset or data.paths")
    local = Path(dataset)
    if local.is_dir() and any((local / n).is_file() for n in ("dataset_info.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{dataset} has splits {sorted(loaded)}, not {split!r}")
            return loaded[split]
        return loaded
    return datasets.load_dataset(dataset, dataset_config, split=split)


def encode_rows(
    rows: Any,
    task: TaskFormat,
    tokenizer,
    *,
    on_long_example: str = "stop",
    max_examples: int | None = None,
    where: str = "data",
) -> list[dict[str, list[int]]]:
    """Every row through `encode_example`; a row whose target cannot fit stops the run (naming the
    row) or, with `on_long_example="skip"`, is dropped and counted."""
    examples, skipped = [], 0
    for index, row in enumerate(rows):
        if max_examples is not None and len(examples) >= max_examples:
            break
        try:
            examples.append(encode_example(row, task, tokenizer))
        except (KeyError, ValueError) as error:
            if on_long_example == "skip" and isinstance(error, ValueError):
                skipped += 1
                continue
            raise ValueError(f"{where}: row {index}: {error}") from error
    if skipped:
        logger.warning("%s: %d examples skipped (their target does not fit task.max_length)", where, skipped)
    if not examples:
        raise ValueError(f"{where}: no examples")
    return examples


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
        slice_rows = self.micro_batch_size * self.world_size
        self.epoch, self.consumed = state["epoch"], state["consumed"] // slice_rows * slice_rows
        if self.consumed != state["consumed"]:
            logger.warning(
                "the data position (%d rows) is not a whole step at this size; resuming at row %d",
                state["consumed"], self.consumed,
            )  # fmt: skip
