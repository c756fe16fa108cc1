"""Rank functions for the harness's own tests (tests/tools/test_spawn.py)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def rank_view(rank: int, world_size: int, names: list[str]) -> dict:
    """What a rank sees: its place, a collective over all ranks, the named variables, whether it was
    forked from the preloaded server (tnlg.trainer is imported on first use, and only the server
    imports it unasked)."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": total.item(),
        "environ": {name: os.environ.get(name) for name in names},
        "preloaded": "tnlg.trainer" in sys.modules,
    }


def raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no traceback, no report: as a crash in C++ or a kill would end it
    return rank  # no collective: rank 0 reports, and the harness waits on rank 1 alone
