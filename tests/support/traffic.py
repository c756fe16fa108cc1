"""Bytes a step moves, counted where the engine, the tensor region and torch's pipeline schedule call into
torch.distributed: by kind and process group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def counted_traffic(names: dict[int, str]) -> Iterator[dict[str, int]]:
    """{"kind/group": bytes} of what runs inside: all-reduces and broadcasts at torch.distributed, the
    engine's all-gathers (output bytes) and reduce-scatters (input bytes), and point-to-point sends of
    the pipeline schedule (each message once, at its sender). `names` maps id(process group) to a name;
    any other group counts as "other"."""
    from tnlg.sharding import collectives

    counted: dict[str, int] = {}

    def count(kind: str, group, size: int) -> None:
        key = f"{kind}/{names.get(id(group), 'other')}"
        counted[key] = counted.get(key, 0) + size

    def counting(kind, original, size_of):
        def call(*args, **kwargs):
            count(kind, kwargs.get("group"), size_of(*args))
            return original(*args, **kwargs)

        return call

    def counting_sends(original):
        def call(ops, *args, **kwargs):
            for op in ops:
                if op.op is dist.isend:
                    count("send", op.group, _nbytes(op.tensor))
            return original(ops, *args, **kwargs)

        return call

    patches = [
        (dist, "all_reduce", counting("all_reduce", dist.all_reduce, lambda t, *r: _nbytes(t))),
        (dist, "broadcast", counting("broadcast", dist.broadcast, lambda t, *r: _nbytes(t))),
        (
            collectives,
            "_all_gather",
            counting("all_gather", collectives._all_gather, lambda o, *r: _nbytes(o)),
        ),
        (
            collectives,
            "_reduce_scatter",
            counting("reduce_scatter", collectives._reduce_scatter, lambda o, f, *r: _nbytes(f)),
        ),
        (schedules, "_batch_p2p", counting_sends(schedules._batch_p2p)),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, patched in patches:
        setattr(module, name, patched)
    try:
        yield counted
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def unit_sizes(engine) -> dict[str, int]:
    """Elements of this rank's units by kind (stage 3 blocks, the root block, persistent ones), all of
    them, and this rank's piece of the shared (tied) parameters."""
    units = {"block": 0, "root": 0, "persistent": 0, "full": 0, "shared_piece": 0}
    root_index = len(engine.scheduler.blocks) - 1 if engine.scheduler else None
    for group in engine.groups:
        units["full"] += group.layout.full_numel
        for unit in group.layout.units:
            block = group.unit_blocks[unit.index]
            kind = "persistent" if block is None else ("root" if block == root_index else "block")
            units[kind] += unit.numel
    for name in engine.pipeline.shared if engine.pipeline is not None else ():
        units["shared_piece"] += engine.parameter_unit(name)[1].piece
    return units
