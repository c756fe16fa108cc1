"""`ZeroEngine`: composes the flat groups, gradient reducer, stage 3 scheduler and sharded step.

The stage is a policy, not a class hierarchy: `ZeroConfig.stage` decides which buffers a
`FlatGroup` keeps (flat_group.py), which collective reduces a unit's gradients (grads.py), and
whether parameters are gathered around their use (params.py).

Checkpoints (checkpoint.py) and pretrained loading (pretrained.py) see the engine through the
`EngineState` protocol (engine_state.py), which it implements: they import nothing from here.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import load_engine, save_engine, tensor_layout
from .collectives import Collectives, CommStats
from .config import ZeroConfig
from .deepspeed import DeepSpeedConfig, engine_optimizer, engine_settings
from .flat_group import FlatGroup
from .grads import GradientReducer
from .init import materialize
from .kernels.fused_adam import ready_backend, steps_like_adam
from .loss_scaler import LossScaler
from .offload import Placement
from .optimizer import ModelParallelNorm, ShardedOptimizer
from .parallel import (
    ModelPlan,
    ParallelDims,
    ParallelGroups,
    apply_model_plan,
    gather_tensor_slices,
    parallel_groups,
    shared_parameter_groups,
)
from .params import ParameterScheduler
from .partition import Unit
from .pipeline import PipelineRunner, keep_stage_parameters
from .plan import ShardingPlan, plan_sharding
from .pretrained import SOURCE_ATTRIBUTE, PretrainedSource, load_pretrained
from .schedule import eval_batch, train_batch
from .scheduler_state import read_scheduler_state, save_scheduler_state

logger = logging.getLogger(__name__)

COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# On CUDA each rank's piece of a unit starts on a 256-byte boundary: NCCL and vectorised kernels
# are fastest on aligned buffers. On CPU the padding would only cost memory.
CUDA_ALIGNMENT_BYTES = 256


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

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: ZeroConfig | DeepSpeedConfig | Mapping[str, Any] | str | Path | None = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        init_seed: int = 0,
        pretrained: PretrainedSource | str | Path | None = None,
        parallel: ParallelDims | ParallelGroups | None = None,
    ):
        super().__init__()
        settings = engine_settings(config)  # a DeepSpeed config's training part too (deepspeed.py)
        self.config = settings.zero
        # Tensor slicing is applied first, so that the engine shards each rank's slices, over the data
        # group only (see [Note: parallel layout] in parallel.py).
        self.parallel = parallel_groups(parallel, process_group)
        model_plan = apply_model_plan(module, self.parallel) if self.parallel is not None else ModelPlan({})
        self.tensor_slices = model_plan.tensor_slices
        if self.parallel is not None:
            process_group = self.parallel.data
        optimizer = engine_optimizer(settings, module, optimizer)
        self.pipeline = None
        shared = {}
        if model_plan.pipeline is not None:
            if optimizer is not None:
                keep_stage_parameters(optimizer, model_plan.dropped)
            trainable = {name for name, p in module.named_parameters() if p.requires_grad}
            shared = shared_parameter_groups(self.parallel, model_plan.pipeline, trainable)
            self.pipeline = PipelineRunner(model_plan.pipeline, self.parallel, shared)
        self.collectives = Collectives(process_group, CommStats())
        self.batch_sizes = settings.batch_sizes(self.collectives.world_size)  # checked before any work
        plan = plan_sharding(module, optimizer, self.config, own_units=set(shared))
        _check_backend(plan.device, self.collectives)
        self.module = module
        self.compute_dtype = COMPUTE_DTYPES[self.config.mixed_precision]
        target = _target_device(device, plan.device)
        placement = Placement(
            target,
            optimizer_on_host=self.config.offload_optimizer == "cpu",
            params_on_host=self.config.offload_param == "cpu",
        )
        self.groups = self._flat_groups(plan, placement, trainable=optimizer is not None)
        self._fill_shards(plan.device, target, init_seed, _pretrained_source(module, pretrained))
        self._cast_frozen_floating_tensors()
        self.loss_scaler = LossScaler(self.config)
        self.optimizer = self._sharded_optimizer(optimizer, placement) if optimizer is not None else None
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
        # The DeepSpeed config's scheduler, stepped by step() after each applied update.
        self.lr_scheduler = (
            settings.training.scheduler.build(optimizer) if settings.training.scheduler is not None else None
        )
        if self.config.partitions_parameters and optimizer is not None:
            # Stage 3 training: gathers on a group of their own (see [Note: gather group] in
            # collectives.py). Opened last, so that no error above leaves it behind unclosed.
            self.collectives.open_gather_group()
        # Teardown without __del__ (see [Note: engine lifetime] in grads.py): runs once, at close(), when
        # the engine is garbage-collected, or at interpreter exit. Its arguments must not hold the engine.
        self._finalizer = weakref.finalize(
            self, _release_parts, self.reducer, self.scheduler, self.optimizer, self.groups, self.collectives
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
        if self.pipeline is not None:
            return self.pipeline.train_batch(self, micro_batches)
        return train_batch(self, micro_batches)

    def eval_batch(self, micro_batches: Sequence[Any]) -> torch.Tensor:
        """The mean loss over `micro_batches` (as `train_batch` takes them) and the data-parallel ranks,
        forward only, in eval mode: through the pipeline schedule with pipeline stages, else micro-batch by
        micro-batch."""
        self._require_open("eval_batch")
        training = self.module.training
        self.module.eval()  # no dropout, as for any evaluation; the mode is restored after
        try:
            if self.pipeline is not None:
                return self.pipeline.eval_batch(self, micro_batches)
            return eval_batch(self, micro_batches)
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
        steps = self.batch_sizes.gradient_accumulation_steps
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
        self.reducer.backward_passes.clear()
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
        return (self.micro_steps + 1) % self.batch_sizes.gradient_accumulation_steps == 0

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step that the engine accumulates (1 under `ZeroAccelerator`,
        whose own `gradient_accumulation_steps` drives accumulation through `no_sync`)."""
        return self.batch_sizes.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The DeepSpeed config's micro batch per rank (None if it sets none): the engine cannot apply
        it to your data loader, so build the loader with it."""
        return self.batch_sizes.train_micro_batch_size_per_gpu

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm (over every rank's shard); the next `step` clips it to `max_norm`.

        For `Accelerator.clip_grad_norm_`-style loops; `ZeroConfig.gradient_clipping` does the same
        for every step without a call.
        """
        self._require_optimizer("clip_grad_norm_")
        return self.optimizer.clip_grad_norm_(max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the engine's gradient buffers (`set_to_none` is accepted for API compatibility)."""
        self._require_open("zero_grad")
        for group in self.groups:
            group.zero_grad()

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
        gets the tensors unless `rank0_only=False`. Peak memory beyond the shards: one unit.
        """
        self._require_open("full_state_dict")
        keep = self.collectives.rank == 0 or not rank0_only
        gathered = self._gathered_master(keep)
        if not keep:
            return {}
        result = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) in gathered:
                result[name] = gathered[id(tensor)]
            else:
                result[name] = tensor.detach().clone().cpu()
        # Model parallelism: the whole tensors from every tensor rank's slices, then every stage's.
        if self.tensor_slices:
            result = self._whole_slices(result)
            if rank0_only and self.parallel.rank("tensor") != 0:
                return {}
        if self.pipeline is not None:
            result = self._all_stages(result, rank0_only)
        return result

    def _gathered_master(self, keep: bool) -> dict[int, torch.Tensor]:
        """{id(parameter): its whole fp32 master value, on the CPU} (empty unless `keep`), all-gathered
        over the data group one unit at a time. Collective."""
        gathered: dict[int, torch.Tensor] = {}
        for group in self.groups:
            layout = group.layout
            for unit in layout.units:
                full = torch.empty(unit.numel, dtype=torch.float32, device=group.device)
                piece = layout.shard_piece(group.master, unit).to(group.device)  # offloaded: from the host
                if layout.num_shards == 1:
                    full.copy_(piece)
                else:
                    self.collectives.all_gather(full, piece)
                if keep:
                    for index in unit.slots:
                        slot = layout.slots[index]
                        gathered[id(group.params[index])] = layout.param_view(full, slot).clone().cpu()
        return gathered

    def _whole_slices(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every cut parameter whole, from every tensor rank's slice (under one state-dict
        key each, tied ones too). Collective over the tensor group."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        keys = {key: names.get(id(t)) for key, t in self.module.state_dict(keep_vars=True).items()}
        local = {name: state[key] for key, name in keys.items() if name is not None}
        whole = gather_tensor_slices(local, self.tensor_slices, self.parallel.tensor, self.groups[0].device)
        return {key: whole.get(keys[key], value) for key, value in state.items()}

    def _all_stages(self, state: dict[str, torch.Tensor], rank0_only: bool) -> dict[str, torch.Tensor]:
        """Every pipeline stage's `state` merged (a tied embedding, on two stages, has the same value on
        both), on pipeline rank 0 only with `rank0_only` (the others get {}). Collective over the
        pipeline group."""
        group = self.parallel.pipeline
        stages = [{}] * self.parallel.dims.pipeline
        if rank0_only:
            first = dist.get_global_rank(group, 0)
            receiving = dist.get_rank() == first
            dist.gather_object(state, stages if receiving else None, dst=first, group=group)
            if not receiving:
                return {}
        else:
            dist.all_gather_object(stages, state, group=group)
        return {key: value for stage in stages for key, value in stage.items()}

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
        self.loss_scaler.load_state_dict(manifest["loss_scaler"])
        self.global_steps = int(manifest["global_steps"])

    def save_checkpoint(self, directory: str | Path) -> None:
        """Every rank writes its own shard (fp32 master + optimizer state) to `directory`; with tensor
        slicing or pipeline stages, each (pipeline rank, tensor rank)'s data group a sub-checkpoint of
        what it holds (see [Note: sliced checkpoints] and [Note: pipeline checkpoints] in
        checkpoint.py). Collective."""
        self._require_optimizer("save_checkpoint")
        steps = self.batch_sizes.gradient_accumulation_steps
        if self.micro_steps % steps:
            raise RuntimeError(
                f"save_checkpoint inside an accumulation window ({self.micro_steps % steps} of {steps} "
                "micro-steps accumulated): their gradients are not saved; save after the boundary's step()"
            )
        layout = tensor_layout(self.parallel, self.tensor_slices, self.pipeline)
        first = layout.world.rank == 0 if layout is not None else self.collectives.rank == 0
        if self.lr_scheduler is not None and first:
            save_scheduler_state(self.lr_scheduler, Path(directory))  # before the manifest, written last
        save_engine(self, directory, layout)

    def load_checkpoint(self, directory: str | Path, verify: bool = True) -> dict[str, Any]:
        """This rank's shard from a checkpoint saved at any world size, stage, tensor degree and pipeline
        layout (see [Note: reshaping], [Note: sliced checkpoints] and [Note: pipeline checkpoints] in
        checkpoint.py); `verify` checks the files' sha256. Returns the manifest."""
        self._require_optimizer("load_checkpoint")
        schedule = read_scheduler_state(self.lr_scheduler, Path(directory))
        layout = tensor_layout(self.parallel, self.tensor_slices, self.pipeline)
        manifest = load_engine(self, directory, verify, layout)
        if schedule is not None:
            self.lr_scheduler.load_state_dict(schedule)
        self.micro_steps = 0  # checkpoints are saved at accumulation boundaries
        return manifest

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

    def _fill_shards(
        self, planned: torch.device, target: torch.device, seed: int, source: PretrainedSource | None
    ) -> None:
        """The groups' buffers from the module's own weights (every rank taking rank 0's), or for a meta
        model from `source` and/or the seeded initialization."""
        self.pretrained_bytes_read = 0  # what this rank read of a pretrained checkpoint
        if planned.type == "meta":
            self._materialize(seed, target, source)
            return
        if source is not None:
            raise ValueError(
                f"pretrained={source.path} needs a model built on the meta device (meta_from_pretrained); this "
                "one already holds weights"
            )
        if target != planned:
            raise ValueError(f"device={target} differs from the model's device {planned}; move the model")
        self._sync_module_states()
        for group in self.groups:
            group.build_from_params()

    def _sharded_optimizer(self, optimizer: torch.optim.Optimizer, placement: Placement) -> ShardedOptimizer:
        return ShardedOptimizer(
            optimizer,
            self.groups,
            self.collectives,
            self.loss_scaler,
            self.config.gradient_clipping,
            sharded=self.config.stage >= 1,
            offloaded=placement.optimizer_on_host,
            fused_adam=_fused_adam_backend(
                self.config.fused_adam, placement.device, placement.optimizer_on_host, optimizer
            ),
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

    def _sync_module_states(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DistributedDataParallel does."""
        if not self.collectives.active:
            return
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                self.collectives.broadcast(tensor.data, 0)

    def _materialize(self, seed: int, device: torch.device, source: PretrainedSource | None) -> None:
        """A meta-device model: each rank builds only its shards, from a checkpoint's slices (see
        [Note: pretrained shards]) and/or the seeded initialization (see [Note: seeded initialization])."""
        where = {id(p): (group, i) for group in self.groups for i, p in enumerate(group.params)}
        for group in self.groups:
            group.allocate()
        # Tensor slicing: parameters are initialised whole and this rank keeps its slice of each.
        parameters = dict(self.module.named_parameters())
        cuts = {id(parameters[name]): cut for name, cut in self.tensor_slices.items()}
        whole_shapes = {
            id(parameters[name]): cut.full_shape(parameters[name].shape)
            for name, cut in self.tensor_slices.items()
        }

        def keep(param: nn.Parameter, value: torch.Tensor) -> None:
            if id(param) in cuts:
                value = cuts[id(param)].local(value)
            if id(param) in where:
                group, index = where[id(param)]
                group.load_slot(index, value)
            else:  # frozen: kept whole, as on every rank
                torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=False))

        if source is None:
            materialize(self.module, seed, device, keep, whole_shapes=whole_shapes)
        else:
            loaded = load_pretrained(self, source, device, self.tensor_slices)
            self.pretrained_bytes_read = loaded.bytes_read
            if loaded.uninitialized:
                materialize(
                    self.module, seed, device, keep, only=loaded.uninitialized, whole_shapes=whole_shapes
                )
        for group in self.groups:
            group.finish()

    def _cast_frozen_floating_tensors(self) -> None:
        """Frozen parameters compute in the same dtype as the sharded ones."""
        if self.compute_dtype == torch.float32:
            return
        sharded = {id(p) for group in self.groups for p in group.params}  # inference: frozen but sharded
        for param in self.module.parameters():
            if not param.requires_grad and param.is_floating_point() and id(param) not in sharded:
                param.data = param.data.to(self.compute_dtype)


def _target_device(requested: torch.device | str | None, planned: torch.device) -> torch.device:
    """Where the engine's buffers live: `requested`, else the model's device; a meta model's default is
    the current CUDA device, else the CPU. "cuda" means the current device, as in model.cuda()."""
    if requested is not None:
        target = torch.device(requested)
    elif planned.type == "meta":
        target = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    else:
        target = planned
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


def layout_alignment(device: torch.device, dtype: torch.dtype) -> int:
    """Elements each rank's piece of a unit is aligned to (see CUDA_ALIGNMENT_BYTES)."""
    if device.type != "cuda":
        return 1
    return CUDA_ALIGNMENT_BYTES // torch.tensor([], dtype=dtype).element_size()


def _pretrained_source(
    module: nn.Module, pretrained: PretrainedSource | str | Path | None
) -> PretrainedSource | None:
    if pretrained is None:
        return getattr(module, SOURCE_ATTRIBUTE, None)
    return pretrained if isinstance(pretrained, PretrainedSource) else PretrainedSource(str(pretrained))


def _fused_adam_backend(
    choice: str, device: torch.device, offloaded: bool, optimizer: torch.optim.Optimizer
) -> str:
    """`ZeroConfig.fused_adam` for this device: "auto" means the fused kernels on CUDA only (on CPU,
    torch's own fused Adam is faster than the reference and Triton has no CPU backend). The kernel is
    resolved and checked now (`ready_backend`: the CUDA extension built, a kernel that cannot run on
    `device` named), so that nothing of the kind surfaces inside the first step.

    With the optimizer offloaded the step runs on the host (`CPUAdam`) and no device kernel runs:
    nothing to resolve or build (ZeroConfig refuses a forced kernel with offload). A forced kernel for an
    optimizer it cannot step (not a plain torch Adam / AdamW) would not be applied: an error too."""
    if offloaded:
        return "none"
    if choice not in ("auto", "none") and not steps_like_adam(optimizer):
        raise ValueError(
            f"ZeroConfig.fused_adam={choice!r} forces a fused Adam kernel, but {type(optimizer).__name__} is not a "
            "torch Adam / AdamW it can step (maximize, differentiable and tensor hyperparameters excluded); use "
            "fused_adam='auto' or 'none'"
        )
    if choice == "none" or (choice == "auto" and device.type != "cuda"):
        return "none"
    return ready_backend(choice, device)


def _release_parts(
    reducer: GradientReducer | None,
    scheduler: ParameterScheduler | None,
    optimizer: ShardedOptimizer | None,
    groups: list[FlatGroup],
    collectives: Collectives,
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


def _check_backend(device: torch.device, collectives: Collectives) -> None:
    if not collectives.active:
        return
    backend = dist.get_backend(collectives.group)
    if device.type == "cpu" and "gloo" not in str(backend):
        raise ValueError(f"the model is on the CPU but the process group's backend is {backend}; use gloo")
    if device.type == "cuda" and "nccl" not in str(backend):
        logger.warning(
            "the model is on CUDA but the process group's backend is %s; NCCL is much faster", backend
        )


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ZeroConfig | DeepSpeedConfig | Mapping[str, Any] | str | Path | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    init_seed: int = 0,
    pretrained: PretrainedSource | str | Path | None = None,
    parallel: ParallelDims | ParallelGroups | None = None,
) -> ZeroEngine:
    """Shard `model` and `optimizer` across the ranks of `process_group` (default: the world).

    A model built on the meta device is materialized shard by shard on `device` (default: the
    current CUDA device, else the CPU), with `tnlg.sharding.init`'s per-module seeded
    initialization from `init_seed`: the same values `init_weights(model, init_seed)` gives an
    unsharded model, at every world size and stage. With `pretrained` (a Transformers safetensors
    checkpoint; `meta_from_pretrained` records it on the model) each rank reads only its slices of
    the checkpoint instead (see [Note: pretrained shards] in pretrained.py).

    `optimizer=None` builds an inference-only engine (see `ZeroEngine`): e.g. stage 3 generation
    of a model too large for one rank; unless `config` is a DeepSpeed config with an `optimizer`
    section, which is then built over the model's trainable parameters (both is an error). Its
    `scheduler` section becomes `engine.lr_scheduler`, and its batch keys the engine's gradient
    accumulation (see `TrainingConfig`).

    `parallel` lays the world out as tensor x pipeline x data (see [Note: parallel layout] in
    parallel.py): the model is cut down to this rank's pipeline stages, then its declared tensor-parallel
    plan is applied (a model holding weights must hold the same on every rank; a meta model is
    initialized whole and cut), and the engine shards over the data-parallel group, instead of
    `process_group`. With pipeline stages, train with `train_batch` (see pipeline.py).
    """
    return ZeroEngine(
        model,
        optimizer,
        config,
        process_group,
        device=device,
        init_seed=init_seed,
        pretrained=pretrained,
        parallel=parallel,
    )
