"""Step time of ZeRO stages 1-3 beside DDP and PyTorch FSDP2, 2 processes on CPU, in one run.

    python -m benchmarks.zero_speed

Every configuration runs in the same two processes, one after the other, on the same model
(fp32), data and optimizer (AdamW); the median of `REPEATS` steps after `WARMUP` is reported.
"compute only" is the same step on each rank's local batch with no communication at all (each
rank runs it at the same time, so the two cores are shared as in the other runs).

Communication hidden behind compute: with `overlap_comm=False` the engine reduces after backward,
so t(no overlap) - t(compute only) is the time its communication costs when exposed;
hidden = (t(no overlap) - t(overlap)) / (t(no overlap) - t(compute only)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import batch, bench_model, median_time
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

WARMUP, REPEATS = 3, 15


def _timed(step) -> float:
    dist.barrier()
    seconds = median_time(step, REPEATS, WARMUP)
    dist.barrier()
    return seconds


def _all_configurations(rank: int, world_size: int) -> dict[str, float]:
    input_ids = batch(rank)
    times: dict[str, float] = {}

    def plain_step(forward, optimizer):
        def step():
            forward(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    model = bench_model()
    times["compute only (no communication)"] = _timed(
        plain_step(model, torch.optim.AdamW(model.parameters()))
    )

    model = bench_model()
    ddp = DistributedDataParallel(model)
    times["DDP"] = _timed(plain_step(ddp, torch.optim.AdamW(model.parameters())))

    model = bench_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    times["FSDP2 (fully_shard per block)"] = _timed(plain_step(model, torch.optim.AdamW(model.parameters())))

    for stage in (1, 2, 3):
        for overlap in (True, False):
            model = bench_model()
            engine = initialize(
                model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage, overlap_comm=overlap)
            )

            def engine_step(engine=engine):
                engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
                engine.step()

            times[f"ZeRO-{stage}" + ("" if overlap else " (overlap_comm=False)")] = _timed(engine_step)
    return times


def main() -> None:
    per_rank = run_distributed(_all_configurations, 2, timeout=900)
    times = {
        name: max(rank[name] for rank in per_rank) for name in per_rank[0]
    }  # the slower rank sets the pace
    ddp, fsdp = times["DDP"], times["FSDP2 (fully_shard per block)"]
    compute = times["compute only (no communication)"]
    print("| configuration | step time (ms) | vs DDP | vs FSDP2 |")
    print("|---|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / ddp:.3f} | {seconds / fsdp:.3f} |")
    print()
    print("| stage | exposed communication without overlap (ms) | hidden by overlap |")
    print("|---|---|---|")
    for stage in (1, 2, 3):
        serial, overlapped = times[f"ZeRO-{stage} (overlap_comm=False)"], times[f"ZeRO-{stage}"]
        exposed = serial - compute
        hidden = (serial - overlapped) / exposed if exposed > 0 else float("nan")
        print(f"| {stage} | {exposed * 1e3:.1f} | {hidden:.0%} |")


if __name__ == "__main__":
    main()
