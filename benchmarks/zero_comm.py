"""Communication volume per step per rank, counted by wrapping torch.distributed, against DDP.

    python -m benchmarks.zero_comm

The wrappers are installed on `torch.distributed` before the engine is imported, so every
collective it issues passes through them; the engine's own counters are printed beside them as a
cross-check. DDP reduces from C++ by default, so it is given the stock `allreduce_hook`, which
all-reduces each gradient bucket through `dist.all_reduce` (the same computation), to be counted. Volume is counted as in the ZeRO paper (section 7): an all-reduce
of n bytes moves 2n (a reduce-scatter then an all-gather), a reduce-scatter or an all-gather of
an n-byte (full) buffer moves n. DDP's all-reduce of the gradients is the 2Ψ baseline.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

COUNTS: Counter = Counter()


def _count(kind: str, nbytes_of):
    def wrap(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            COUNTS[kind] += nbytes_of(*args, **kwargs)
            return function(*args, **kwargs)

        return wrapper

    return wrap


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def install_counters() -> None:
    """Wrap the torch.distributed collectives (both the new *_single and the older names)."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):  # counted by the output: the full gathered buffer
            setattr(
                dist, name, _count("all_gather", lambda out, inp, *a, **k: _nbytes(out))(getattr(dist, name))
            )
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):  # counted by the input: the full buffer being reduced
            setattr(
                dist,
                name,
                _count("reduce_scatter", lambda out, inp, *a, **k: _nbytes(inp))(getattr(dist, name)),
            )
    dist.all_reduce = _count("all_reduce", lambda t, *a, **k: 2 * _nbytes(t))(dist.all_reduce)
    dist.broadcast = _count("broadcast", lambda t, *a, **k: _nbytes(t))(dist.broadcast)


install_counters()

from benchmarks.common import batch, bench_model  # noqa: E402
from tnlg.sharding import ZeroConfig, initialize  # noqa: E402
from tnlg.tools.spawn import run_distributed  # noqa: E402


def _step_volume(rank: int, world_size: int, stage: int | None) -> dict:
    input_ids = batch(rank)
    if stage is None:
        model = bench_model().to(torch.bfloat16)
        ddp = torch.nn.parallel.DistributedDataParallel(model)

        # DDP's default reduction runs in C++; its Python all-reduce hook computes the same thing
        # through `dist.all_reduce`, where the wrapper counts it.
        ddp.register_comm_hook(None, allreduce_hook)
        optimizer = torch.optim.AdamW(model.parameters())
        psi = sum(p.numel() for p in model.parameters())

        def step():
            ddp(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        engine_counted = None
    else:
        model = bench_model()
        psi = sum(p.numel() for p in model.parameters())
        engine = initialize(
            model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage, mixed_precision="bf16")
        )

        def step():
            engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
            engine.step()

    step()  # warm-up: DDP rebuilds its buckets after the first step
    COUNTS.clear()
    if stage is not None:
        engine.reset_comm_stats()
    step()
    if stage is not None:
        stats = engine.comm_stats()
        engine_counted = sum(v["bytes"] * (2 if kind == "all_reduce" else 1) for kind, v in stats.items())
    return {"psi": psi, "volume": dict(COUNTS), "engine_counted": engine_counted}


def main() -> None:
    world_size = 2
    ddp = run_distributed(_step_volume, world_size, None, timeout=600)[0]
    baseline = sum(ddp["volume"].values())
    psi = ddp["psi"]
    print(
        f"Ψ = {psi:,} parameters, bf16 gradients; DDP moves {baseline:,} bytes per step per rank "
        f"({baseline / (2 * psi * 2):.4f} x 2Ψ elements of 2 bytes)"
    )
    print(
        "| run | all-gather | reduce-scatter | all-reduce (x2) | total bytes | vs DDP | engine's own count |"
    )
    print("|---|---|---|---|---|---|---|")
    print(f"| DDP | 0 | 0 | {ddp['volume'].get('all_reduce', 0):,} | {baseline:,} | 1.0000 | - |")
    for stage in (1, 2, 3):
        result = run_distributed(_step_volume, world_size, stage, timeout=600)[0]
        volume = result["volume"]
        total = sum(volume.values())
        print(
            f"| ZeRO-{stage} | {volume.get('all_gather', 0):,} | {volume.get('reduce_scatter', 0):,} | "
            f"{volume.get('all_reduce', 0):,} | {total:,} | {total / baseline:.4f} | {result['engine_counted']:,} |"
        )


if __name__ == "__main__":
    main()
