"""`initialize`: the engine's one front door.

Whatever forms the inputs come in (a ZeroConfig, a DeepSpeed config as a dict or JSON path, a dict of
fields, None; parallel degrees or groups already built; a pretrained path), they are settled here, once,
into the typed `EngineParts` the engine is built from, as FSDP2's `fully_shard` settles its arguments
before building an `FSDPParamGroup`. Here too the model is cut for this rank (pipeline stages, then
tensor slices, then the sharding plan over the data group), the device and backend are checked, the
fused Adam kernel is resolved (built, if it must be), and the step driver is chosen. The engine imports
none of this: no reader, no builder, no driver.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import Collectives, CommStats
from .compile import CompileConfig, check_compile_fits, compile_blocks
from .config import ZeroConfig
from .deepspeed import DeepSpeedConfig, engine_optimizer, engine_settings
from .engine import EngineParts, ZeroEngine
from .kernels.fused_adam import ready_backend, steps_like_adam
from .offload import Placement
from .optimizer_kinds import check_optimizer_kind
from .parallel import (
    ModelPlan,
    ParallelDims,
    ParallelGroups,
    apply_model_plan,
    parallel_groups,
    shared_parameter_groups,
)
from .pipeline import PipelineRunner, keep_stage_parameters
from .plan import plan_sharding
from .pretrained import SOURCE_ATTRIBUTE, PretrainedSource
from .schedule import AccumulationDriver

logger = logging.getLogger(__name__)


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
    compile_config: CompileConfig | None = None,
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

    `compile_config` compiles the forward of each block (the model's `_no_split_modules` layers) with
    torch.compile, after the cut and before the engine's hooks, which stay eager (see [Note: compiled
    blocks] in compile.py); `engine.compile_stats()` then counts the compilations and their time.

    `parallel` lays the world out as tensor x pipeline x data (see [Note: parallel layout] in
    parallel.py): the model is cut down to this rank's pipeline stages, then its declared tensor-parallel
    plan is applied (a model holding weights must hold the same on every rank; a meta model is
    initialized whole and cut), and the engine shards over the data-parallel group, instead of
    `process_group`. With pipeline stages, train with `train_batch` (see pipeline.py).
    """
    settings = engine_settings(config).with_checked_dtypes()  # a DeepSpeed config's training part too
    zero = settings.zero
    if optimizer is not None:
        # Before the model is cut or anything sharded, so that a refusal loses nothing; a DeepSpeed
        # optimizer section builds torch's Adam / AdamW (see [Note: element-wise optimizers]).
        check_optimizer_kind(optimizer, zero.allow_untested_optimizer)
    # Tensor slicing is applied first, so that the engine shards each rank's slices, over the data
    # group only (see [Note: parallel layout] in parallel.py).
    groups = parallel_groups(parallel, process_group)
    if groups is not None:
        process_group = groups.data
    collectives = Collectives(process_group, CommStats())
    batch_sizes = settings.batch_sizes(collectives.world_size)  # checked before any work
    if groups is not None and groups.dims.pipeline > 1 and batch_sizes.gradient_accumulation_steps != 1:
        raise ValueError(
            f"under pipeline stages the micro-batches given to train_batch are the step's accumulation, but "
            f"{settings.source} accumulates {batch_sizes.gradient_accumulation_steps} per step "
            "(gradient_accumulation_steps): set it to 1"
        )
    if compile_config is not None:
        check_compile_fits(compile_config, zero)
    model_plan = apply_model_plan(model, groups) if groups is not None else ModelPlan({})
    optimizer = engine_optimizer(settings, model, optimizer)
    pipeline, shared = None, {}
    if model_plan.pipeline is not None:
        if optimizer is not None:
            keep_stage_parameters(optimizer, model_plan.dropped)
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        shared = shared_parameter_groups(groups, model_plan.pipeline, trainable)
        pipeline = PipelineRunner(model_plan.pipeline, groups, shared)
    plan = plan_sharding(model, optimizer, zero, own_units=set(shared))
    # This rank's blocks, as cut, before the engine hooks them; without compile_config, blocks an earlier
    # engine compiled run eager again.
    compiled_blocks = tuple(compile_blocks(model, compile_config))
    _check_backend(plan.device, collectives)
    placement = Placement(
        _target_device(device, plan.device),
        optimizer_on_host=zero.offload_optimizer == "cpu",
        params_on_host=zero.offload_param == "cpu",
    )
    scheduler = settings.training.scheduler
    parts = EngineParts(
        config=zero,
        gradient_accumulation_steps=batch_sizes.gradient_accumulation_steps,
        train_micro_batch_size_per_gpu=batch_sizes.train_micro_batch_size_per_gpu,
        collectives=collectives,
        plan=plan,
        placement=placement,
        driver=pipeline if pipeline is not None else AccumulationDriver(),
        fused_adam=(
            _fused_adam_backend(zero.fused_adam, placement.device, placement.optimizer_on_host, optimizer)
            if optimizer is not None
            else "none"
        ),
        init_seed=init_seed,
        pretrained=_pretrained_source(model, pretrained),
        parallel=groups,
        tensor_slices=model_plan.tensor_slices,
        pipeline=pipeline,
        build_lr_scheduler=scheduler.build if scheduler is not None else None,
        compiled_blocks=compiled_blocks,
    )
    try:
        return ZeroEngine(model, optimizer, parts)
    except BaseException:
        compile_blocks(model, None)  # the model as it came, its blocks eager
        raise


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
