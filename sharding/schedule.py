"""`ZeroEngine.train_batch` without pipeline stages: one optimizer step over a list of micro-batches
(`AccumulationDriver`; pipeline.py's `PipelineRunner` is the other step driver). Both drive the engine
through `DrivenEngine` (engine_state.py) and are chosen by `initialize` (build.py).

Without pipeline stages the micro-batches run one after another, as gradient accumulation: each loss
is scaled by 1/K, the first K-1 backwards run under `no_sync` (stages 0-1 then reduce once, at the
last), and one step follows. A DeepSpeed config's own `gradient_accumulation_steps` is honoured instead
when it equals K (the engine divides and steps at its boundary); any other value is an error, since
the two would disagree on the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine_state import DrivenEngine


def micro_batch_loss(output: Any) -> torch.Tensor:
    """The loss a model returned: the output itself, or its `loss` (a Transformers ModelOutput / dict)."""
    loss = output if isinstance(output, torch.Tensor) else None
    if loss is None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "train_batch needs the model to return a scalar loss (a 0-dim tensor, or an output with .loss): "
            "pass labels in each micro-batch"
        )
    return loss


def check_micro_batch_list(micro_batches: Any, action: str) -> None:
    """`micro_batches` must be a non-empty list (of mappings, tuples or single arguments): ValueError
    naming `action` (train_batch, eval_batch) otherwise."""
    if isinstance(micro_batches, (Mapping, torch.Tensor)) or not isinstance(micro_batches, Sequence):
        raise ValueError(
            f"{action} takes a list of micro-batches, got {type(micro_batches).__name__}; wrap one batch in a list"
        )
    if not micro_batches:
        raise ValueError(f"{action} got no micro-batches")


def run_micro_batch(engine: DrivenEngine, micro_batch: Any) -> torch.Tensor:
    """The model on one micro-batch: a mapping is keyword arguments, a tuple or list positional ones,
    anything else the one argument."""
    if isinstance(micro_batch, Mapping):
        return micro_batch_loss(engine(**micro_batch))
    if isinstance(micro_batch, (tuple, list)):
        return micro_batch_loss(engine(*micro_batch))
    return micro_batch_loss(engine(micro_batch))


def train_batch(engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
    """Run `micro_batches`, step once, return the mean loss over them and over the data-parallel ranks
    (a detached fp32 scalar, the same on every rank)."""
    check_micro_batch_list(micro_batches, "train_batch")
    count = len(micro_batches)
    configured = engine.gradient_accumulation_steps()
    if configured not in (1, count):
        raise ValueError(
            f"train_batch got {count} micro-batches, but the engine's config accumulates {configured} per step "
            "(gradient_accumulation_steps): pass that many, or leave the config's accumulation at 1"
        )
    device = engine.comm_device  # where the collectives run (NCCL: the GPU)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for index, micro_batch in enumerate(micro_batches):
        last = index == count - 1
        sync = contextlib.nullcontext() if last or configured > 1 else engine.no_sync()
        with sync:
            loss = run_micro_batch(engine, micro_batch)
            total += loss.detach().float().to(device)  # no host sync per micro-batch
            # With the config's accumulation the engine divides by K itself; else this call does.
            engine.backward(loss if configured > 1 else loss / count)
        if configured > 1 or last:
            engine.step()
    mean = total / count
    engine.collectives.all_reduce(mean)
    return (mean / engine.collectives.world_size).cpu()


def eval_batch(engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
    """The mean loss over `micro_batches` and the data-parallel ranks, without gradients (a detached fp32
    scalar on the CPU, the same on every rank)."""
    check_micro_batch_list(micro_batches, "eval_batch")
    device = engine.comm_device
    total = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        for micro_batch in micro_batches:
            total += run_micro_batch(engine, micro_batch).float().to(device)
    mean = total / len(micro_batches)
    engine.collectives.all_reduce(mean)
    return (mean / engine.collectives.world_size).cpu()


class AccumulationDriver:
    """The step driver of an engine without pipeline stages: micro-batches one after another."""

    def train_batch(self, engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
        return train_batch(engine, micro_batches)

    def eval_batch(self, engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
        return eval_batch(engine, micro_batches)
