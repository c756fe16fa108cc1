"""What others ask of an engine: `ShardedModel` and `EngineState`, the engine's checkpoint-facing half,
and `DrivenEngine`, what the step drivers (schedule.py, pipeline.py) use.

checkpoint.py (save, load) and pretrained.py (a Transformers checkpoint read into the shards) are
typed against these protocols, not against `ZeroEngine`: the engine imports them to save, load and
build itself, so they must not import it back, and the protocols say in one place which few parts
of an engine a checkpoint reads and restores. `ZeroEngine` implements all three; consolidation reads
files only and needs none. The step drivers are handed to the engine by `initialize` (build.py), so
they too must not import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
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


class DrivenEngine(Protocol):
    """What a step driver (accumulation in schedule.py, the pipeline runner in pipeline.py) uses of an
    engine: its public training calls and a few read-only facts. The drivers see nothing else of it, so
    the engine can own its reducer, scheduler and counters without them reaching in."""

    @property
    def collectives(self) -> Collectives:
        """The data-parallel group the step's mean loss is reduced over."""
        ...

    @property
    def comm_device(self) -> torch.device:
        """Where the collectives run (the GPU under NCCL): the loss is summed there."""
        ...

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations flow in between pipeline stages."""
        ...

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale a loss computed outside `backward` must be multiplied by (1.0 otherwise)."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> bool: ...

    def no_sync(self) -> AbstractContextManager[None]: ...

    def gradient_accumulation_steps(self) -> int: ...

    def scheduled_backwards(self) -> AbstractContextManager[None]:
        """Backward passes a schedule runs itself, on losses already scaled by `loss_scale`: they count as
        the engine's, stage 3 keeps its root block gathered throughout, and stages 0-1 reduce once, at
        the end."""
        ...

    def scheduled_forwards(self) -> AbstractContextManager[None]:
        """Forward passes a schedule runs itself: stage 3 keeps its root block gathered throughout."""
        ...

    def gradient_piece(self, name: str) -> torch.Tensor:
        """This rank's piece of trainable parameter `name`'s reduced gradient (see `FlatGroup.grad_piece`)."""
        ...


class StepDriver(Protocol):
    """How `engine.train_batch` / `eval_batch` run a list of micro-batches: `AccumulationDriver`
    (schedule.py) or, under pipeline stages, `PipelineRunner` (pipeline.py)."""

    def train_batch(self, engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor: ...

    def eval_batch(self, engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor: ...


class PipelineStages(Protocol):
    """What the engine and checkpoints read of this rank's pipeline stages (`PipelineRunner` holds them)."""

    @property
    def split(self) -> Any:
        """The model's split for this rank: `stage_indices`, `num_stages`, the stage modules."""
        ...

    @property
    def shared(self) -> Mapping[str, Any]:
        """{trainable parameter name: the process group of the pipeline ranks that each hold it}."""
        ...

    @property
    def holds_first(self) -> bool: ...

    @property
    def holds_last(self) -> bool: ...
