"""What an engine on one process does not spend: at world size 1 a gradient's mean over ranks is the
gradient itself, so no pass over a gradient buffer divides it by 1 (stage 0 did, one per unit: an H100
profile of tnlg-1.3b found three such passes a step, 0.58 ms each)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.zero_cases import SMALL
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize


class InPlaceScalings(TorchDispatchMode):
    """Every in-place multiply or divide of a tensor by a plain number run inside it: (op, elements, number)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("div_", "mul_") and len(args) == 2 and not isinstance(args[1], torch.Tensor):
            self.seen.append((name, args[0].numel(), args[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_process_divides_no_gradient_by_its_world_size(stage):
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": stage}))
    loss = engine(*local(batches(1)[0], 0, 1))
    with InPlaceScalings() as scalings:
        engine.backward(loss)
        engine.step()
    assert scalings.seen, "no in-place scaling seen at all: Adam's moment decays should be"
    assert [s for s in scalings.seen if s[2] == 1] == []
    engine.close()
