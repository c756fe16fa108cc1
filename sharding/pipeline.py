"""Pipeline stages under ZeRO: `ZeroEngine.train_batch` as a `torch.distributed.pipelining` schedule.

[Note: pipeline schedule under ZeRO]
Each rank holds its stages of the model (see [Note: pipeline split] in tnlg/modeling/pipeline.py) and
the engine shards their parameters over the data group, as it shards any model: ZeRO does not see the
pipeline. `train_batch(micro_batches)` stacks the micro-batches and runs them through the schedule
(1F1B with one stage per rank, interleaved 1F1B with several), then steps once:

- Gradients. Stages 2-3 reduce-scatter in every micro-batch's backward, as they do for gradient
  accumulation. Stages 0-1 accumulate the whole schedule under `no_sync` and reduce once after it,
  since a schedule's backwards end on different micro-batches on different stages.
- Stage 3 gathers each layer around its use by module hooks, as without stages; the root block (the
  embeddings, final LayerNorm and head this rank holds) stays gathered for the whole schedule, since
  its forwards and backwards interleave across micro-batches.
- The tied embedding, held by the first and the last stage, gets its gradient summed over the two (on
  this rank's shard piece: the parameter is a unit of its own, laid out alike on both) before the step,
  and counted once in the gradient norm.
- The loss is each micro-batch's mean, divided by their count (and times the fp16 loss scale) in the
  loss function itself: the schedule's own gradient scaling is off, since the engine's hooks move the
  gradients out of `.grad` where it would scale them.

The returned loss is the mean over micro-batches, broadcast from the last stage, and over data replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from .collectives import Collectives

if TYPE_CHECKING:
    from tnlg.modeling.pipeline import PipelineSplit

    from .engine import ZeroEngine
    from .parallel import ParallelGroups

# What a micro-batch may hold under pipeline stages: the stages pass hidden states only.
PIPELINE_INPUTS = ("input_ids", "labels", "position_ids")


class PipelineRunner:
    """This rank's stages of one engine, and a schedule per micro-batch count and shape."""

    def __init__(
        self,
        split: PipelineSplit,
        groups: ParallelGroups,
        shared: dict[str, dist.ProcessGroup],
        hidden_size: int,
    ):
        self.split = split
        self.groups = groups
        self.shared = shared  # {parameter name: the pipeline ranks holding it}
        self.hidden_size = hidden_size
        self._schedules: dict[tuple, tuple[Any, list[torch.Tensor]]] = {}

    @property
    def holds_first(self) -> bool:
        return self.split.stage_indices[0] == 0

    @property
    def holds_last(self) -> bool:
        return self.split.stage_indices[-1] == self.split.num_stages - 1

    def train_batch(self, engine: ZeroEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
        """One step over `micro_batches` (see [Note: pipeline schedule under ZeRO])."""
        inputs, labels, positions = _stack(micro_batches)
        count = len(micro_batches)
        if engine.gradient_accumulation_steps() != 1:
            raise ValueError(
                f"under pipeline stages train_batch's {count} micro-batches are the step's accumulation; the "
                f"engine's config accumulates {engine.gradient_accumulation_steps()}: set it to 1"
            )
        device = engine.groups[0].device
        schedule, losses = self._schedule(engine, count, tuple(inputs.shape), positions is not None, device)
        losses.clear()
        kwargs = {"position_ids": positions.to(device)} if positions is not None else {}
        no_sync = engine.no_sync() if engine.config.stage <= 1 else contextlib.nullcontext()
        hold = engine.scheduler.hold_root() if engine.scheduler is not None else contextlib.nullcontext()
        with no_sync, hold:
            schedule.step(inputs.to(device), target=labels.to(device), **kwargs)
        if engine.config.stage <= 1:
            engine.reducer.reduce_accumulated()
        self._sum_shared_gradients(engine, device)
        # The loss function scaled every backward the schedule ran (fp16): the step may unscale them.
        engine._engine_backwards = len(engine.reducer.backward_passes)
        engine.step()
        return self._mean_loss(losses, count, device)

    def eval_batch(self, engine: ZeroEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
        """The mean loss over `micro_batches` and data replicas, forward only (no graph is kept)."""
        inputs, labels, positions = _stack(micro_batches)
        count = len(micro_batches)
        device = engine.groups[0].device
        schedule, losses = self._schedule(engine, count, tuple(inputs.shape), positions is not None, device)
        losses.clear()
        kwargs = {"position_ids": positions.to(device)} if positions is not None else {}
        hold = engine.scheduler.hold_root() if engine.scheduler is not None else contextlib.nullcontext()
        with torch.no_grad(), hold:
            schedule.eval(inputs.to(device), target=labels.to(device), **kwargs)
        return self._mean_loss(losses, count, device)

    # ------------------------------------------------------------------ schedule
    def _schedule(
        self,
        engine: ZeroEngine,
        count: int,
        shape: tuple[int, ...],
        with_positions: bool,
        device: torch.device,
    ):
        key = (count, shape, with_positions)
        if key in self._schedules:
            return self._schedules[key]
        micro = (shape[0] // count, shape[1])
        hidden = torch.empty(*micro, self.hidden_size, dtype=engine.compute_dtype, device="meta")
        stages = []
        for module in self.split.stages:
            # Static shapes: no shape-inference round trip, and gradients flow into every stage's input
            # but the first's (token ids).
            received = (
                torch.empty(micro, dtype=torch.long, device="meta")
                if module.index == 0
                else hidden.clone().requires_grad_()
            )
            stages.append(
                PipelineStage(
                    module,
                    module.index,
                    self.split.num_stages,
                    device,
                    input_args=(received,),
                    output_args=(hidden.clone().requires_grad_(),),
                    group=self.groups.pipeline,
                )
            )
        losses: list[torch.Tensor] = []
        loss = self.split.loss

        def micro_batch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            value = loss(output, target)
            losses.append(value.detach().float())
            # The step's mean over micro-batches, and the fp16 loss scale (the engine unscales).
            return value.float() * (engine.loss_scaler.scale / count)

        if len(stages) == 1:
            schedule = Schedule1F1B(stages[0], count, loss_fn=micro_batch_loss, scale_grads=False)
        else:
            schedule = ScheduleInterleaved1F1B(stages, count, loss_fn=micro_batch_loss, scale_grads=False)
        self._schedules[key] = (schedule, losses)
        return schedule, losses

    # ------------------------------------------------------------------ after the schedule
    def _sum_shared_gradients(self, engine: ZeroEngine, device: torch.device) -> None:
        """The tied embedding's gradient summed over the stages holding it, on this rank's piece."""
        for name, group in self.shared.items():
            flat, unit = engine.parameter_unit(name)
            piece = flat.grad_piece(unit)
            summed = piece.to(device)
            Collectives(group, engine.collectives.stats).all_reduce(summed)
            if summed is not piece:
                piece.copy_(summed)

    def _mean_loss(self, losses: list[torch.Tensor], count: int, device: torch.device) -> torch.Tensor:
        """The mean loss over micro-batches (from the last stage) and data replicas, on every rank."""
        total = torch.zeros((), dtype=torch.float32, device=device)
        if self.holds_last:
            total += torch.stack(losses).sum().to(device) / count
        last = int(self.groups.mesh.mesh.reshape(self.groups.dims.pipeline, -1)[-1, self._column()])
        dist.broadcast(total, src=last, group=self.groups.pipeline)
        dist.all_reduce(total, group=self.groups.data)
        return (total / self.groups.dims.data).cpu()

    def _column(self) -> int:
        """This rank's (data, tensor) coordinate, flattened: its column of the pipeline-major mesh."""
        return self.groups.rank("data") * self.groups.dims.tensor + self.groups.rank("tensor")


def keep_stage_parameters(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> None:
    """Drop from `optimizer`'s param groups the parameters of layers other stages hold (the optimizer was
    built over the whole model); every group stays, possibly empty, so that schedulers and checkpoints
    see the same groups on every stage."""
    held = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in held]


def _stack(micro_batches: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, position_ids or None), each micro-batch's stacked along the batch dimension;
    ValueError naming what a pipeline cannot take."""
    if isinstance(micro_batches, (Mapping, torch.Tensor)) or not isinstance(micro_batches, Sequence):
        raise ValueError(
            f"train_batch takes a list of micro-batches, got {type(micro_batches).__name__}; wrap one batch in a list"
        )
    if not micro_batches:
        raise ValueError("train_batch got no micro-batches")
    for index, batch in enumerate(micro_batches):
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"under pipeline stages each micro-batch is a mapping of {list(PIPELINE_INPUTS)}; micro-batch "
                f"{index} is a {type(batch).__name__}"
            )
        extra = sorted(set(batch) - set(PIPELINE_INPUTS))
        missing = [key for key in ("input_ids", "labels") if batch.get(key) is None]
        if extra or missing:
            raise ValueError(
                f"micro-batch {index}: pipeline stages take {list(PIPELINE_INPUTS)} (the stages pass hidden states "
                f"only; padding is expressed by labels -100 and position ids); "
                + (f"unsupported: {extra}" if extra else f"missing: {missing}")
            )
    shapes = {tuple(batch["input_ids"].shape) for batch in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"pipeline micro-batches must all have one shape, got {sorted(shapes)}")
    positions = [batch.get("position_ids") for batch in micro_batches]
    if any(p is None for p in positions) != all(p is None for p in positions):
        raise ValueError("give position_ids in every micro-batch or in none")
    stacked = None
    if positions[0] is not None:
        shape = micro_batches[0]["input_ids"].shape
        stacked = torch.cat([p.expand(shape) for p in positions])
    return (
        torch.cat([batch["input_ids"] for batch in micro_batches]),
        torch.cat([batch["labels"] for batch in micro_batches]),
        stacked,
    )
