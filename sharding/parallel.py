"""The three dimensions a training job is laid out in: tensor slicing, pipeline stages, data parallelism.

[Note: parallel layout]
A world of W ranks is a (pipeline, data, tensor) grid, tensor innermost: the ranks of one tensor group are
consecutive (on one node, where tensor slicing's per-layer all-reduces belong), then the data replicas,
then the pipeline stages across nodes, as Megatron and DeepSpeed lay out MT-NLG (8-way tensor slicing
inside a node, 35 pipeline stages across nodes, data parallelism over the rest). Accelerate's own
`ParallelismConfig` mesh also keeps tensor innermost. The grid is a torch `DeviceMesh` whose dimensions
carry Accelerate's names ("pp", "dp_shard", "tp"; MESH_NAMES), so that Accelerate's data loaders, given
the mesh, hand the same batches to a tensor group and different ones to the data ranks; this module's
API names them "pipeline", "data" and "tensor".

The ZeRO engine shards over the data group only: every rank of a tensor group holds different slices
of the same parameters (or, for the parameters the plan leaves whole, the same values), and every
pipeline stage different layers, so the optimizer state of a slice is partitioned among the ranks
that hold that slice, which are its data group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .timeouts import adopt_world_timeout, world_timeout

if TYPE_CHECKING:
    from tnlg.modeling.tensor_parallel import TensorSlice

MESH_DIMENSIONS = ("pipeline", "data", "tensor")
MESH_NAMES = {"pipeline": "pp", "data": "dp_shard", "tensor": "tp"}  # Accelerate's (data_loader.py)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of tensor slicing and pipeline stages; the data-parallel degree is what is left of the
    world: `data = world_size // (tensor * pipeline)`. `data` may be given to check it."""

    tensor: int = 1
    pipeline: int = 1
    data: int | None = None
    # Stages per pipeline rank: 1 runs the 1F1B schedule, more the interleaved 1F1B schedule over
    # `pipeline * virtual_stages` stages (rank r holds stages r, r + pipeline, ...).
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be an integer >= 1, got {value!r}")
        if self.data is not None and (
            isinstance(self.data, bool) or not isinstance(self.data, int) or self.data < 1
        ):
            raise ValueError(f"ParallelDims.data must be an integer >= 1 or None, got {self.data!r}")
        if self.virtual_stages > 1 and self.pipeline == 1:
            raise ValueError(
                f"ParallelDims.virtual_stages={self.virtual_stages} needs pipeline stages: set "
                "ParallelDims.pipeline >= 2 as well, or leave virtual_stages at 1"
            )

    def resolve(self, world_size: int) -> ParallelDims:
        """These degrees for a world of `world_size` ranks, `data` filled in; raises ValueError naming the
        degrees that do not divide the world (and the data degree that would fit)."""
        cut = self.tensor * self.pipeline
        if world_size % cut:
            raise ValueError(
                f"tensor {self.tensor} x pipeline {self.pipeline} = {cut} does not divide the world of "
                f"{world_size} ranks"
            )
        data = world_size // cut
        if self.data is not None and self.data != data:
            raise ValueError(
                f"ParallelDims(data={self.data}) with tensor {self.tensor} x pipeline {self.pipeline} needs "
                f"{self.data * cut} ranks; the world has {world_size} (data would be {data})"
            )
        return ParallelDims(self.tensor, self.pipeline, data, self.virtual_stages)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(pipeline, data, tensor): the mesh's shape, in MESH_DIMENSIONS order (resolved dims only)."""
        if self.data is None:
            raise ValueError("resolve(world_size) first: the data degree is not known yet")
        return self.pipeline, self.data, self.tensor

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is cut into (`pipeline * virtual_stages`)."""
        return self.pipeline * self.virtual_stages

    def __str__(self) -> str:
        data = "?" if self.data is None else self.data
        virtual = f" ({self.virtual_stages} stages each)" if self.virtual_stages > 1 else ""
        return f"tensor {self.tensor} x pipeline {self.pipeline}{virtual} x data {data}"


@dataclass
class ParallelGroups:
    """This rank's place in the grid: the mesh, and the process group and rank along each dimension."""

    dims: ParallelDims
    mesh: DeviceMesh

    def group(self, dimension: str) -> dist.ProcessGroup:
        return self.mesh.get_group(MESH_NAMES[dimension])

    def rank(self, dimension: str) -> int:
        return self.mesh.get_local_rank(MESH_NAMES[dimension])

    @property
    def tensor(self) -> dist.ProcessGroup:
        return self.group("tensor")

    @property
    def data(self) -> dist.ProcessGroup:
        return self.group("data")

    @property
    def pipeline(self) -> dist.ProcessGroup:
        return self.group("pipeline")


def build_groups(dims: ParallelDims, device_type: str | None = None) -> ParallelGroups:
    """The mesh of `dims` over the initialised world (collective: every rank calls it alike).
    `device_type` defaults to "cuda" with a NCCL world, else "cpu"."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ParallelDims need torch.distributed initialised (torchrun / accelerate launch)")
    dims = dims.resolve(dist.get_world_size())
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    names = tuple(MESH_NAMES[d] for d in MESH_DIMENSIONS)
    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=names)
    timeout = world_timeout()  # [Note: group timeouts] in timeouts.py
    for name in names:
        adopt_world_timeout(mesh.get_group(name), timeout)
    return ParallelGroups(dims, mesh)


def parallel_groups(
    parallel: ParallelDims | ParallelGroups | None, process_group: dist.ProcessGroup | None
) -> ParallelGroups | None:
    """The engine's grid for `initialize(..., parallel=)` (the degrees, or a grid already built, e.g. by
    ZeroAccelerator, whose process groups are then shared), or None without one."""
    if parallel is None:
        return None
    if not isinstance(parallel, (ParallelDims, ParallelGroups)):
        raise ValueError(f"parallel must be a ParallelDims, got {type(parallel).__name__}")
    if process_group is not None:
        raise ValueError(
            "give parallel= or process_group=, not both: the data-parallel group comes from the dims"
        )
    return parallel if isinstance(parallel, ParallelGroups) else build_groups(parallel)


class PipelineSplit(Protocol):
    """What a model's `split_pipeline(stages, num_stages)` hook returns, as the engine reads it (the
    model's own type, e.g. tnlg.modeling.pipeline.PipelineSplit, need only have these)."""

    stages: Sequence[nn.Module]  # this rank's stage modules, in stage order: each takes the previous output
    stage_indices: Sequence[int]
    num_stages: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last stage's output, labels) -> loss
    shared: Mapping[str, Sequence[int]]  # {parameter name: the stages that each hold it} (a tied embedding)
    hidden_size: int  # what the stages send each other: (batch, length, hidden_size)
    max_positions: int  # the longest sequence they take
    vocab_size: int  # token ids and labels are in [0, vocab_size): checked before a schedule starts
    ignore_index: int | None  # the label of no loss (None: every label counts)


@dataclass
class ModelPlan:
    """What the model's declared plans made of it on this rank: its tensor slices by parameter name, and
    with pipeline stages the split (this rank's stage modules)."""

    tensor_slices: dict[str, TensorSlice]
    pipeline: PipelineSplit | None = None
    dropped: set[int] = field(default_factory=set)  # ids of the parameters other pipeline stages hold


def rank_stages(pipeline_rank: int, pipeline_degree: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank `pipeline_rank` holds: r, r + p, r + 2p, ... (`virtual_stages` of them),
    the looped placement of torch's interleaved schedules."""
    return [pipeline_rank + v * pipeline_degree for v in range(virtual_stages)]


def apply_model_plan(module: nn.Module, groups: ParallelGroups) -> ModelPlan:
    """Cut `module` for this rank: first down to its pipeline stages, then its tensor slices, following
    the plans the model declares (its `split_pipeline(stages, num_stages)` hook, `base_model_tp_plan`).
    A meta model is cut in shape: the engine initializes each parameter whole and keeps this rank's
    slice."""
    # The model declares its plans; cutting them is the model's, which knows its layouts.
    from tnlg.modeling.tensor_parallel import apply_tensor_parallel

    dims = groups.dims
    split, dropped = None, set()
    if dims.pipeline > 1:
        cut = getattr(module, "split_pipeline", None)
        if not callable(cut):
            raise ValueError(
                f"pipeline stages need a model that declares its split: {type(module).__name__} has no "
                "split_pipeline(stages, num_stages) method (TNLGForCausalLM has one)"
            )
        whole = {id(p) for p in module.parameters()}
        split = cut(rank_stages(groups.rank("pipeline"), dims.pipeline, dims.virtual_stages), dims.num_stages)
        dropped = whole - {id(p) for p in module.parameters()}
    slices = apply_tensor_parallel(module, groups.tensor) if dims.tensor > 1 else {}
    return ModelPlan(slices, split, dropped)


def shared_parameter_groups(
    groups: ParallelGroups, split: PipelineSplit, trainable: set[str]
) -> dict[str, dist.ProcessGroup]:
    """{parameter name: the process group of the pipeline ranks holding it} for this rank's trainable
    parameters that more than one pipeline rank holds (the tied embedding on the first and last stage,
    which never share a rank), one group per (data, tensor) coordinate. A frozen one needs no gradient
    sum. Collective: every rank creates every group, in the same order (`requires_grad` is alike on all)."""
    degree = groups.dims.pipeline
    ranks = groups.mesh.mesh.reshape(degree, -1)  # (pipeline, data x tensor): global ranks
    me = dist.get_rank()
    timeout = world_timeout()  # [Note: group timeouts] in timeouts.py
    result = {}
    for name, stages in sorted(split.shared.items()):
        if name not in trainable:
            continue
        holders = sorted({stage % degree for stage in stages})
        for column in range(ranks.shape[1]):
            members = [int(ranks[row, column]) for row in holders]
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                result[name] = group
    return result


def gather_tensor_slices(
    local: dict[str, torch.Tensor],
    slices: dict[str, TensorSlice],
    group: dist.ProcessGroup,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The whole tensors of the cut parameters (on the CPU), from every tensor rank's slice in `local`
    (by parameter name). Collective over the tensor group, one parameter at a time, in name order."""
    whole = {}
    for name in sorted(slices):
        piece = local[name].to(device).contiguous()
        pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, piece, group=group)
        whole[name] = slices[name].assemble([p.cpu() for p in pieces])
    return whole
