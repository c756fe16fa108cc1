"""What each rank runs to compare the meta-device memory plan with a real engine."""

from __future__ import annotations

import torch

from tests.support.zero_cases import SMALL
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.params import Block


def measured_memory(rank: int, world_size: int, stage: int) -> dict:
    """One training step on gloo: the engine's model-state bytes after it, and the most gathered
    elements and reduce-bucket elements alive at once during it."""
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": stage}))
    peaks = {"gathered": 0, "buckets": 0}
    original_gather, original_reduce = Block.gather, engine.reducer._reduce

    def gather(block: Block) -> None:
        original_gather(block)
        peaks["gathered"] = max(peaks["gathered"], engine.scheduler.live_numel())

    def reduce(g, unit) -> None:  # the new bucket is filled while the earlier ones are in flight
        peaks["buckets"] = max(peaks["buckets"], engine.reducer.in_flight_numel() + unit.numel)
        original_reduce(g, unit)

    Block.gather = gather
    engine.reducer._reduce = reduce
    try:
        loss = engine(*local(batches(1)[0], rank, world_size))
        engine.backward(loss)
        engine.step()
    finally:
        Block.gather = original_gather
    stats = engine.memory_stats()
    engine.close()
    return {"stats": stats, "peaks": peaks, "compute_bytes": torch.tensor([]).element_size()}
