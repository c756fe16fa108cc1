"""The pretraining token stream of one rank: sources → packed sequences → mixture → shuffle → batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .packing import Mixture, PackedSource, ShuffleBuffer
from .sources import BAD_RECORD_POLICIES, DocumentReader, SourceConfig


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How one rank's stream is built. `shuffle_buffer` counts sequences (1 = no shuffling)."""

    sources: tuple[SourceConfig, ...]
    seq_len: int
    seed: int = 0
    shuffle_buffer: int = 1024
    on_bad_record: str = "skip"
    sources_by_name: dict[str, SourceConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("StreamConfig.sources must name at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"StreamConfig.sources: names must be unique, got {names}")
        if self.seq_len <= 0:
            raise ValueError(f"StreamConfig.seq_len must be positive, got {self.seq_len}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"StreamConfig.shuffle_buffer must be >= 1, got {self.shuffle_buffer}")
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(f"StreamConfig.on_bad_record must be one of {list(BAD_RECORD_POLICIES)}")
        object.__setattr__(self, "sources_by_name", {s.name: s for s in self.sources})


class TokenStream(torch.utils.data.IterableDataset):
    """Endless `{"input_ids", "labels"}` batches of `batch_size` packed sequences for one rank.

    Labels equal the inputs: the model shifts them. The stream is already this rank's share of the
    data (see [Note: record sharding] in sources.py): give it to a `DataLoader` with no sampler
    and `batch_size=None`, and do not let a launcher shard it again.
    """

    def __init__(
        self,
        config: StreamConfig,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.config, self.batch_size = config, batch_size
        self.rank, self.world_size = rank, world_size
        packed = [
            PackedSource(
                DocumentReader(source, rank, world_size, config.seed, config.on_bad_record),
                tokenizer,
                config.seq_len,
            )
            for source in config.sources
        ]
        self.mixture = Mixture(packed, [s.weight for s in config.sources])
        # Each rank shuffles with its own generator: the ranks' streams are disjoint anyway.
        self.shuffle = ShuffleBuffer(self.mixture, config.shuffle_buffer, seed=config.seed * 1000 + rank)
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "batches": self.batches,
            "shuffle": self.shuffle.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"the streamed data position was saved at world size {state['world_size']} and is per rank: it "
                f"cannot continue at world size {self.world_size}. Resume at {state['world_size']} processes, or "
                "train from pre-tokenized data (scripts/prepare_data.py, data.pretokenized), whose position "
                "carries over to any world size"
            )
        if state["rank"] != self.rank:
            raise ValueError(f"data state saved by rank {state['rank']} cannot resume rank {self.rank}")
        self.shuffle.load_state_dict(state["shuffle"])
        self.batches = int(state["batches"])

    def stats(self) -> dict[str, dict[str, Any]]:
        """Documents read and records skipped (by reason) per source, on this rank."""
        return {
            s.name: {"documents": s.reader.stats.documents, "skipped": dict(s.reader.stats.skipped)}
            for s in self.mixture.sources
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            rows = np.stack([next(self.shuffle) for _ in range(self.batch_size)])
            self.batches += 1
            input_ids = torch.from_numpy(rows)
            yield {"input_ids": input_ids, "labels": input_ids.clone()}
