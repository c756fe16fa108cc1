"""What gets sharded, grouped how: validation of the inputs and the unit plan of every param group.

Everything here is decided from the model, the optimizer and the config alone, identically on
every rank, before any collective runs: a bad input raises on all ranks together.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import ZeroConfig
from .partition import pack_units


@dataclass
class BlockPlan:
    """Stage 3: a module whose parameters are gathered together around its forward and backward."""

    name: str
    module: nn.Module
    is_root: bool = False


@dataclass
class GroupPlan:
    """One optimizer param group: its trainable parameters and how they are cut into units."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    units: list[list[int]] = field(default_factory=list)  # parameter indices per unit
    unit_blocks: list[int | None] = field(default_factory=list)  # stage 3: the block a unit belongs to
    # (None = a persistent unit: small parameters kept whole on every rank)


@dataclass
class ShardingPlan:
    groups: list[GroupPlan]
    blocks: list[BlockPlan]
    device: torch.device


def plan_sharding(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ZeroConfig,
    own_units: Collection[str] = (),
) -> ShardingPlan:
    """Validate the inputs and plan the units; raises ValueError naming the problem.

    Without an optimizer (an inference-only engine) every parameter is sharded, in one group:
    frozen ones too, since an inference model is usually frozen and sharding it is the point.
    The parameters named in `own_units` get a unit each, alone, so that their pieces are cut alike
    on every rank that holds them whatever else it holds (a tied embedding on two pipeline stages)."""
    named = list(module.named_parameters())  # tied parameters appear once, under their first name
    if not named:
        raise ValueError("the model has no parameters")
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are on several devices ({', '.join(devices)}); move it to one"
        )
    names = {id(p): name for name, p in named}
    order = {id(p): i for i, (_, p) in enumerate(named)}

    param_groups = optimizer.param_groups if optimizer is not None else [{"params": [p for _, p in named]}]
    groups: list[GroupPlan] = []
    seen: set[int] = set()
    for index, group in enumerate(param_groups):
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {index} holds a parameter of shape {list(p.shape)} that is not in the "
                    "model; build the optimizer over model.parameters()"
                )
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]} appears in more than one optimizer param group")
            seen.add(id(p))
            if p.requires_grad or optimizer is None:  # frozen ones stay whole when training, as with DDP
                params.append(p)
        params.sort(key=lambda p: order[id(p)])
        groups.append(GroupPlan(index, params, [names[id(p)] for p in params]))
    orphans = [name for name, p in named if p.requires_grad and id(p) not in seen]
    if orphans:
        raise ValueError(
            f"parameters that require grad are in no optimizer param group: {orphans}; add them to the "
            "optimizer or set requires_grad=False"
        )

    blocks = find_blocks(module) if config.partitions_parameters else []
    if config.partitions_parameters:
        _plan_stage3_units(groups, blocks, config)
    else:
        for group in groups:
            group.units = pack_units([p.numel() for p in group.params], config.reduce_bucket_size)
            group.unit_blocks = [None] * len(group.units)
    _isolate_units(groups, set(own_units), set(names.values()))
    return ShardingPlan(groups, blocks, named[0][1].device)


def _isolate_units(groups: list[GroupPlan], alone: set[str], names: set[str]) -> None:
    """Take the parameters named in `alone` out of their units into a unit each (same block); the rest
    of such a unit splits around them, so every unit stays a run of the parameter order."""
    if alone - names:
        raise ValueError(f"own_units names parameters the model does not have: {sorted(alone - names)}")
    for group in groups:
        units, blocks = [], []
        for members, block in zip(group.units, group.unit_blocks, strict=True):
            run: list[int] = []
            for i in members:
                if group.names[i] in alone:
                    units += [run, [i]] if run else [[i]]
                    blocks += [block, block] if run else [block]
                    run = []
                else:
                    run.append(i)
            if run:
                units.append(run)
                blocks.append(block)
        group.units, group.unit_blocks = units, blocks


def declared_block_classes(module: nn.Module) -> set[str]:
    """The class names `module` and its submodules declare in `_no_split_modules` (Transformers' way)."""
    return {name for m in module.modules() for name in (getattr(m, "_no_split_modules", None) or [])}


def find_blocks(module: nn.Module) -> list[BlockPlan]:
    """The gather blocks: `_no_split_modules` instances (outermost), else the model's children.

    `_no_split_modules` is collected from every submodule, as Transformers does, so that a wrapper
    around a Transformers model keeps its blocks. Without any, the children with parameters are
    blocks, looking inside `ModuleList` / `ModuleDict` containers (which are never called themselves,
    so hooks on them would never fire). Parameters outside every block belong to the root block (the
    model itself), gathered for the whole step: typically the embeddings and the output layer.
    """
    no_split = declared_block_classes(module)
    blocks: list[BlockPlan] = []
    if no_split:
        taken: list[str] = []
        for name, child in module.named_modules():
            if type(child).__name__ in no_split and name and not any(name.startswith(t + ".") for t in taken):
                blocks.append(BlockPlan(name, child))
                taken.append(name)
    else:
        blocks = list(_child_blocks(module, prefix=""))
    blocks.append(BlockPlan("", module, is_root=True))
    return blocks


def _child_blocks(module: nn.Module, prefix: str):
    for name, child in module.named_children():
        if next(child.parameters(), None) is None:
            continue
        qualified = f"{prefix}{name}"
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _child_blocks(child, prefix=f"{qualified}.")
        else:
            yield BlockPlan(qualified, child)


def _plan_stage3_units(groups: list[GroupPlan], blocks: list[BlockPlan], config: ZeroConfig) -> None:
    # A parameter used by two blocks (e.g. an embedding tied to an output layer in another block)
    # belongs to the root block, which stays gathered for the whole step.
    root = len(blocks) - 1
    owner: dict[int, int] = {}
    for block_index, block in enumerate(blocks[:-1]):
        for p in block.module.parameters():
            owner[id(p)] = block_index if owner.get(id(p), block_index) == block_index else root
    for p in blocks[-1].module.parameters():
        owner.setdefault(id(p), root)
    for group in groups:
        persistent = [
            i for i, p in enumerate(group.params) if p.numel() <= config.param_persistence_threshold
        ]
        by_block: dict[int, list[int]] = {}
        for i, p in enumerate(group.params):
            if p.numel() > config.param_persistence_threshold:
                by_block.setdefault(owner[id(p)], []).append(i)
        # A block's parameters are cut into units of at most `reduce_bucket_size` elements (one larger
        # parameter alone): a unit is what one all-gather fills and one reduce-scatter empties, so
        # this bounds the communication buffers (at 530B a whole layer is 5e9 elements, 10 GB in bf16).
        units = [
            ([members[j] for j in run], block)
            for block, members in by_block.items()
            for run in pack_units([group.params[i].numel() for i in members], config.reduce_bucket_size)
        ]
        packed = pack_units([group.params[i].numel() for i in persistent], config.reduce_bucket_size)
        units += [([persistent[j] for j in run], None) for run in packed]
        units.sort(key=lambda unit: unit[0][0])  # layout follows the model's parameter order
        group.units = [members for members, _ in units]
        group.unit_blocks = [block for _, block in units]
