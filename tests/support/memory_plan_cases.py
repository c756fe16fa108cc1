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


def measured_tensor_memory(rank: int, world_size: int, stage: int) -> dict:
    """Model-state bytes of the tiny TNLG model after a step at tensor 2 x data 2 (fp32)."""
    from tests.support.parallel_cases import tnlg_batches, tnlg_optimizer
    from tests.support.tensor_parallel_cases import make_model as make_tnlg
    from tnlg.sharding import ParallelDims

    model = make_tnlg()
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    engine = initialize(model, tnlg_optimizer(model), config, parallel=ParallelDims(tensor=2))
    ids, labels = tnlg_batches(1)[0]
    engine.train_batch([{"input_ids": ids[:2], "labels": labels[:2]}])
    stats = engine.memory_stats()
    engine.close()
    return stats


def measured_pipeline_memory(rank: int, world_size: int, stage: int, layers: int) -> dict:
    """Model-state bytes of the tiny TNLG model (tied embeddings) after a step at pipeline 2 x data 2
    (fp32), and which pipeline rank this rank is."""
    from tests.support.parallel_cases import tnlg_batches, tnlg_optimizer
    from tests.support.tensor_parallel_cases import make_model as make_tnlg
    from tnlg.sharding import ParallelDims

    model = make_tnlg(num_hidden_layers=layers)
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    engine = initialize(model, tnlg_optimizer(model), config, parallel=ParallelDims(pipeline=2))
    ids, labels = tnlg_batches(1)[0]
    data_rank = engine.parallel.rank("data")
    share = slice(2 * data_rank, 2 * data_rank + 2)
    micro = [
        {"input_ids": i[None], "labels": t[None]} for i, t in zip(ids[share], labels[share], strict=True)
    ]
    engine.train_batch(micro)
    stats = engine.memory_stats()
    pipeline_rank = engine.parallel.rank("pipeline")
    engine.close()
    return {"stats": stats, "pipeline_rank": pipeline_rank}
