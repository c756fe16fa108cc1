"""Rank functions for the harness's own tests (tests/tools/test_spawn.py)."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

# Read once, when a rank imports this module: the harness must have put the caller's environment in
# place by then, as a spawned interpreter would have it.
PROBE_AT_IMPORT = os.environ.get("TNLG_SPAWN_PROBE")


def rank_view(rank: int, world_size: int, names: list[str]) -> dict:
    """What a rank sees: its place, a collective over all ranks, the named variables (now and when this
    module was imported), a draw from torch's generator, and whether it came from the preloaded server
    (tnlg.run.pretrain is imported on first use, and only the server imports it unasked)."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": total.item(),
        "environ": {name: os.environ.get(name) for name in names},
        "probe_at_import": PROBE_AT_IMPORT,
        "draw": torch.rand(1).item(),
        "preloaded": "tnlg.run.pretrain" in sys.modules,
    }


def raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def exit_on_rank_one(rank: int, world_size: int) -> int:
    # Both ranks first finish building the group: gloo connects its mesh on each side in turn, and a rank
    # 1 gone before rank 0's side was done failed rank 0's init_process_group instead ("Connection closed
    # by peer", seen once in CI), so the run named rank 0's error, not rank 1's exit.
    dist.barrier()
    if rank == 1:
        os._exit(3)  # no traceback, no report: as a crash in C++ or a kill would end it
    return rank  # rank 0 reports, and the harness waits on rank 1 alone


def read_the_store_after_rank_zero_returned(rank: int, world_size: int) -> str:
    """Rank 0 returns at once; rank 1 reads the store rank 0 hosts a second later, as a rank still
    building a process group does (gloo's groups are set up through it)."""
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=20)
    )
    if rank == 0:
        store.set("left by rank 0", "still readable")
        return "returned"
    time.sleep(1.0)
    return store.get("left by rank 0").decode()
