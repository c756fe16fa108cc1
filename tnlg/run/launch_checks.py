"""Checks that every rank of a launch runs the same job: the same run config and the same code.

A multi-node launch starts each node's processes from its own command line and its own checkout;
a node with an edited config or an older tnlg would train something else and fail much later (a
shape mismatch inside a collective, or silently different numerics). Each rank fingerprints its
run config and the tnlg source, the fingerprints are all-gathered, and any difference raises the
same error on every rank before training starts.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import torch.distributed as dist

import tnlg
import tnlg.modeling
import tnlg.sharding


class LaunchMismatchError(RuntimeError):
    pass


@cache
def code_fingerprint() -> str:
    """sha256 over tnlg's Python sources (tnlg, tnlg.modeling, tnlg.sharding), in path order."""
    digest = hashlib.sha256()
    for package in (tnlg, tnlg.modeling, tnlg.sharding):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint(config: dict[str, Any]) -> dict[str, str]:
    return {
        "run config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "tnlg version": tnlg.__version__,
        "tnlg code": code_fingerprint(),
    }


def check_ranks_run_the_same_job(config: dict[str, Any]) -> None:
    """Raise `LaunchMismatchError` on every rank when any rank's config or code differs from rank 0's."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = fingerprint(config)
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    differences = [
        f"rank {rank} has a different {what} ({theirs[what][:12]} vs rank 0's {reference[what][:12]})"
        for rank, theirs in enumerate(everyone)
        for what in reference
        if theirs[what] != reference[what]
    ]
    if differences:
        raise LaunchMismatchError(
            "the ranks of this launch were started with different jobs: "
            + "; ".join(differences[:8])
            + ". Launch every node with the same config file, overrides and tnlg checkout."
        )
