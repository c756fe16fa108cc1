"""tnlg's checkpoints and saved models are written once, to storage every node shares.

An engine checkpoint is one set of files however many nodes write it: each rank its shard, one process
the manifests (the commit point) and the files of the whole run (schedulers, registered objects, the
model's config), and every rank reads the manifests of all parts when it loads (see [Note: sliced
checkpoints] in tnlg/sharding/checkpoint.py). A node that cannot read what another wrote cannot resume.
Accelerate's and the Trainer's `save_on_each_node` ask for the other arrangement, storage only its own
node reads, where each node's first process writes the shared files again. tnlg does not implement it,
so with processes on more than one node the setting is refused by name rather than ignored: ignored, the
save would succeed, and the resume would fail days later on the nodes that lack the manifest. On one node
the two arrangements are the same files, and the setting is accepted.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

__all__ = ["count_nodes", "refuse_node_local_saves"]


def count_nodes() -> int:
    """The number of machines this run's processes are on: their distinct host names (not the launcher's
    LOCAL_RANK, which a process group made by hand may lack, and which Accelerate then reads as 0 on CPU
    and -1 on GPU). Collective over the world."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return len(set(hosts))


def refuse_node_local_saves(setting: str, nodes: int) -> None:
    """Raise a ValueError naming `setting` (Accelerate's or the Trainer's save_on_each_node=True) when the
    run spans `nodes` > 1 nodes."""
    if nodes <= 1:
        return
    raise ValueError(
        f"{setting} with processes on {nodes} nodes: tnlg writes each checkpoint once, to storage every "
        "node shares (each rank its engine shard, the main process the manifest and the run's shared "
        "files), and node-local checkpoints are not implemented; set save_on_each_node=False and save "
        "to a directory every node can read"
    )
