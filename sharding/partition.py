"""Flat buffers and the partition arithmetic.

[Note: flat layout]
One `FlatLayout` per optimizer param group. Its parameters are packed, in order, into *units*:
a unit is a run of consecutive parameters that is communicated as one collective (a gradient
bucket in stages 0-2; in stage 3 a block's parameters, cut the same way). Each unit is padded to a multiple of
`num_shards * alignment` elements and split into `num_shards` equal *pieces*; rank r owns piece r
of every unit. So, for a group:

    full buffer (all ranks' view):  | unit 0: piece 0 | piece 1 | unit 1: piece 0 | piece 1 | ...
    shard buffer of rank r:         | unit 0: piece r | unit 1: piece r | ...

A unit's full range is contiguous (parameters are views into it, and its pieces are what
all-gather / reduce-scatter exchange), and a rank's shard is contiguous (one fp32 master tensor
and one optimizer state per param group). Stage 0 uses `num_shards = 1`: every rank owns all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat buffers."""

    index: int  # position in the group's parameter list
    name: str
    shape: tuple[int, ...]
    numel: int
    unit: int
    offset: int  # element offset inside its unit


@dataclass(frozen=True)
class Unit:
    index: int
    slots: tuple[int, ...]  # parameter indices, in layout order
    full_offset: int  # start in the full buffer
    numel: int  # padded: a multiple of num_shards * alignment
    shard_offset: int  # start of this unit's piece in every rank's shard buffer
    piece: int  # numel // num_shards

    def piece_range(self, shard_rank: int) -> tuple[int, int]:
        """[start, end) of `shard_rank`'s piece, in unit coordinates."""
        return shard_rank * self.piece, (shard_rank + 1) * self.piece


class FlatLayout:
    """The layout of one param group: slots, units, full and shard sizes (see [Note: flat layout])."""

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        units: Sequence[Sequence[int]],
        num_shards: int,
        alignment: int = 1,
    ):
        if num_shards < 1 or alignment < 1:
            raise ValueError(f"num_shards and alignment must be >= 1, got {num_shards}, {alignment}")
        covered = sorted(i for unit in units for i in unit)
        if covered != list(range(len(names))):
            raise ValueError("units must cover every parameter exactly once")
        self.num_shards = num_shards
        self.alignment = alignment
        slots: dict[int, ParamSlot] = {}
        self.units: list[Unit] = []
        full_offset = 0
        quantum = num_shards * alignment
        for unit_index, members in enumerate(units):
            offset = 0
            for i in members:
                numel = math.prod(shapes[i])
                slots[i] = ParamSlot(i, names[i], tuple(shapes[i]), numel, unit_index, offset)
                offset += numel
            padded = max(quantum, math.ceil(offset / quantum) * quantum)
            self.units.append(
                Unit(
                    unit_index,
                    tuple(members),
                    full_offset,
                    padded,
                    full_offset // num_shards,
                    padded // num_shards,
                )
            )
            full_offset += padded
        self.slots = [slots[i] for i in range(len(names))]
        self.full_numel = full_offset
        self.shard_numel = full_offset // num_shards

    @property
    def numel(self) -> int:
        """Elements of real parameters (without padding)."""
        return sum(slot.numel for slot in self.slots)

    def owned_range(self, slot: ParamSlot, shard_rank: int) -> tuple[int, int, int] | None:
        """The part of a parameter `shard_rank` owns: (start, end) in the flattened parameter and
        the matching start in that rank's shard buffer; None if it owns none of it."""
        unit = self.units[slot.unit]
        piece_start, piece_end = unit.piece_range(shard_rank)
        start = max(slot.offset, piece_start)
        end = min(slot.offset + slot.numel, piece_end)
        if start >= end:
            return None
        return start - slot.offset, end - slot.offset, unit.shard_offset + (start - piece_start)

    def unit_view(self, full: torch.Tensor, unit: Unit) -> torch.Tensor:
        return full.narrow(0, unit.full_offset, unit.numel)

    def piece_view(self, full: torch.Tensor, unit: Unit, shard_rank: int) -> torch.Tensor:
        """This rank's piece of `unit`, as a view of the full buffer (for in-place collectives)."""
        return full.narrow(0, unit.full_offset + unit.piece * shard_rank, unit.piece)

    def shard_piece(self, shard: torch.Tensor, unit: Unit) -> torch.Tensor:
        return shard.narrow(0, unit.shard_offset, unit.piece)

    def param_view(self, unit_buffer: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """A parameter's full tensor as a view of its unit's buffer."""
        return unit_buffer.narrow(0, slot.offset, slot.numel).view(slot.shape)


def pack_units(numels: Sequence[int], bucket_size: int) -> list[list[int]]:
    """Consecutive indices grouped greedily into runs of at most `bucket_size` elements.

    A parameter larger than the bucket gets a unit of its own.
    """
    units: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, numel in enumerate(numels):
        if current and size + numel > bucket_size:
            units.append(current)
            current, size = [], 0
        current.append(index)
        size += numel
    if current:
        units.append(current)
    return units
