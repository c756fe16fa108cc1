"""Shared by the benchmarks: the benchmark model, its data, and a per-rank tensor census."""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable, Mapping

import torch

from tnlg import TNLGConfig, TNLGForCausalLM

# Big enough that a step is dominated by matmuls on a CPU core, small enough for 4 ranks on 2 cores.
BENCH_MODEL = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def bench_model(seed: int = 0, **overrides) -> TNLGForCausalLM:
    torch.manual_seed(seed)
    return TNLGForCausalLM(TNLGConfig(**{**BENCH_MODEL, **overrides}))


def batch(rank: int, micro_batch: int = 4, seq_len: int = 128) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, BENCH_MODEL["vocab_size"], (micro_batch, seq_len), generator=generator)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by Python's garbage collector.

    Counted without asking the engine: views of one buffer (parameters into a flat buffer) share
    a storage and count once; a released stage-3 buffer has a zero-byte storage.
    """
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() touches deprecated torch.distributed aliases
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, ReferenceError):
            continue
        if storage.nbytes() > 0:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def median_time(step, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rotated(names: list[str], round_: int) -> list[str]:
    """Round `round_`'s order of `names`: shifted by one each round, so that no variant always follows
    the same one (warm caches, a predecessor's dirty lines still being written back)."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def interleaved_medians(
    steps: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds of each step, timed in rounds that run every step once.

    Timing the variants one after another lets a change in machine load (other processes on a
    shared host, clock frequency) land on one variant only; in rounds it lands on all alike. The
    order rotates each round so that no step always follows the same one (warm caches, a
    predecessor's dirty lines still being written back).
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in rotated(names, round_):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}
