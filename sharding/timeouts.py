"""The engine's process groups wait as long as the world's.

[Note: group timeouts]
A collective that waits longer than its group's timeout aborts the job (on NCCL asynchronously, by
crashing the process). Users set that timeout once, for the world: `init_process_group(timeout=)`,
Accelerate's `InitProcessGroupKwargs(timeout=)`, the Trainer's `ddp_timeout` (30 minutes by default).
Every group `dist.new_group` or a `DeviceMesh` creates afterwards takes the backend's default instead
(10 minutes on NCCL, 30 on gloo), not the world's, and the engine's heaviest waits run on its own groups:
stage 3's all-gathers on the gather group, and with tensor slicing or pipeline stages every reduction,
the checkpoint barriers (a rank waits there while another writes and hashes its shard) and a first step
that compiles on one rank longer than on another. So each group the engine creates takes the world's
timeout: `new_group(timeout=world_timeout())`, and the mesh's groups through `adopt_world_timeout`
(`init_device_mesh` takes a timeout only inside backend-specific options).

torch has no public reader of a group's timeout: `world_timeout` reads it from the world's backend
options (`_timeout`, the attribute torch's own DeviceMesh reads). Should a release move it, or a
backend refuse `ProcessGroup.set_timeout` (one that does not implement it: MPI, UCC, a custom one), the
groups keep the backend defaults with a warning saying so; tests/sharding/test_group_timeouts.py reads
every group's timeout, on gloo and (gpu-marked) on NCCL.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["adopt_world_timeout", "world_timeout"]

logger = logging.getLogger(__name__)


def world_timeout() -> timedelta | None:
    """The timeout the default process group was created with, or None (no process group, or a torch
    that keeps it where this cannot read it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            timeout = world._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):  # no backend for that device, or moved
            continue
        if isinstance(timeout, timedelta):
            return timeout
    logger.warning(
        "this torch keeps the world process group's timeout where tnlg cannot read it: the engine's own "
        "groups take the backend's default timeout, not the world's ([Note: group timeouts])"
    )
    return None


def adopt_world_timeout(group: dist.ProcessGroup, timeout: timedelta | None) -> None:
    """Give `group` (one this rank belongs to) `timeout`, the world's (`world_timeout()`, read once by the
    caller); the world itself and a None timeout are left alone."""
    if timeout is None or group is dist.group.WORLD:
        return
    try:
        group.set_timeout(timeout)
    except RuntimeError as error:  # a backend without setTimeout
        logger.warning(
            "a process group keeps its backend's default timeout, not the world's %s: %s ([Note: group "
            "timeouts])",
            timeout,
            error,
        )
