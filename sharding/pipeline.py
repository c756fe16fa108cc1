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

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from .collectives import Collectives
from .schedule import check_micro_batch_list

if TYPE_CHECKING:
    from .engine_state import DrivenEngine
    from .parallel import ParallelGroups, PipelineSplit

# What a micro-batch may hold under pipeline stages: the stages pass hidden states only.
PIPELINE_INPUTS = ("input_ids", "labels", "position_ids")


class PipelineRunner:
    """This rank's stages of one engine, and a schedule per micro-batch count and shape."""

    def __init__(
        self,
        split: PipelineSplit,
        groups: ParallelGroups,
        shared: dict[str, dist.ProcessGroup],
    ):
        self.split = split
        self.groups = groups
        self.shared = shared  # {trainable parameter name: the group of the pipeline ranks holding it}
        # The schedule of the last (micro-batch count, shape): one only, since each holds its stages'
        # receive buffers (a new shape replaces it).
        self._schedule_key: tuple | None = None
        self._cached: tuple[Any, list[torch.Tensor], list[PipelineStage]] | None = None

    @property
    def holds_first(self) -> bool:
        return self.split.stage_indices[0] == 0

    @property
    def holds_last(self) -> bool:
        return self.split.stage_indices[-1] == self.split.num_stages - 1

    def train_batch(self, engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
        """One step over `micro_batches` (see [Note: pipeline schedule under ZeRO])."""
        inputs, labels, positions = _stack(micro_batches, "train_batch", self.split.max_positions)
        count = len(micro_batches)
        device = engine.comm_device
        self._check_stages(device)
        schedule, losses, stages = self._schedule(
            engine, count, tuple(inputs.shape), positions is not None, device
        )
        kwargs = {"position_ids": positions.to(device)} if positions is not None else {}
        # The loss function scales the backwards the schedule runs (fp16), as engine.backward would;
        # a backward run outside the engine before this call is still caught by the step.
        with engine.scheduled_backwards():
            try:
                schedule.step(inputs.to(device), target=labels.to(device), **kwargs)
            finally:
                self._release(stages)
        self._sum_shared_gradients(engine, device)
        engine.step()
        return self._mean_loss(losses, count, device)

    def eval_batch(self, engine: DrivenEngine, micro_batches: Sequence[Any]) -> torch.Tensor:
        """The mean loss over `micro_batches` and data replicas, forward only (no graph is kept)."""
        inputs, labels, positions = _stack(micro_batches, "eval_batch", self.split.max_positions)
        count = len(micro_batches)
        device = engine.comm_device
        schedule, losses, stages = self._schedule(
            engine, count, tuple(inputs.shape), positions is not None, device
        )
        kwargs = {"position_ids": positions.to(device)} if positions is not None else {}
        try:
            with torch.no_grad(), engine.scheduled_forwards():
                schedule.eval(inputs.to(device), target=labels.to(device), **kwargs)
        finally:
            self._release(stages)
        return self._mean_loss(losses, count, device)

    def _check_stages(self, device: torch.device) -> None:
        """Each stage module's own check before a training schedule (`schedule_problem`: e.g. the dropout
        RNG of a tensor group), agreed over the world: a problem on one rank raises on every rank, rather
        than leaving the other stages waiting for activations that never come. The stages say alike on
        every rank whether they check (`checks_before_schedule`), so the agreement costs nothing when
        none does."""
        checking = [m for m in self.split.stages if getattr(m, "checks_before_schedule", False)]
        if not checking:
            return
        problems = [problem for m in checking if (problem := m.schedule_problem()) is not None]
        flag = torch.tensor([float(bool(problems))], device=device)
        dist.all_reduce(flag)
        if flag.item():
            raise ValueError(
                problems[0] if problems else "another rank's pipeline stage refused this step (see its error)"
            )

    # ------------------------------------------------------------------ schedule
    def _schedule(
        self,
        engine: DrivenEngine,
        count: int,
        shape: tuple[int, ...],
        with_positions: bool,
        device: torch.device,
    ):
        key = (count, shape, with_positions)
        if key == self._schedule_key:
            self._cached[1].clear()
            return self._cached
        self._schedule_key, self._cached = None, None  # the old stages' buffers go now
        micro = (shape[0] // count, shape[1])
        hidden = torch.empty(*micro, self.split.hidden_size, dtype=engine.compute_dtype, device="meta")
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
            return value.float() * (engine.loss_scale / count)

        if len(stages) == 1:
            schedule = Schedule1F1B(stages[0], count, loss_fn=micro_batch_loss, scale_grads=False)
        else:
            schedule = ScheduleInterleaved1F1B(stages, count, loss_fn=micro_batch_loss, scale_grads=False)
        self._schedule_key, self._cached = key, (schedule, losses, stages)
        return self._cached

    @staticmethod
    def _release(stages: list[PipelineStage]) -> None:
        """Drop what the stages keep after a run (the last stage's outputs, the caches of forwards for
        backward): nothing of one step lives into the next."""
        for stage in stages:
            stage.clear_runtime_states()

    # ------------------------------------------------------------------ after the schedule
    def _sum_shared_gradients(self, engine: DrivenEngine, device: torch.device) -> None:
        """The tied embedding's gradient summed over the stages holding it, on this rank's piece."""
        for name, group in self.shared.items():
            piece = engine.gradient_piece(name)
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


def keep_stage_parameters(optimizer: torch.optim.Optimizer, dropped: set[int]) -> None:
    """Drop from `optimizer`'s param groups the parameters of layers other stages hold (ids in `dropped`:
    the optimizer was built over the whole model); anything else stays, for the engine's own check that
    an optimizer holds only the model's parameters. Every group stays, possibly empty, so that schedulers
    and checkpoints see the same groups on every stage."""
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in dropped]


def _stack(
    micro_batches: Sequence[Any], action: str, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, position_ids or None), each micro-batch's stacked along the batch dimension.
    Everything a stage could only find out in the middle of the schedule (leaving the other stages
    waiting) is checked here, on every rank alike: ValueError naming the micro-batch and the problem."""
    check_micro_batch_list(micro_batches, action)
    for index, batch in enumerate(micro_batches):
        _check_micro_batch(batch, index, action, max_positions)
    shapes = {tuple(batch["input_ids"].shape) for batch in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"{action}: pipeline micro-batches must all have one shape, got {sorted(shapes)}")
    positions = [batch.get("position_ids") for batch in micro_batches]
    if any(p is None for p in positions) != all(p is None for p in positions):
        raise ValueError(f"{action}: give position_ids in every micro-batch or in none")
    shape = micro_batches[0]["input_ids"].shape
    stacked = torch.cat([p.expand(shape) for p in positions]) if positions[0] is not None else None
    return (
        torch.cat([batch["input_ids"] for batch in micro_batches]),
        torch.cat([batch["labels"] for batch in micro_batches]),
        stacked,
    )


def _check_micro_batch(batch: Any, index: int, action: str, max_positions: int) -> None:
    where = f"{action}: micro-batch {index}"
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"{where}: under pipeline stages each micro-batch is a mapping of {list(PIPELINE_INPUTS)}, got a "
            f"{type(batch).__name__}"
        )
    extra = sorted(set(batch) - set(PIPELINE_INPUTS))
    missing = [key for key in ("input_ids", "labels") if batch.get(key) is None]
    if extra or missing:
        raise ValueError(
            f"{where}: pipeline stages take {list(PIPELINE_INPUTS)} (the stages pass hidden states only; padding "
            "is expressed by labels -100 and position ids); "
            + (f"unsupported: {extra}" if extra else f"missing: {missing}")
        )
    ids, labels = batch["input_ids"], batch["labels"]
    if ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(
            f"{where}: input_ids must be integer token ids of shape (batch, length), got {ids.dtype} {list(ids.shape)}"
        )
    if labels.shape != ids.shape:
        raise ValueError(
            f"{where}: labels {list(labels.shape)} must have the shape of input_ids {list(ids.shape)}"
        )
    if ids.shape[1] > max_positions:
        raise ValueError(
            f"{where}: sequences of {ids.shape[1]} tokens are longer than the model's max_position_embeddings "
            f"({max_positions})"
        )
    positions = batch.get("position_ids")
    if positions is not None:
        try:
            positions.expand(ids.shape)
        except RuntimeError:
            raise ValueError(
                f"{where}: position_ids {list(positions.shape)} do not fit input_ids {list(ids.shape)}"
            ) from None
        if positions.numel() and int(positions.max()) >= max_positions:
            raise ValueError(
                f"{where}: position id {int(positions.max())} is beyond the model's max_position_embeddings "
                f"({max_positions})"
            )
