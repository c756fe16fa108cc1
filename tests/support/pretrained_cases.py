"""Rank functions for tests/sharding/test_zero_pretrained.py (module level, so spawned processes can import them)."""

from __future__ import annotations

import torch

from tnlg import TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize, meta_from_pretrained
from tnlg.sharding.checkpoint import CheckpointError

SEED = 5


def load_sharded(
    rank: int,
    world_size: int,
    path: str,
    stage: int,
    strict: bool = True,
    verify_checksums: bool | str = True,
) -> dict:
    """The engine's view of a checkpoint loaded straight into this rank's shards."""
    model = meta_from_pretrained(TNLGForCausalLM, path, strict=strict, verify_checksums=verify_checksums)
    engine = initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        ZeroConfig(stage=stage, param_persistence_threshold=0),
        init_seed=SEED,
    )
    ids = torch.arange(24).reshape(2, 12) % engine.module.config.vocab_size
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return {
        "state": engine.full_state_dict(),
        "bytes_read": engine.pretrained_bytes_read,
        "master_bytes": engine.memory_stats()["master"],
        "logits": logits,
    }


def load_error(rank: int, world_size: int, path: str, verify_checksums: bool | str = True) -> str:
    """The error every rank raises for a checkpoint that cannot be loaded (no rank hangs)."""
    try:
        load_sharded(rank, world_size, path, stage=3, verify_checksums=verify_checksums)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def _memory_mb() -> tuple[int, int]:
    """(current, peak) resident memory of this process in MB; the peak is reset by `_reset_peak`."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current resident size (Linux)


def peak_memory_of_loading(rank: int, world_size: int, path: str) -> dict:
    """Peak resident growth (MB) while loading into stage 3 shards, next to the naive way: the whole
    model loaded on every rank by from_pretrained, then sharded."""
    config = ZeroConfig(stage=3, mixed_precision="bf16")
    model = meta_from_pretrained(TNLGForCausalLM, path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.distributed.barrier()  # all ranks load at once, as in a real launch
    _reset_peak()
    before, _ = _memory_mb()
    engine = initialize(model, optimizer, config)
    _, peak = _memory_mb()
    sharded = {"peak_mb": peak - before, "engine_mb": engine.memory_stats()["total"] / 2**20}
    del engine, model, optimizer
    torch.distributed.barrier()
    _reset_peak()
    before, _ = _memory_mb()
    model = TNLGForCausalLM.from_pretrained(path)
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    _, peak = _memory_mb()
    naive = {"peak_mb": peak - before, "engine_mb": engine.memory_stats()["total"] / 2**20}
    return {"sharded": sharded, "naive": naive}
