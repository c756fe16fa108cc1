"""Step time of tensor slicing and pipeline stages composed with ZeRO beside pure ZeRO-3, 4 processes on
CPU, in one run.

    python -m benchmarks.parallel_layouts

Every layout trains the same model (the benchmark model, fp32, AdamW) on the same global batch of
16 sequences of 128 tokens in the same four processes, one layout after the other, in micro-batches of
the same size (`MICRO_BATCH` sequences) through `engine.train_batch`: each data replica takes its share
of the global batch (data 4: 4 sequences per rank, 2 micro-batches; tensor 2 x data 2 and pipeline 2 x
data 2: 8 per replica, 4 micro-batches; tensor 2 x pipeline 2: all 16, 8 micro-batches), which a
pipeline runs as its 1F1B (or interleaved 1F1B) schedule and the other layouts as gradient
accumulation. The median of `REPEATS` steps after `WARMUP` is reported, the slowest rank's. The
communication each layout moves per step per rank is counted at the engine (ZeRO and the tied
embedding's sum), for tensor slicing at torch.distributed (the per-layer all-reduces), and for
pipeline stages at torch's schedule (the activations and gradients sent between stages).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules

from benchmarks.common import BENCH_MODEL, bench_model, median_time
from tnlg.sharding import ParallelDims, ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

WARMUP, REPEATS = 3, 10
GLOBAL_BATCH, SEQ_LEN, MICRO_BATCH = 16, 128, 2
LAYOUTS = {
    "ZeRO-3, data 4": (ParallelDims(tensor=1), 3),
    "tensor 2 x data 2, ZeRO-1": (ParallelDims(tensor=2), 1),
    "tensor 2 x data 2, ZeRO-2": (ParallelDims(tensor=2), 2),
    "tensor 2 x data 2, ZeRO-3": (ParallelDims(tensor=2), 3),
    "pipeline 2 x data 2, ZeRO-1": (ParallelDims(pipeline=2), 1),
    "pipeline 2 x data 2, ZeRO-2": (ParallelDims(pipeline=2), 2),
    "pipeline 2 x data 2, ZeRO-3": (ParallelDims(pipeline=2), 3),
    "pipeline 2 (interleaved, 2 stages each) x data 2, ZeRO-1": (
        ParallelDims(pipeline=2, virtual_stages=2),
        1,
    ),
    "tensor 2 x pipeline 2, ZeRO-1": (ParallelDims(tensor=2, pipeline=2), 1),
}


def _global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, BENCH_MODEL["vocab_size"], (GLOBAL_BATCH, SEQ_LEN), generator=generator)


class _TensorGroupAllReduces:
    """Bytes all-reduced on the tensor group (tensor slicing's per-layer collectives), at torch.distributed."""

    def __init__(self, group):
        self.group = group
        self.bytes = 0
        self._original = dist.all_reduce

    def __enter__(self):
        @functools.wraps(self._original)
        def counting(tensor, *args, **kwargs):
            if (
                self.group is not None
                and kwargs.get("group", args[1] if len(args) > 1 else None) is self.group
            ):
                self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


class _PipelineSends:
    """Bytes this rank sends to other pipeline stages (activations forward, their gradients backward), at
    torch's schedule, where every point-to-point batch passes."""

    def __init__(self):
        self.bytes = 0
        self._original = schedules._batch_p2p

    def __enter__(self):
        @functools.wraps(self._original)
        def counting(ops, *args, **kwargs):
            self.bytes += sum(
                op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend
            )
            return self._original(ops, *args, **kwargs)

        schedules._batch_p2p = counting
        return self

    def __exit__(self, *exc):
        schedules._batch_p2p = self._original


def _layouts(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    tokens = _global_batch()
    results = {}
    for name, (dims, stage) in LAYOUTS.items():
        model = bench_model()
        engine = initialize(
            model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage), parallel=dims
        )
        data_rank, data_size = engine.parallel.rank("data"), engine.parallel.dims.data
        share = tokens.chunk(data_size)[data_rank]
        micro = [{"input_ids": m, "labels": m} for m in share.split(MICRO_BATCH)]
        step = functools.partial(engine.train_batch, micro)
        dist.barrier()
        seconds = median_time(step, REPEATS, WARMUP)
        dist.barrier()
        engine.reset_comm_stats()
        tensor_group = engine.parallel.group("tensor") if dims.tensor > 1 else None
        with _TensorGroupAllReduces(tensor_group) as counted, _PipelineSends() as sent:
            step()
        zero_bytes = sum(kind["bytes"] for kind in engine.comm_stats().values())
        results[name] = {
            "ms": 1000 * seconds,
            "zero_mb": zero_bytes / 1e6,
            "tensor_mb": counted.bytes / 1e6,
            "pipeline_mb": sent.bytes / 1e6,
        }
        engine.close()
    return results


def main() -> None:
    ranks = run_distributed(_layouts, 4, timeout=1800)
    reference = max(r["ZeRO-3, data 4"]["ms"] for r in ranks)
    print(
        f"model {BENCH_MODEL}, global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens in micro-batches of {MICRO_BATCH}, "
        "fp32, AdamW, 4 processes\n"
    )
    print(
        "| layout | step time (ms) | vs ZeRO-3 | ZeRO collectives (MB/rank) | tensor-group all-reduce (MB/rank) "
        "| pipeline sends (MB/rank) |"
    )
    print("|---|---|---|---|---|---|")
    for name in LAYOUTS:
        slowest = max(r[name]["ms"] for r in ranks)
        # per rank: the most any rank moved (stages and tensor ranks differ)
        zero_mb, tensor_mb, pipeline_mb = (
            max(r[name][key] for r in ranks) for key in ("zero_mb", "tensor_mb", "pipeline_mb")
        )
        print(
            f"| {name} | {slowest:.1f} | {slowest / reference:.3f} | {zero_mb:.1f} | {tensor_mb:.1f} "
            f"| {pipeline_mb:.2f} |"
        )


if __name__ == "__main__":
    main()
