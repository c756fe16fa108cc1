"""The engine steps each param group as one flat 1-D shard: exact only for optimizers whose update is
element-wise. Any other optimizer is refused at initialize unless `allow_untested_optimizer` (DeepSpeed's
`zero_allow_untested_optimizer`) says to train it anyway."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.kernels import CPUAdam


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def _batch() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _train(engine, steps: int = 2) -> None:
    for _ in range(steps):
        engine.backward(engine(_batch()).pow(2).mean())
        engine.step()
        engine.zero_grad()


def _parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_adafactor_is_refused_with_the_class_the_reason_and_the_way_on():
    model = _model()
    before = _parameters(model)
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError) as error:
        initialize(model, optimizer, ZeroConfig(stage=1))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("torch.optim.Adafactor is not known to update each element on its own")
    assert "flat 1-D shard" in message
    assert "ZeroConfig(allow_untested_optimizer=True)" in message
    assert "zero_allow_untested_optimizer" in message
    # Refused before anything was sharded: the model and the optimizer are as they were.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())


def test_transformers_adafactor_the_trainers_optim_adafactor_is_refused():
    transformers_optimization = pytest.importorskip("transformers.optimization")
    model = _model()
    optimizer = transformers_optimization.Adafactor(
        model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False
    )
    with pytest.raises(ValueError, match=r"^transformers\.optimization\.Adafactor is not known"):
        initialize(model, optimizer, ZeroConfig(stage=0))


def test_a_subclass_is_not_taken_for_its_element_wise_base():
    class ClippedAdamW(torch.optim.AdamW):  # a step() that may look at whole tensors
        pass

    model = _model()
    with pytest.raises(ValueError, match=r"ClippedAdamW is not known to update each element on its own"):
        initialize(model, ClippedAdamW(model.parameters()), ZeroConfig(stage=0))


def test_adafactor_allowed_by_the_setting_trains():
    model = _model()
    before = _parameters(model)
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    engine = initialize(model, optimizer, ZeroConfig(stage=2, allow_untested_optimizer=True))
    _train(engine)
    after = [p.detach() for p in engine.module.parameters()]
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),  # Trainer's optim="adamw_torch_fused"
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    ],
    ids=["AdamW", "AdamW-fused", "Adam", "SGD", "RMSprop", "Adagrad"],
)
def test_element_wise_optimizers_are_accepted_and_train_as_unsharded(make):
    reference = _model()
    reference_optimizer = make(reference.parameters())
    for _ in range(2):
        reference(_batch()).pow(2).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    model = _model()
    engine = initialize(model, make(model.parameters()), ZeroConfig(stage=1))
    _train(engine)
    for expected, got in zip(reference.parameters(), engine.module.parameters(), strict=True):
        torch.testing.assert_close(got, expected)


def test_the_engines_own_cpu_adam_is_accepted():
    model = _model()  # not stepped: its C++ extension is built on first use (test_cpu_adam.py steps it)
    engine = initialize(model, CPUAdam(model.parameters(), lr=1e-2), ZeroConfig(stage=1))
    assert type(engine.base_optimizer) is CPUAdam


def test_the_setting_must_be_a_bool():
    with pytest.raises(ValueError, match=r"ZeroConfig.allow_untested_optimizer must be True or False"):
        ZeroConfig(allow_untested_optimizer="yes")


def _deepspeed(allow: bool) -> dict:
    return {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": allow}


def test_deepspeed_json_false_keeps_the_refusal():
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"Adafactor is not known to update each element on its own"):
        initialize(model, optimizer, _deepspeed(False))


def test_deepspeed_json_accepts_its_own_adam_sections():
    model = _model()
    config = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    _train(initialize(model, None, config))


def test_deepspeed_json_true_allows_and_trains():
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    engine = initialize(model, optimizer, _deepspeed(True))
    assert engine.config.allow_untested_optimizer is True
    _train(engine)
