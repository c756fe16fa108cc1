"""A save's ranks agree that every write succeeded and that the checkpoint is on storage they all share.

[Note: shared checkpoint storage]
An engine checkpoint is one set of files: each rank writes its shard beside the others', one rank the
manifest (the commit point), and a load reads every manifest and the shards covering its range. On disks
only one node reads (a node-local /tmp, a path naming another mount on each node) each node holds a piece
and the save used to succeed, the resume failing later on the nodes that lack the manifest; where the
directory did not exist on a node, that node's ranks failed alone and the others waited in the save's
next collective until the process group's timeout. So every step of a save is agreed, over the ranks
that save together (the world with tensor slicing or stages):

- after the directory is made, every rank sees it;
- a write that fails on one rank (disk full, permissions, a directory it cannot see) fails on every
  rank, naming that rank and its host, before the next collective (any other error too: [Note: agreed
  failures] in checkpoint_files.py);
- after the manifest is written, every rank reads the bytes rank 0 wrote (their sha256): a directory
  present on every node but not shared is found at the save. When a rank does not, rank 0 removes the
  manifest, so the save is never taken for whole on the node that holds it.

A file a rank does not see yet is looked for again for up to `LATE_FILE_WAIT_S` (NFS caches a directory's
attributes for up to 60 s by default, `acdirmax`); only a failing save waits.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from tnlg.modeling.loading import sha256_of

from .checkpoint_files import STORAGE_ERRORS, CheckpointError, RankFailure, raise_agreed, raised_where
from .collectives import Collectives

__all__ = ["LATE_FILE_WAIT_S", "check_directory_shared", "check_manifest_shared", "write_on_every_rank"]

T = TypeVar("T")
LATE_FILE_WAIT_S = 60.0


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_failure(text: str | None) -> RankFailure | None:
    """A storage check's failure on this rank (None: it holds)."""
    return None if text is None else RankFailure(_global_rank(), text, True)


def _write_failure(error: Exception) -> RankFailure:
    """What a write raised on this rank, as the other ranks are told of it."""
    rank = _global_rank()
    if isinstance(error, STORAGE_ERRORS):
        return RankFailure(rank, f"could not write: {type(error).__name__}: {error}", True)
    return RankFailure(rank, f"raised {raised_where(error)}", False)


def _agree(
    agree: Collectives, failure: RankFailure | None, directory: Path, own: Exception | None = None
) -> None:
    """Gather every rank's failure (None: none) with its host; raise on every rank when any failed,
    naming the first (see [Note: agreed failures]) and rank 0's host. `own`: what this rank raised."""
    reports = agree.all_gather_object((socket.gethostname(), failure))
    hosts = {report.rank: host for host, report in reports if report is not None}

    def describe(cause: RankFailure, others: int) -> str:
        more = f" (and {others} more ranks)" if others else ""
        return (
            f"saving the checkpoint {directory} failed: rank {cause.rank} (host {hosts[cause.rank]}) "
            f"{cause.text}{more}; the ranks' first one is on host {reports[0][0]}"
        )

    raise_agreed(own, [report for _, report in reports if report is not None], describe)


def write_on_every_rank(agree: Collectives, directory: Path, write: Callable[[], T]) -> T:
    """`write()` on this rank, then agree: whatever it raised on any rank is raised on every rank (a
    CheckpointError naming that rank for a file error, see [Note: agreed failures]). Not only file
    errors: a bug on one rank otherwise left the others waiting in the save's next collective until the
    process group's timeout."""
    try:
        return_value, raised = write(), None
    except Exception as error:
        return_value, raised = None, error
    _agree(agree, None if raised is None else _write_failure(raised), directory, raised)
    return return_value  # type: ignore[return-value]


def _seen(check: Callable[[], bool]) -> bool:
    """`check()` until it holds, for up to LATE_FILE_WAIT_S."""
    deadline = time.monotonic() + LATE_FILE_WAIT_S
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, LATE_FILE_WAIT_S / 10))
    return True


def check_directory_shared(agree: Collectives, directory: Path) -> None:
    """Every rank sees `directory`, which its group's rank 0 has just made. Collective over `agree`."""
    failure = None
    if not _seen(directory.is_dir):
        failure = (
            "does not see the directory its group's first rank made: checkpoints are written once, to "
            "storage every process reads under the same path (see docs/checkpoints.md)"
        )
    _agree(agree, _check_failure(failure), directory)


def check_manifest_shared(agree: Collectives, manifest: Path) -> None:
    """Every rank reads the manifest `agree`'s rank 0 has just written, byte for byte (its sha256); when a
    rank does not, rank 0 removes it and every rank raises. Collective over `agree`."""
    digest = sha256_of(manifest) if agree.rank == 0 else None
    expected = agree.all_gather_object(digest)[0]

    def same() -> bool:
        try:
            return sha256_of(manifest) == expected
        except OSError:
            return False

    failure = None
    if agree.rank != 0 and not _seen(same):
        seen = "another" if manifest.is_file() else "no"
        failure = (
            f"sees {seen} {manifest.name} where the first rank wrote it: the checkpoint's directory is not "
            "on storage every process shares (each node holds a piece no other reads); write checkpoints "
            "to a directory every process reads under the same path (see docs/checkpoints.md)"
        )
    try:
        _agree(agree, _check_failure(failure), manifest.parent)
    except CheckpointError:
        if agree.rank == 0:  # the manifest vouches for files other ranks wrote elsewhere: not a checkpoint
            manifest.unlink(missing_ok=True)
        raise
