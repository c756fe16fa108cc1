"""Where a model hands position ids on: Transformers' search for packed sequences (the mask's) and a block."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import transformers.masking_utils as masking
from torch import nn


@dataclass
class PositionsSeen:
    searched: list[torch.Tensor] = field(default_factory=list)  # what each packed-sequence search was given
    block_given: list[torch.Tensor | None] = field(default_factory=list)  # a block's position_ids, per call


def watch_positions(monkeypatch: pytest.MonkeyPatch, block: nn.Module) -> PositionsSeen:
    """Record the positions the mask searches for packed sequences and those `block` is called with."""
    seen = PositionsSeen()
    search = masking.find_packed_sequence_indices
    monkeypatch.setattr(
        masking,
        "find_packed_sequence_indices",
        lambda positions: seen.searched.append(positions) or search(positions),
    )
    block.register_forward_pre_hook(
        lambda module, args, kwargs: seen.block_given.append(kwargs.get("position_ids")), with_kwargs=True
    )
    return seen
