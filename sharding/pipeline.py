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

[Note: micro-batches agreed before the schedule]
Once a schedule runs, a stage that meets a bad value (a token id beyond the vocabulary in the first
stage's embedding, a label out of range in the last stage's loss) raises alone, and the other stages wait
for its activations until the collective timeout; so do the data replicas at the step's reductions if
their pipelines disagree. So before any schedule, every rank checks its own micro-batches (`_stack`:
structure, dtypes, and the values against the ranges the model declares in its split, one host sync
for all micro-batches), and the world agrees in one all-reduce (MAX) of a few integers: whether any
rank refused (then every rank raises, the refusing ones with their own message), and the micro-batch
count, rows and length, and whether position ids are given, as (value, -value) pairs so that the
maximum of both gives the range (then every rank raises the same message when they differ: the stages
exchange activations of one shape, and the data replicas meet in the step's reductions once per
micro-batch at ZeRO stages 2-3). The training schedule's own stage checks (`_stage_problem`) ride on
the same all-reduce.
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
        if not isinstance(getattr(split, "vocab_size", None), int):
            # The bound every token id and label is checked against before a schedule runs.
            raise ValueError(
                f"the model's pipeline split ({type(split).__name__}) must declare vocab_size (and ignore_index, "
                "the label of no loss, if its loss has one), as tnlg.modeling.pipeline.PipelineSplit does"
            )
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
        device = engine.comm_device
        inputs, labels, positions = self._agreed_inputs(micro_batches, "train_batch", device)
        count = len(micro_batches)
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
        device = engine.comm_device
        inputs, labels, positions = self._agreed_inputs(micro_batches, "eval_batch", device)
        count = len(micro_batches)
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

    def _agreed_inputs(
        self, micro_batches: Sequence[Any], action: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`_stack(micro_batches)` once every rank has accepted its own and all agree on their count and
        shape; else the same ValueError on every rank ([Note: micro-batches agreed before the schedule])."""
        stacked, problem = None, None
        try:
            stacked = _stack(micro_batches, action, self.split)
        except ValueError as error:
            problem = str(error)
        # Collective over a tensor group where it checks anything: every rank asks, whatever it found.
        stage_problem = self._stage_problem() if action == "train_batch" else None
        problem = problem or stage_problem
        if stacked is None:
            local = [1, 0, 0, 0, 0]
        else:
            count, (rows, length) = len(micro_batches), micro_batches[0]["input_ids"].shape
            local = [int(problem is not None), count, rows, length, int(stacked[2] is not None)]
        vector = torch.tensor(local + [-value for value in local[1:]], dtype=torch.int64, device=device)
        dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        agreed = vector.tolist()
        if agreed[0] or stacked is None:  # (no inputs: this rank refused, so agreed[0] is set)
            raise ValueError(
                problem
                or f"{action}: another rank's pipeline stage refused these micro-batches (see its error)"
            )
        _check_agreement(action, agreed[1:5], [-value for value in agreed[5:]])
        return stacked

    def _stage_problem(self) -> str | None:
        """Each stage module's own check before a training schedule (`schedule_problem`: e.g. the dropout
        RNG of a tensor group), agreed with the inputs over the world by the caller. The stages say alike on
        every rank whether they check (`checks_before_schedule`), so the check costs nothing when none
        does."""
        checking = [m for m in self.split.stages if getattr(m, "checks_before_schedule", False)]
        problems = [problem for m in checking if (problem := m.schedule_problem()) is not None]
        return problems[0] if problems else None

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
        problem = schedule_count_problem(count, self.groups.dims.pipeline, len(self.split.stages))
        if problem is not None:  # the same on every rank: the count is agreed
            raise ValueError(problem)
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


def schedule_count_problem(count: int, pipeline: int, virtual_stages: int) -> str | None:
    """Why torch's schedule for `pipeline` ranks holding `virtual_stages` stages each refuses `count`
    micro-batches, or None: checked before the schedule is built, so that the refusal names the count, the
    stages and the rule (and a run config can check its own counts when it is read)."""
    # torch's rules, as its schedules.py states them: read in torch 2.13, and the same in the older torch
    # sources seen (2.5 on); the 2.11 floor, between them, was not at hand to read.
    # - Schedule1F1B (one stage per rank): count >= its number of stages, here `pipeline`;
    # - ScheduleInterleaved1F1B: count % rounds == 0 with rounds = max(1, count // pipeline), so any count
    #   up to 2 * pipeline - 1 is one round and passes, a larger one must split into equal rounds.
    stages = pipeline * virtual_stages
    if virtual_stages == 1:
        if count >= pipeline:
            return None
        return (
            f"{count} micro-batch(es) for {pipeline} pipeline stages: the 1F1B schedule needs at least as many "
            f"micro-batches as stages; split the batch into at least {pipeline} micro-batches"
        )
    rounds = max(1, count // pipeline)
    if count % rounds == 0:
        return None
    # The largest multiple of `rounds` below `count` is at least rounds * pipeline: it has as many rounds.
    return (
        f"{count} micro-batches for {stages} pipeline stages ({virtual_stages} on each of {pipeline} ranks): the "
        f"interleaved 1F1B schedule needs a count that is a multiple of its rounds, max(1, count // {pipeline}) "
        f"= {rounds} here; e.g. {count - count % rounds} or {_interleaved_count_above(count, pipeline)} micro-batches"
    )


def _interleaved_count_above(count: int, pipeline: int) -> int:
    """The smallest micro-batch count above `count` that the interleaved schedule over `pipeline` ranks
    takes (a multiple of `pipeline` always is: there are that many rounds)."""
    candidate = count + 1
    while candidate % max(1, candidate // pipeline):
        candidate += 1
    return candidate


def _check_agreement(action: str, largest: list[int], smallest: list[int]) -> None:
    """The micro-batch count, rows, length and position ids (given or not) over the world: one each, or
    a ValueError (the same on every rank: both lists are the all-reduced ones)."""
    if largest == smallest:
        return
    names = ("micro-batch counts", "rows per micro-batch", "lengths", "position_ids given (0/1)")
    differ = [
        f"{name} {low}..{high}"
        for name, low, high in zip(names, smallest, largest, strict=True)
        if low != high
    ]
    raise ValueError(
        f"{action}: the ranks disagree on their micro-batches ({', '.join(differ)}): under pipeline stages every "
        "rank of a step passes the same number of micro-batches of one shape (the stages exchange activations "
        "of that shape, the data replicas meet in the step's reductions)"
    )


def _stack(
    micro_batches: Sequence[Any], action: str, split: PipelineSplit
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, position_ids or None), each micro-batch's stacked along the batch dimension, as
    int64. Everything a stage could only find out in the middle of the schedule is checked here:
    ValueError naming the micro-batch and the problem, which the caller agrees on over the world ([Note:
    micro-batches agreed before the schedule])."""
    check_micro_batch_list(micro_batches, action)
    for index, batch in enumerate(micro_batches):
        _check_micro_batch(batch, index, action, split.max_positions)
    shapes = {tuple(batch["input_ids"].shape) for batch in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"{action}: pipeline micro-batches must all have one shape, got {sorted(shapes)}")
    positions = [batch.get("position_ids") for batch in micro_batches]
    if any(p is None for p in positions) != all(p is None for p in positions):
        raise ValueError(f"{action}: give position_ids in every micro-batch or in none")
    shape = micro_batches[0]["input_ids"].shape
    # int64: what the embedding takes on every version, and the loss's targets must be (int32 labels
    # would fail in the last stage's cross-entropy, mid-schedule)
    inputs = torch.cat([batch["input_ids"] for batch in micro_batches]).long()
    labels = torch.cat([batch["labels"] for batch in micro_batches]).long()
    stacked = torch.cat([p.expand(shape) for p in positions]).long() if positions[0] is not None else None
    _check_values(action, split, shape[0], inputs, labels, stacked)
    return inputs, labels, stacked


def _check_values(
    action: str,
    split: PipelineSplit,
    rows: int,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None,
) -> None:
    """Token ids and labels in the vocabulary the model declares (labels may be its ignore index), position
    ids in [0, max_positions): ValueError naming the first micro-batch (of `rows` rows each) and value
    outside. One host sync for all micro-batches; finding the culprit costs more, on the error path only."""
    vocab, ignore = split.vocab_size, getattr(split, "ignore_index", None)
    beyond = (labels < 0) | (labels >= vocab)
    label_range = f"outside the vocabulary [0, {vocab})"
    if ignore is not None:
        beyond &= labels != ignore
        label_range += f" and not the ignore index {ignore}"
    checks = [
        ("token id", inputs, (inputs < 0) | (inputs >= vocab), f"outside the vocabulary [0, {vocab})"),
        ("label", labels, beyond, label_range),
    ]
    if positions is not None:
        out = (positions < 0) | (positions >= split.max_positions)
        checks.append(
            ("position id", positions, out, f"outside [0, {split.max_positions}) (max_position_embeddings)")
        )
    found = torch.stack([bad.any() for _, _, bad, _ in checks]).tolist()
    for (name, values, bad, expected), hit in zip(checks, found, strict=True):
        if hit:
            first = int(bad.flatten().nonzero()[0])
            micro = first // values.shape[1] // rows
            raise ValueError(
                f"{action}: micro-batch {micro}: {name} {int(values.flatten()[first])} is {expected}"
            )


def _check_micro_batch(batch: Any, index: int, action: str, max_positions: int) -> None:
    """One micro-batch's keys, dtypes and shapes (its values are checked stacked, `_check_values`)."""
    where = f"{action}: micro-batch {index}"
    _check_keys(batch, where)
    ids, labels = batch["input_ids"], batch["labels"]
    if ids.dim() != 2 or not _is_integer(ids):
        raise ValueError(
            f"{where}: input_ids must be integer token ids of shape (batch, length), got {ids.dtype} {list(ids.shape)}"
        )
    if not _is_integer(labels):
        raise ValueError(f"{where}: labels must be integer token ids (-100: no loss), got {labels.dtype}")
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
    if positions is None:
        return
    if not _is_integer(positions):
        raise ValueError(f"{where}: position_ids must be integers, got {positions.dtype}")
    try:
        positions.expand(ids.shape)
    except RuntimeError:
        raise ValueError(
            f"{where}: position_ids {list(positions.shape)} do not fit input_ids {list(ids.shape)}"
        ) from None


def _check_keys(batch: Any, where: str) -> None:
    """A mapping of the pipeline inputs, tensors, input_ids and labels among them."""
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
    loose = [key for key, value in batch.items() if value is not None and not isinstance(value, torch.Tensor)]
    if loose:
        raise ValueError(f"{where}: {loose} must be tensors")


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex()) and tensor.dtype != torch.bool
