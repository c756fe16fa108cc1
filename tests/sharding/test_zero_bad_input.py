"""Bad inputs to the engine fail with a message naming the problem, on every rank, before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.zero_models import make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed


def test_optimizer_over_foreign_parameters():
    model = make_model()
    stranger = nn.Parameter(torch.zeros(3, 5))
    optimizer = torch.optim.AdamW([*[p for p in model.parameters() if p.requires_grad], stranger])
    with pytest.raises(ValueError, match=r"shape \[3, 5\] that is not in the model"):
        initialize(model, optimizer, ZeroConfig(stage=1))


def test_parameter_in_two_groups():
    model = make_model()
    weight = model.blocks[0].up.weight
    optimizer = make_optimizer(model)
    optimizer.param_groups[1]["params"].append(weight)  # torch checks this only in add_param_group
    with pytest.raises(ValueError, match=r"blocks\.0\.up\.weight appears in more than one"):
        initialize(model, optimizer, ZeroConfig(stage=2))


def test_trainable_parameters_missing_from_the_optimizer():
    model = make_model()
    optimizer = torch.optim.AdamW(model.blocks.parameters())
    with pytest.raises(ValueError, match=r"in no optimizer param group: \['unused', 'embed\.weight'"):
        initialize(model, optimizer, ZeroConfig(stage=3))


def test_parameters_on_several_devices():
    model = make_model()
    model.unused = nn.Parameter(torch.zeros(7, device="meta"))
    optimizer = make_optimizer(model)
    with pytest.raises(ValueError, match="several devices"):
        initialize(model, optimizer, ZeroConfig(stage=1))


def test_invalid_config_dict():
    model = make_model()
    with pytest.raises(ValueError, match="stage"):
        initialize(model, make_optimizer(model), {"zero_optimization": {"stage": 7}})


def _initialize_with_a_bad_optimizer(rank: int, world_size: int) -> str:
    model = make_model()
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    try:
        initialize(model, optimizer, ZeroConfig(stage=3))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_every_rank_raises_the_same_error_without_hanging():
    messages = run_distributed(_initialize_with_a_bad_optimizer, 2, timeout=120, collective_timeout=20)
    assert messages[0] == messages[1]
    assert "not in the model" in messages[0]


def test_stepping_the_original_optimizer_is_refused():
    model = make_model()
    optimizer = make_optimizer(model)
    engine = initialize(model, optimizer, ZeroConfig(stage=1))
    engine.backward(engine(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)))
    with pytest.raises(RuntimeError, match=r"call engine\.step\(\)"):
        optimizer.step()
    engine.step()  # the engine's own step still works


def test_fp16_backward_outside_the_engine_is_refused():
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(stage=2, mixed_precision="fp16"))
    loss = engine(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    loss.backward()
    with pytest.raises(RuntimeError, match=r"without engine\.backward"):
        engine.step()
