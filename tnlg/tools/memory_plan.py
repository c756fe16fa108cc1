"""One rank's memory, planned from the engine's own layout of a model built on the meta device.

`memory.estimate_memory` is arithmetic on parameter counts. This plan asks the engine instead: the
model is built on the meta device (no storage), the engine's planner (`sharding.plan.plan_sharding`)
cuts it into units exactly as every rank would, `FlatLayout` lays them out at the given world size
(padding and alignment included), and stage 3's transients are found by replaying the engine's own
policies over the real blocks and units:

- gathered parameters: the root block (gathered all step) and, going through the blocks in forward
  and again in backward order, the running block plus what `blocks_to_prefetch` (the scheduler's
  policy) starts gathering within `prefetch_bucket_size` and `max_live_parameters`;
- full gradients: the root block's and the largest block's, which autograd writes whole before the
  reducer copies them, unit by unit, into buckets;
- reduce buckets: stages 2-3 copy each unit's gradients into a bucket kept until its reduce-scatter
  completes, at most `BUCKETS_IN_FLIGHT` reduce buckets' worth in flight (sharding/grads.py), plus
  the one being filled, each with its reduce-scatter's output (this rank's 1/N piece, kept until the
  collective completes too): bounded from above, since the order units complete in follows autograd.

Not counted, as in the estimate: the CUDA context and NCCL's own buffers, allocator fragmentation,
temporaries inside kernels. Activations come from `memory.activation_bytes` (a formula: the model
is never run).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tnlg.modeling.tensor_parallel import plan_slices
from tnlg.sharding.config import ZeroConfig
from tnlg.sharding.engine import COMPUTE_DTYPES, layout_alignment
from tnlg.sharding.grads import BUCKETS_IN_FLIGHT
from tnlg.sharding.parallel import ParallelDims, rank_stages
from tnlg.sharding.params import blocks_to_prefetch, prefetch_floor
from tnlg.sharding.partition import FlatLayout
from tnlg.sharding.pipeline import keep_stage_parameters
from tnlg.sharding.plan import ShardingPlan, plan_sharding
from tnlg.tools.memory import (
    FP32_BYTES,
    GB,
    OPTIMIZER_STATE_BYTES,
    host_step_grad_bytes,
    writes_16bit_copy,
)


@dataclass(frozen=True)
class RankMemoryPlan:
    """Bytes one rank of `world_size` holds, by kind, from the engine's layout (see the module doc);
    with pipeline stages, a rank of pipeline rank `pipeline_rank` of `pipeline_parallel`.

    Model states (kept all step), as `ZeroEngine.memory_stats` counts them: `params` (16-bit; stage 3:
    the shard plus the persistent units), `grads` (stage 1 with the optimizer offloaded: with the
    host buffer the step copies the gradient shard into, `memory.host_step_grad_bytes`), `master`,
    `optimizer_state`, `offload_copy` (the offloaded step's 16-bit copy of the shard, where
    `memory.writes_16bit_copy`). Transients, each at its own peak (their sum bounds their joint peak
    from above: whole gradients become buckets as units are reduced): `gathered` (stage 3's gathered
    blocks), `full_grads` (stage 3's whole gradients before reduction), `buckets` (reduce buckets and
    their reduce-scatter outputs). `activations` come from the caller, offloaded ones included;
    `host` is what offload keeps in host memory."""

    world_size: int
    stage: int
    params: int
    grads: int
    master: int
    optimizer_state: int
    offload_copy: int
    gathered: int
    full_grads: int
    buckets: int
    activations: int
    host: int
    largest_unit: int  # elements: the biggest collective
    prefetch_floor: int  # stage 3: the max_live_parameters that lets every block be prefetched (0 otherwise)
    prefetches: bool  # stage 3: whether any block is prefetched at these settings
    pipeline_parallel: int = 1
    pipeline_rank: int = 0  # the pipeline rank planned (plan_rank_memory's default: the worst)

    @property
    def device(self) -> int:
        states = self.params + self.grads + self.master + self.optimizer_state + self.offload_copy
        return states + self.gathered + self.full_grads + self.buckets + self.activations - self.host


def plan_rank_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    zero: ZeroConfig,
    *,
    world_size: int,
    optimizer_kind: str = "adamw",
    activations: int | Sequence[int] = 0,
    offloaded_activations: int | Sequence[int] = 0,
    device_type: str = "cuda",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_stages: int = 1,
    pipeline_rank: int | None = None,
) -> RankMemoryPlan:
    """The plan for `model` (on the meta device) trained with `optimizer` over it at `zero`'s settings.

    `activations` / `offloaded_activations`: bytes of activations on the device / in host memory
    (`memory.activation_bytes`), one figure, or one per pipeline rank; `device_type`: where the ranks
    compute ("cuda" aligns each rank's piece of a unit to 256 bytes, as the engine does there). Raises
    ValueError as the engine's planner does for a bad model or optimizer, or for a bad layout, world
    size or optimizer kind.

    `tensor_parallel` t: the plan is of tensor rank 0's slices (the model's own plan cuts the meta
    parameters for the time of the call, `plan_slices`), sharded over the world_size / (t x p) data ranks.

    `pipeline_parallel` p (with `virtual_stages`): a copy of the model is cut down to a pipeline rank's
    stages first, as the engine does (the model's `split_pipeline`, then the tensor slices, then the layout, the
    tied embedding a unit of its own on the first and last stage). `pipeline_rank` picks the rank;
    None plans every one and returns the one needing the most device memory (`pipeline_rank` says
    which; the first on a tie). `model` and `optimizer` are left whole.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(
            f"tensor_parallel must be an integer >= 1 dividing world_size, got {tensor_parallel!r}"
        )
    dims = ParallelDims(tensor=tensor_parallel, pipeline=pipeline_parallel, virtual_stages=virtual_stages)
    dims = dims.resolve(world_size)  # the engine's checks and messages for the layout
    activations = _per_pipeline_rank("activations", activations, dims.pipeline)
    offloaded_activations = _per_pipeline_rank("offloaded_activations", offloaded_activations, dims.pipeline)
    if dims.pipeline == 1:
        ranks = [0]
    elif pipeline_rank is None:
        ranks = list(range(dims.pipeline))
    elif isinstance(pipeline_rank, int) and 0 <= pipeline_rank < dims.pipeline:
        ranks = [pipeline_rank]
    else:
        raise ValueError(
            f"pipeline_rank must be None or an integer in [0, {dims.pipeline - 1}], got {pipeline_rank!r}"
        )
    plans = []
    for rank in ranks:
        stage_model, stage_optimizer, own_units = _pipeline_rank_model(model, optimizer, dims, rank)
        plan = _sliced_plan(
            stage_model,
            stage_optimizer,
            zero,
            dims,
            optimizer_kind,
            activations[rank],
            offloaded_activations[rank],
            device_type,
            own_units,
        )
        plans.append(dataclasses.replace(plan, pipeline_parallel=dims.pipeline, pipeline_rank=rank))
    worst = max(plans, key=lambda plan: plan.device)  # max keeps the first on a tie
    return dataclasses.replace(worst, world_size=world_size)


def _per_pipeline_rank(name: str, value: int | Sequence[int], degree: int) -> list[int]:
    """`value` for each of the `degree` pipeline ranks: one figure for all, or one each."""
    figures = list(value) if isinstance(value, Sequence) else [value] * degree
    if len(figures) != degree or not all(isinstance(f, int) and f >= 0 for f in figures):
        raise ValueError(
            f"{name} must be bytes (an integer >= 0), or one such per pipeline rank ({degree}), got {value!r}"
        )
    return figures


def _pipeline_rank_model(
    model: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims, rank: int
) -> tuple[nn.Module, torch.optim.Optimizer, set[str]]:
    """The model and optimizer pipeline rank `rank` trains, and the parameters that get a unit of their
    own: as the engine's `apply_model_plan`, `keep_stage_parameters` and `shared_parameter_groups` make
    them, on a copy (the meta model has no storage to copy)."""
    if dims.pipeline == 1:
        return model, optimizer, set()
    model, optimizer = copy.deepcopy((model, optimizer))  # one memo: the optimizer keeps the copy's params
    whole = {id(p) for p in model.parameters()}
    split = model.split_pipeline(rank_stages(rank, dims.pipeline, dims.virtual_stages), dims.num_stages)
    keep_stage_parameters(optimizer, whole - {id(p) for p in model.parameters()})
    # the engine's shared (summed) parameters: the trainable ones this rank holds that another stage holds
    held = {name for name, p in model.named_parameters() if p.requires_grad}
    own_units = {name for name in split.shared if name in held}
    return model, optimizer, own_units


def _sliced_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    zero: ZeroConfig,
    dims: ParallelDims,
    optimizer_kind: str,
    activations: int,
    offloaded_activations: int,
    device_type: str,
    own_units: set[str],
) -> RankMemoryPlan:
    """`_plan` of tensor rank 0's slices of `model` over the data ranks; the model is whole again after."""
    plan_args = (zero, dims.data, optimizer_kind, activations, offloaded_activations, device_type, own_units)
    if dims.tensor == 1:
        return _plan(model, optimizer, *plan_args)
    parameters = dict(model.named_parameters())
    cuts = plan_slices(model, dims.tensor)
    whole = {name: parameters[name].data for name in cuts}
    try:
        with torch.no_grad():
            for name, cut in cuts.items():
                parameters[name].data = cut.local(whole[name])
        return _plan(model, optimizer, *plan_args)
    finally:
        for name, value in whole.items():
            parameters[name].data = value


def _plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    zero: ZeroConfig,
    world_size: int,
    optimizer_kind: str,
    activations: int,
    offloaded_activations: int,
    device_type: str,
    own_units: set[str],
) -> RankMemoryPlan:
    """`plan_rank_memory` of the model as it is (its own slices), sharded over `world_size` ranks."""
    if optimizer_kind not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"optimizer_kind must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer_kind!r}"
        )
    plan = plan_sharding(model, optimizer, zero, own_units=own_units)
    dtype = COMPUTE_DTYPES[zero.mixed_precision]
    compute = torch.tensor([], dtype=dtype).element_size()
    alignment = layout_alignment(torch.device(device_type), dtype)
    shards = world_size if zero.stage >= 1 else 1
    layouts = [
        FlatLayout(group.names, [tuple(p.shape) for p in group.params], group.units, shards, alignment)
        for group in plan.groups
    ]
    shard = sum(layout.shard_numel for layout in layouts)
    full = sum(layout.full_numel for layout in layouts)
    offload_optimizer = zero.offload_optimizer == "cpu"
    offload_param = zero.offload_param == "cpu"

    params = compute * (full if zero.stage < 3 else shard + _persistent_numel(plan, layouts))
    # Stages 2-3 keep a gradient shard (fp32 on the host when the optimizer is there), 0-1 a full buffer;
    # stage 1 with the optimizer on the host also a host buffer the step copies the shard into.
    grad_bytes = FP32_BYTES if offload_optimizer else compute
    grads = grad_bytes * shard if zero.stage >= 2 else compute * full
    step_grad = host_step_grad_bytes(zero, optimizer_kind) * shard
    master, optimizer_state = FP32_BYTES * shard, OPTIMIZER_STATE_BYTES[optimizer_kind] * shard
    # The same condition as the estimate's: only CPUAdam over 16-bit parameters writes a host copy.
    offload_copy = compute * shard if writes_16bit_copy(zero, optimizer_kind) else 0
    host = offloaded_activations + (compute * shard if offload_param else 0)
    if offload_optimizer:
        host += master + optimizer_state + offload_copy + (grads if zero.stage >= 2 else 0) + step_grad
    grads += step_grad

    unit_numels = [unit.numel for layout in layouts for unit in layout.units]
    gathered = full_grads = floor = 0
    prefetches = False
    if zero.stage == 3:
        root, blocks = _block_numels(plan, layouts)
        peak, prefetches = _peak_gathered(root, blocks, zero)
        gathered = compute * peak
        full_grads = compute * (root + max(blocks, default=0))
        floor = prefetch_floor(root, blocks)
    buckets = compute * _peak_buckets(unit_numels, zero, world_size) if zero.stage >= 2 else 0
    return RankMemoryPlan(
        world_size=world_size,
        stage=zero.stage,
        params=params,
        grads=grads,
        master=master,
        optimizer_state=optimizer_state,
        offload_copy=offload_copy,
        gathered=gathered,
        full_grads=full_grads,
        buckets=buckets,
        activations=activations + offloaded_activations,
        host=host,
        largest_unit=max(unit_numels),
        prefetch_floor=floor,
        prefetches=prefetches,
    )


def _persistent_numel(plan: ShardingPlan, layouts: list[FlatLayout]) -> int:
    """Stage 3: elements of the persistent units, which every rank holds whole besides its shard."""
    return sum(
        unit.numel
        for group, layout in zip(plan.groups, layouts, strict=True)
        for unit in layout.units
        if group.unit_blocks[unit.index] is None
    )


def _block_numels(plan: ShardingPlan, layouts: list[FlatLayout]) -> tuple[int, list[int]]:
    """Stage 3: the root block's gathered elements, and every other block's in forward order (the
    scheduler's `ordered`: blocks with units), as the scheduler sums them (padded units)."""
    numels = [0] * len(plan.blocks)
    for group, layout in zip(plan.groups, layouts, strict=True):
        for unit in layout.units:
            block = group.unit_blocks[unit.index]
            if block is not None:
                numels[block] += unit.numel
    root = numels[-1]
    return root, [n for n, block in zip(numels, plan.blocks, strict=True) if not block.is_root and n > 0]


def _peak_gathered(root: int, blocks: list[int], zero: ZeroConfig) -> tuple[int, bool]:
    """The most elements gathered at once over a forward then a backward, replaying the scheduler:
    each block gathered when it runs, prefetching along the way, released after its forward
    (`reshard_after_forward`) and after its backward. Also whether anything was prefetched."""
    gathered = [False] * len(blocks)
    peak, prefetched = root, False

    def run(position: int, step: int, release: bool) -> None:
        nonlocal peak, prefetched
        gathered[position] = True
        live = root + sum(n for n, g in zip(blocks, gathered, strict=True) if g)
        chosen = blocks_to_prefetch(
            blocks,
            gathered,
            position,
            step,
            live=live,
            budget=zero.prefetch_bucket_size,
            max_live=zero.max_live_parameters,
        )
        for index in chosen:
            gathered[index] = True
        prefetched = prefetched or bool(chosen)
        peak = max(peak, live + sum(blocks[i] for i in chosen))
        if release:
            gathered[position] = False

    for position in range(len(blocks)):
        run(position, 1, release=zero.reshard_after_forward)
    for position in reversed(range(len(blocks))):
        run(position, -1, release=True)
    return peak, prefetched


def _peak_buckets(unit_numels: list[int], zero: ZeroConfig, world_size: int) -> int:
    """Stages 2-3: the most bucket elements alive at once, with their reduce-scatter outputs, whatever
    order the units' gradients complete in (that follows autograd, not the layout). The reducer fills
    a new bucket while earlier ones are in flight, then completes the oldest until at most the cap
    remain, or one bucket: so before a new bucket of at most the largest unit L, at most max(cap, L)
    are in flight. Each bucket in flight also holds the output its reduce-scatter writes, this rank's
    piece of the unit (`reduced` in `GradientReducer._reduce`): numel / N elements, exactly, since a
    unit's numel is padded to a multiple of the N shards."""
    largest = max(unit_numels)
    cap = BUCKETS_IN_FLIGHT * zero.reduce_bucket_size
    buckets = min(sum(unit_numels), max(cap, largest) + largest)
    return buckets + buckets // world_size


def format_plans(plans: list[RankMemoryPlan], device_memory: int | None = None) -> str:
    """A plain-text table of plans, one per line, sizes in decimal GB (10^9 bytes)."""
    piped = any(plan.pipeline_parallel > 1 for plan in plans)  # then say which pipeline rank each is
    columns = ("ranks", *(("pipe rank",) if piped else ()), "params", "grads", "master", "optim")
    columns += ("gathered", "full grads", "buckets", "activ.", "device", "host", "prefetch")
    if device_memory:
        columns += (f"fits {device_memory / GB:.0f} GB",)
    rows = [columns]
    for plan in plans:
        states = (plan.params, plan.grads, plan.master, plan.optimizer_state)
        transients = (plan.gathered, plan.full_grads, plan.buckets, plan.activations)
        sizes = (*states, *transients, plan.device, plan.host)
        row = (str(plan.world_size),)
        row += (f"{plan.pipeline_rank}/{plan.pipeline_parallel}",) if piped else ()
        row += tuple(f"{size / GB:.2f}" for size in sizes)
        row += ("yes" if plan.prefetches else ("no" if plan.stage == 3 else "-"),)
        if device_memory:
            row += ("yes" if plan.device <= device_memory else "NO",)
        rows.append(row)
    widths = [max(len(row[k]) for row in rows) for k in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
