"""What checkpoints ask of an engine: `ShardedModel` and `EngineState`, the engine's checkpoint-facing half.

checkpoint.py (save, load) and pretrained.py (a Transformers checkpoint read into the shards) are
typed against these protocols, not against `ZeroEngine`: the engine imports them to save, load and
build itself, so they must not import it back, and the protocols say in one place which few parts
of an engine a checkpoint reads and restores. `ZeroEngine` implements both; consolidation reads
files only and needs neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from .collectives import Collectives
from .flat_group import FlatGroup


class ShardedModel(Protocol):
    """A module whose trainable parameters live in flat groups sharded over `collectives`' ranks:
    what filling the shards from a checkpoint reads and writes."""

    @property
    def module(self) -> nn.Module:
        """The user's module; its state dict names the parameters, frozen ones and buffers."""
        ...

    @property
    def groups(self) -> list[FlatGroup]:
        """One flat group per optimizer param group (see [Note: flat layout] in partition.py)."""
        ...

    @property
    def collectives(self) -> Collectives:
        """This rank, the world size, and the object all-gather the ranks agree through."""
        ...


class EngineState(ShardedModel, Protocol):
    """A `ShardedModel` that trains: the optimizer over its master shards and the counters a
    checkpoint saves and restores with them."""

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer stepped over the groups' fp32 master shards: its state is keyed by `group.master`,
        its `param_groups` follow `groups` one to one."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """What the manifest records of the engine's own state (stage, mixed precision, step, loss
        scaler), as JSON values."""
        ...

    def restore_checkpoint_state(self, manifest: Mapping[str, Any]) -> None:
        """The step and the loss scaler back from a manifest (whatever stage wrote it)."""
        ...
