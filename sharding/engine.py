"""`ZeroEngine`: composes the flat groups, gradient reducer, stage 3 scheduler and sharded step.

The stage is a policy, not a class hierarchy: `ZeroConfig.stage` decides which buffers a
`FlatGroup` keeps (flat_group.py), which collective reduces a unit's gradients (grads.py), and
whether parameters are gathered around their use (params.py).

It is built by `initialize` (build.py) from settled, typed `EngineParts` only: it reads no config
form, cuts no model and picks no step driver. Checkpoints (checkpoint.py), pretrained loading
(pretrained.py) and the step drivers (schedule.py, pipeline.py) see it through the protocols of
engine_state.py, which it implements: they import nothing from here.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .checkpoint import CheckpointError, agreeing_ranks, load_engine, save_engine, tensor_layout
from .checkpoint_files import read_on_every_rank
from .checkpoint_storage import write_on_every_rank
from .collectives import Collectives
from .compile import CompileClock
from .config import ZeroConfig
from .deepspeed.lr_schedules import DeepSpeedSchedule
from .deepspeed.restore import is_deepspeed_checkpoint, load_deepspeed_checkpoint
from .engine_state import PipelineStages, StepDriver
from .fill import cast_frozen_floating_tensors, fill_shards
from .flat_group import FlatGroup
from .full_state import full_state_dict
from .grads import GradientReducer
from .loss_scaler import LossScaler
from .module_loads import register_module_loads
from .offload import Placement
from .optimizer import ModelParallelNorm, ShardedOptimizer
from .params import ParameterScheduler
from .partition import Unit
from .plan import ShardingPlan
from .pretrained import PretrainedSource
from .scheduler_state import read_scheduler_state, save_scheduler_state

if TYPE_CHECKING:
    from tnlg.modeling.tensor_parallel import TensorSlice

    from .parallel import ParallelGroups

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# On CUDA each rank's piece of a unit starts on a 256-byte boundary: NCCL and vectorised kernels
# are fastest on aligned buffers. On CPU the padding would only cost memory.
CUDA_ALIGNMENT_BYTES = 256


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine is built from, each input already settled into its one typed form by
    `initialize` (build.py): the engine reads no config file, cuts no model and picks no driver."""

    config: ZeroConfig
    gradient_accumulation_steps: int  # micro-batches per optimizer step (a DeepSpeed config's; else 1)
    train_micro_batch_size_per_gpu: int | None  # the DeepSpeed config's, for the user's data loader
    collectives: Collectives  # over the data-parallel group: what the engine shards across
    plan: ShardingPlan  # the units and blocks of this rank's (cut) module
    placement: Placement  # where buffers live (device, offload)
    driver: StepDriver  # how train_batch / eval_batch run micro-batches
    fused_adam: str  # the device fused Adam kernel, resolved and built ("none": torch's optimizer step)
    init_seed: int
    pretrained: PretrainedSource | None  # a checkpoint a meta model reads its shards from
    parallel: ParallelGroups | None = None
    tensor_slices: dict[str, TensorSlice] = field(default_factory=dict)  # this rank's slices, by name
    pipeline: PipelineStages | None = None  # this rank's pipeline stages, if the model is cut into any
    build_lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None  # a DeepSpeed config's scheduler
    compiled_blocks: tuple[str, ...] = ()  # the blocks whose forward is compiled (compile.py)


class ZeroEngine(nn.Module):
    """A model and its optimizer, sharded across the data-parallel ranks by ZeRO stage 0-3.

    `engine(**batch)` runs the wrapped module; `backward`, `step` and `zero_grad` replace
    `loss.backward()`, `optimizer.step()` and `optimizer.zero_grad()`. `engine.module` is the
    user's module, with the same class and parameter names; its parameters are views into the
    engine's buffers (in stage 3, only while gathered).

    With `optimizer=None` the engine is inference only: every parameter is sharded as the stage
    says, but no gradient buffers, reduction hooks or optimizer state exist; the forward runs
    without autograd, and training calls (`backward`, `step`, checkpoints) raise. A DeepSpeed config
    with an `optimizer` section builds that optimizer instead (see `TrainingConfig`).

    With gradient accumulation (`gradient_accumulation_steps` N in a DeepSpeed config) call
    `backward` and `step` on every micro-batch, as with DeepSpeed: see `backward` and `step`.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, parts: EngineParts):
        """Built by `initialize` (build.py), which settles every input form into `parts` and cuts `module`
        to this rank's stages and slices first; `optimizer` holds only this rank's parameters."""
        super().__init__()
        self.config = parts.config
        self.parallel = parts.parallel
        self.tensor_slices = parts.tensor_slices
        self.pipeline = parts.pipeline
        self._driver = parts.driver
        self.collectives = parts.collectives
        self._accumulation_steps = parts.gradient_accumulation_steps
        self._micro_batch_size = parts.train_micro_batch_size_per_gpu
        plan, placement = parts.plan, parts.placement
        self.module = module
        self.compute_dtype = COMPUTE_DTYPES[self.config.mixed_precision]
        self.groups = self._flat_groups(plan, placement, trainable=optimizer is not None)
        # what this rank read of a pretrained checkpoint
        self.pretrained_bytes_read = fill_shards(
            self, self.tensor_slices, plan.device, placement.device, parts.init_seed, parts.pretrained
        )
        cast_frozen_floating_tensors(self.module, self.groups, self.compute_dtype)
        self.loss_scaler = LossScaler(self.config)
        self.optimizer = (
            self._sharded_optimizer(optimizer, placement, parts.fused_adam) if optimizer is not None else None
        )
        self.scheduler = (
            ParameterScheduler(plan.blocks, self.groups, self.config, self.collectives)
            if self.config.partitions_parameters
            else None
        )
        # Inference only: no gradient hooks at all, so nothing can start a reduction into buffers
        # that do not exist.
        self.reducer = self._gradient_reducer() if optimizer is not None else None
        self.global_steps = 0  # optimizer steps (accumulation boundaries)
        self.micro_steps = 0  # step() calls, one per micro-batch
        self._engine_backwards = 0
        self._backwards_at_clip = 0  # backward passes seen when clip_grad_norm_ was last called
        # The DeepSpeed config's scheduler, stepped by step() after each applied update.
        self.lr_scheduler = (
            parts.build_lr_scheduler(optimizer) if parts.build_lr_scheduler is not None else None
        )
        if self.config.partitions_parameters and optimizer is not None:
            # Stage 3 training: gathers on a group of their own (see [Note: gather group] in
            # collectives.py). Opened last, so that no error above leaves it behind unclosed.
            self.collectives.open_gather_group()
        self.compiled_blocks = parts.compiled_blocks
        # Made last, with the finalizer that removes their callbacks and hooks: nothing above can leave
        # them registered.
        self._compile_clock = CompileClock() if parts.compiled_blocks else None
        # A load_state_dict into the module reaches the fp32 master (see [Note: module loads]).
        self._module_load_hooks = register_module_loads(self.module, self.groups, self.config.stage)
        # Teardown without __del__ (see [Note: engine lifetime] in grads.py): runs once, at close(), when
        # the engine is garbage-collected, or at interpreter exit. Its arguments must not hold the engine.
        self._finalizer = weakref.finalize(
            self,
            _release_parts,
            self.reducer,
            self.scheduler,
            self.optimizer,
            self.groups,
            self.collectives,
            self._compile_clock,
            self._module_load_hooks,
        )

    # ------------------------------------------------------------------ the training loop
    @property
    def inference_only(self) -> bool:
        """Built without an optimizer: sharded parameters, nothing to train with."""
        return self.optimizer is None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_open("forward")
        if self.pipeline is not None:
            raise RuntimeError(
                f"this rank holds pipeline stages {self.pipeline.split.stage_indices} of "
                f"{self.pipeline.split.num_stages}, not the whole model: train with engine.train_batch(micro_batches)"
            )
        if self.inference_only:
            # No graph: nothing could run its backward, and with gradients enabled stage 3 would keep
            # the root block gathered for that backward.
            with torch.no_grad():
                return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    def train_batch(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """Run `micro_batches` (each a mapping of keyword arguments, a tuple of positional ones, or one
        argument; the model must return a loss), step once, and return the mean loss over the
        micro-batches and the data-parallel ranks. See schedule.py."""
        self._require_optimizer("train_batch")
        return self._driver.train_batch(self, micro_batches)

    def eval_batch(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """The mean loss over `micro_batches` (as `train_batch` takes them) and the data-parallel ranks,
        forward only, in eval mode: through the pipeline schedule with pipeline stages, else micro-batch by
        micro-batch."""
        self._require_open("eval_batch")
        training = self.module.training
        self.module.eval()  # no dropout, as for any evaluation; the mode is restored after
        try:
            return self._driver.eval_batch(self, micro_batches)
        finally:
            self.module.train(training)

    def _require_optimizer(self, action: str) -> None:
        self._require_open(action)
        if self.inference_only:
            raise RuntimeError(
                f"{action} needs an optimizer: this engine was built for inference only "
                "(initialize(model, None, ...)); pass an optimizer to train"
            )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release what the engine holds, now; idempotent. Collectives in flight are waited for, every
        hook is removed, gradient buffers, fp32 master and stage 3 shards are freed, and the optimizer
        passed in is emptied (its step then raises). The module keeps the parameters it views: the full
        16-bit values in stages 0-2, nothing usable in stage 3 (take `full_state_dict()` first). Using
        the engine afterwards raises. Dropping the last reference to an engine does the same (see
        [Note: engine lifetime] in grads.py); close() makes it happen at a known point, e.g. before
        `destroy_process_group()`."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _require_open(self, action: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"{action} on a closed ZeroEngine: close() released its buffers and hooks; build a new engine"
            )

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (times the fp16 loss scale); gradients are reduced as they are ready.

        With N accumulation steps the loss is divided by N (each micro-batch's share of the step's
        mean, as DeepSpeed does), and stages 0-1 reduce only in the boundary's backward.
        """
        self._require_optimizer("backward")
        self._engine_backwards += 1
        steps = self._accumulation_steps
        if steps > 1:
            loss = loss / steps
        scale = self.loss_scaler.scale
        synced = self.reducer.sync
        # Inside an accumulation window gradients add up locally; `no_sync` still wins at the boundary.
        self.reducer.sync = synced and self.is_gradient_accumulation_boundary()
        try:
            # The scaled loss is formed in fp32: a 16-bit loss times 2^16 would overflow right here.
            (loss.float() * scale if scale != 1.0 else loss).backward()
        finally:
            self.reducer.sync = synced

    def step(self) -> bool:
        """Clip, update this rank's shard, re-materialize the parameters, step the DeepSpeed config's
        scheduler; False if skipped (overflow) or inside an accumulation window (only the Nth call of
        N accumulation steps updates; the others only count the micro-step)."""
        self._require_optimizer("step")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        if self.loss_scaler.scale != 1.0 and len(self.reducer.backward_passes) > self._engine_backwards:
            raise RuntimeError(
                "a backward pass ran without engine.backward(loss): with fp16 the loss must be scaled by the "
                "engine, or the gradients come out divided by the loss scale"
            )
        if len(self.reducer.backward_passes) != self._backwards_at_clip:
            # clip_grad_norm_ was called inside the accumulation window: its norm is of part of the
            # gradients, so the step measures them again (keeping that call's max_norm).
            self.optimizer.gradients_changed()
        self.reducer.backward_passes.clear()
        self._backwards_at_clip = 0
        self._engine_backwards = 0
        stepped = self.optimizer.step()
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()  # DeepSpeed: not after an overflow skip
        self.global_steps += 1
        self.zero_grad()
        return stepped

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window: its backward
        reduces and its step() updates."""
        return (self.micro_steps + 1) % self._accumulation_steps == 0

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step that the engine accumulates (1 under `ZeroAccelerator`,
        whose own `gradient_accumulation_steps` drives accumulation through `no_sync`)."""
        return self._accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The DeepSpeed config's micro batch per rank (None if it sets none): the engine cannot apply
        it to your data loader, so build the loader with it."""
        return self._micro_batch_size

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm (over every rank's shard); the next `step` clips it to `max_norm`,
        unless `ZeroConfig.gradient_clipping` is set, which clips every step without a call and then
        governs: a different finite `max_norm` is an error, inf reads the norm only (see [Note: one
        clipping value] in optimizer.py).
        """
        self._require_optimizer("clip_grad_norm_")
        norm = self.optimizer.clip_grad_norm_(max_norm)
        self._backwards_at_clip = len(self.reducer.backward_passes)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the engine's gradient buffers (`set_to_none` is accepted for API compatibility)."""
        self._require_open("zero_grad")
        for group in self.groups:
            group.zero_grad()
        self.reducer.forget_reduced()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps of gradient accumulation: stages 0-1 skip the reduction until the step's last
        backward (outside this context); stages 2-3 still reduce each micro-step into the shards."""
        self._require_optimizer("no_sync")
        previous = self.reducer.sync
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = previous

    # ------------------------------------------------------------------ for step drivers (DrivenEngine)
    @property
    def comm_device(self) -> torch.device:
        """Where the collectives run (offloaded shards are on the host, the group's device is not)."""
        return self.groups[0].device

    @contextlib.contextmanager
    def scheduled_backwards(self) -> Iterator[None]:
        """Backward passes a schedule runs itself, on losses it scaled by `loss_scale`: stages 0-1
        accumulate them and reduce once at the end (a schedule's backwards end on different micro-batches
        on different stages), stage 3 keeps its root block gathered throughout (its forwards and
        backwards interleave), and they count as the engine's own, so that `step` catches only a
        backward run outside both."""
        self._require_optimizer("scheduled_backwards")
        accumulate = self.no_sync() if self.config.stage <= 1 else contextlib.nullcontext()
        before = len(self.reducer.backward_passes)
        with accumulate, self._root_held():
            yield
        if self.config.stage <= 1:
            self.reducer.reduce_accumulated()
        self._engine_backwards += len(self.reducer.backward_passes) - before

    @contextlib.contextmanager
    def scheduled_forwards(self) -> Iterator[None]:
        """Forward passes a schedule runs itself (evaluation): stage 3 keeps its root block gathered."""
        with self._root_held():
            yield

    def _root_held(self) -> contextlib.AbstractContextManager[None]:
        return self.scheduler.hold_root() if self.scheduler is not None else contextlib.nullcontext()

    def gradient_piece(self, name: str) -> torch.Tensor:
        """This rank's piece of trainable parameter `name`'s reduced gradient."""
        group, unit = self.parameter_unit(name)
        return group.grad_piece(unit)

    # ------------------------------------------------------------------ state
    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (None before the first step)."""
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def step_was_skipped(self) -> bool:
        return self.optimizer is not None and self.optimizer.step_was_skipped

    @property
    def world_size(self) -> int:
        return self.collectives.world_size

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's state dict, consolidated tensor by tensor, with `module.state_dict()`'s keys.

        Sharded parameters come from the fp32 master weights (the exact trained values); frozen
        parameters and buffers as they are. Every rank must call it (it communicates); only rank 0
        gets the tensors unless `rank0_only=False`. Peak memory beyond the shards: one unit. See
        full_state.py.
        """
        self._require_open("full_state_dict")
        return full_state_dict(
            self.module,
            self.groups,
            self.collectives,
            self.parallel,
            self.tensor_slices,
            self.pipeline,
            rank0_only,
        )

    # [Note: engine state dicts]
    # nn.Module's state_dict / load_state_dict see only `module`'s parameters, which are views of the
    # 16-bit buffers, not the fp32 master shards the next step writes back over them; stage 3's released
    # parameters have no storage at all. So a stage 3 read would return freed storage: refused, naming
    # full_state_dict(). Loads (engine.load_state_dict, or into engine.module) go through the module's
    # pre-hooks, which write the fp32 master too at stages 0-2 and refuse stage 3 (see [Note: module
    # loads] in module_loads.py).
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`nn.Module.state_dict` of the wrapped module (keys `module.`-prefixed) at stages 0-2, whose
        parameters are the live compute-dtype values; stage 3 raises (its parameters are released
        between uses): use `full_state_dict()`. See [Note: engine state dicts]."""
        self._require_open("state_dict")
        if self.config.partitions_parameters:
            raise RuntimeError(
                "engine.state_dict() at ZeRO stage 3: the module's parameters are released between uses, "
                "so its state dict would hold freed storage; call engine.full_state_dict() on every rank "
                "(collective) for the whole model's values"
            )
        return super().state_dict(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints (EngineState)
    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer passed in (or built from the DeepSpeed config), rebuilt over the groups' fp32
        master shards: schedulers and checkpoints read and turn its `param_groups` and state."""
        self._require_optimizer("base_optimizer")
        return self.optimizer.optimizer

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "stage": self.config.stage,
            "mixed_precision": self.config.mixed_precision,
            "global_steps": self.global_steps,
            "loss_scaler": self.loss_scaler.state_dict(),
        }

    def restore_checkpoint_state(self, manifest: Mapping[str, Any]) -> None:
        precision = manifest.get("mixed_precision", self.config.mixed_precision)
        kept = self.loss_scaler.resume(precision, manifest["loss_scaler"])
        if kept is not None and self.collectives.rank == 0:
            logger.warning("the checkpoint's loss scale was not restored: %s", kept)
        self.global_steps = int(manifest["global_steps"])

    def save_checkpoint(self, directory: str | Path) -> None:
        """Every rank writes its own shard (fp32 master + optimizer state) to `directory`; with tensor
        slicing or pipeline stages, each (pipeline rank, tensor rank)'s data group a sub-checkpoint of
        what it holds (see [Note: sliced checkpoints] and [Note: pipeline checkpoints] in
        checkpoint.py). Collective."""
        self._require_optimizer("save_checkpoint")
        steps = self._accumulation_steps
        if self.micro_steps % steps:
            raise RuntimeError(
                f"save_checkpoint inside an accumulation window ({self.micro_steps % steps} of {steps} "
                "micro-steps accumulated): their gradients are not saved; save after the boundary's step()"
            )
        layout = tensor_layout(self.parallel, self.tensor_slices, self.pipeline)
        agree = agreeing_ranks(self, layout)
        scheduler, directory = self.lr_scheduler, Path(directory)
        if scheduler is not None:  # before the manifest, written last; a failure fails every rank
            write_on_every_rank(
                agree,
                directory,
                lambda: save_scheduler_state(scheduler, directory) if agree.rank == 0 else None,
            )
        save_engine(self, directory, layout)

    def load_checkpoint(self, directory: str | Path, verify: bool = True) -> dict[str, Any]:
        """This rank's shard from a checkpoint saved at any world size, stage, tensor degree and pipeline
        layout (see [Note: reshaping], [Note: sliced checkpoints] and [Note: pipeline checkpoints] in
        checkpoint.py); `verify` checks the files' sha256. Returns the manifest."""
        self._require_optimizer("load_checkpoint")
        layout = tensor_layout(self.parallel, self.tensor_slices, self.pipeline)
        if is_deepspeed_checkpoint(directory):
            return self._load_deepspeed_checkpoint(directory, sliced=layout is not None)
        schedule = read_on_every_rank(
            agreeing_ranks(self, layout), lambda: read_scheduler_state(self.lr_scheduler, Path(directory))
        )
        manifest = load_engine(self, directory, verify, layout)
        if schedule is not None:
            self.lr_scheduler.load_state_dict(schedule)
        self.micro_steps = 0  # checkpoints are saved at accumulation boundaries
        return manifest

    def _load_deepspeed_checkpoint(self, directory: str | Path, sliced: bool) -> dict[str, Any]:
        """A checkpoint DeepSpeed's `engine.save_checkpoint` wrote (see sharding/deepspeed/restore.py),
        its lr schedule's state included when this engine has one of DeepSpeed's schedules."""
        summary = load_deepspeed_checkpoint(self, directory, sliced=sliced)
        schedule = summary["lr_scheduler"]
        if schedule is not None and self.lr_scheduler is not None:
            if not isinstance(self.lr_scheduler, DeepSpeedSchedule):
                raise CheckpointError(
                    f"{directory} holds DeepSpeed's lr schedule state {schedule}, which this engine's "
                    f"{type(self.lr_scheduler).__name__} cannot take: build the engine from the run's "
                    "DeepSpeed config (its scheduler section) to resume the schedule"
                )
            self.lr_scheduler.load_deepspeed_state(schedule)
        elif schedule is not None:
            logger.warning(
                "%s holds an lr schedule's state, which this engine has no scheduler of its own to take: it is "
                "returned as the load's lr_scheduler (a ZeroTrainer gives it to the Trainer's scheduler)",
                directory,
            )
        self.micro_steps = 0
        return summary

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: 16-bit (compute-dtype) params, grads, fp32 master, optimizer
        state, their total, and how much of the total is in host memory (offload) or on the device."""
        totals = {"params": 0, "grads": 0, "master": 0}
        for group in self.groups:
            for kind, nbytes in group.memory_bytes().items():
                totals[kind] += nbytes
        totals["optimizer_state"] = self.optimizer.state_bytes() if self.optimizer is not None else 0
        # the offloaded step's 16-bit copies of the parameter shard, on their way to the device
        copies = self.optimizer.host_copies() if self.optimizer is not None else []
        totals["params"] += sum(copy.untyped_storage().nbytes() for copy in copies)
        totals["total"] = sum(totals.values())
        host = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.host_tensors()}
        totals["host"] = sum(host.values())
        totals["device"] = totals["total"] - totals["host"]
        return totals

    def host_tensors(self) -> list[torch.Tensor]:
        """What CPU offload keeps in host memory: master and optimizer state, the stage 2-3 gradient
        shard (and gradients in transit), the 16-bit copies the step writes, the stage 3 parameter shard."""
        tensors = [t for group in self.groups for t in group.host_tensors()]
        if self.config.offload_optimizer == "cpu" and self.optimizer is not None:
            tensors += self.optimizer.state_tensors() + self.optimizer.host_copies()
        return tensors

    def compile_stats(self) -> dict[str, float] | None:
        """With compiled blocks (see [Note: compiled blocks] in compile.py): the compilations torch ran in
        this process since the engine was built, and the seconds they took; None without."""
        clock = self._compile_clock
        return None if clock is None else {"compiles": clock.compiles, "compile_seconds": clock.seconds}

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Calls and payload bytes per collective kind since the last reset."""
        return self.collectives.stats.as_dict()

    def reset_comm_stats(self) -> None:
        self.collectives.stats.reset()

    # ------------------------------------------------------------------ setup helpers
    def _flat_groups(self, plan: ShardingPlan, placement: Placement, trainable: bool) -> list[FlatGroup]:
        """One flat group per param group of the plan, its buffers not yet filled."""
        alignment = layout_alignment(placement.device, self.compute_dtype)
        return [
            FlatGroup(
                group,
                self.config.stage,
                self.compute_dtype,
                placement,
                self.collectives,
                alignment,
                trainable=trainable,
            )
            for group in plan.groups
        ]

    def _sharded_optimizer(
        self, optimizer: torch.optim.Optimizer, placement: Placement, fused_adam: str
    ) -> ShardedOptimizer:
        return ShardedOptimizer(
            optimizer,
            self.groups,
            self.collectives,
            self.loss_scaler,
            self.config.gradient_clipping,
            sharded=self.config.stage >= 1,
            offloaded=placement.optimizer_on_host,
            fused_adam=fused_adam,
            model_parallel=self._model_parallel_norm(),
        )

    def _model_parallel_norm(self) -> ModelParallelNorm | None:
        """How the gradient norm sums over the tensor and pipeline groups, counting once what several of
        their ranks hold: the parameters tensor slicing leaves whole, and the tied embedding's copy on the
        last stage."""
        if self.parallel is None or (self.parallel.dims.tensor == 1 and self.pipeline is None):
            return None
        reductions, counted = [], [{} for _ in self.groups]
        if self.parallel.dims.tensor > 1:
            reductions.append(Collectives(self.parallel.tensor))
            for fractions, group in zip(counted, self.groups, strict=True):
                for slot in group.layout.slots:
                    if slot.name not in self.tensor_slices:
                        fractions[slot.index] = 1 / self.parallel.dims.tensor
        if self.pipeline is not None:
            reductions.append(Collectives(self.parallel.pipeline))
            copies = set(self.pipeline.shared) if not self.pipeline.holds_first else set()
            for fractions, group in zip(counted, self.groups, strict=True):
                for slot in group.layout.slots:
                    if slot.name in copies:
                        fractions[slot.index] = 0.0
        return ModelParallelNorm(reductions, counted)

    def parameter_unit(self, name: str) -> tuple[FlatGroup, Unit]:
        """The flat group and unit holding trainable parameter `name`."""
        for group in self.groups:
            for slot in group.layout.slots:
                if slot.name == name:
                    return group, group.layout.units[slot.unit]
        raise KeyError(f"{name} is not a trainable parameter of this engine")

    def _gradient_reducer(self) -> GradientReducer:
        """The backward hooks; stage 3 releases each unit's gathered parameters once it is reduced."""
        return GradientReducer(
            self.groups,
            self.config.stage,
            self.collectives,
            self.config.overlap_comm,
            self.config.reduce_bucket_size,
            on_unit_reduced=self.scheduler.on_unit_reduced if self.scheduler else None,
            on_backward_end=self.scheduler.release_all if self.scheduler else None,
        )


def layout_alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Elements each rank's piece of a unit is aligned to (see CUDA_ALIGNMENT_BYTES)."""
    if device.type != "cuda":
        return 1
    return CUDA_ALIGNMENT_BYTES // torch.tensor([], dtype=dtype).element_size()


def _release_parts(
    reducer: GradientReducer | None,
    scheduler: ParameterScheduler | None,
    optimizer: ShardedOptimizer | None,
    groups: list[FlatGroup],
    collectives: Collectives,
    compile_clock: CompileClock | None,
    module_load_hooks: list[RemovableHandle],
) -> None:
    """An engine's teardown (its finalizer: see `ZeroEngine.close`). Reductions first, since they write
    into the groups' buffers; then gathers; then the optimizer and the buffers themselves; last the gather
    group, once nothing is in flight on it."""
    if reducer is not None:
        reducer.close()
    if scheduler is not None:
        scheduler.close()
    if optimizer is not None:
        optimizer.close()
    for group in groups:
        group.close()
    collectives.close()
    if compile_clock is not None:
        compile_clock.close()
    for handle in module_load_hooks:
        handle.remove()  # after close() the module's views are plain parameters again
