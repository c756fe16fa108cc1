"""`load_state_dict` into an engine's module (or the engine) reaches the fp32 master at stages 0-2, so the
next step trains from what was loaded, as a torch model and optimizer do; stage 3, `assign=True` and the
swap-tensors mode are refused with nothing copied (see [Note: module loads])."""

from __future__ import annotations

import pytest
import torch

from tests.support.zero_cases import MODULE_LOAD_CASES, MODULE_LOAD_STEPS, load_midway, module_load_matrix
from tests.support.zero_models import batches, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(module_load_matrix, 2, timeout=400)[0]


def _reference(case: str, load: bool = True) -> dict:
    """One process, torch's AdamW on the global batches, the same load after the same steps (or none)."""
    model = make_model()
    optimizer = make_optimizer(model)
    losses = []
    for step, (input_ids, labels) in enumerate(batches(MODULE_LOAD_STEPS)):
        if load and step == MODULE_LOAD_STEPS // 2:
            load_midway(case, model)
        loss = model(input_ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


@pytest.mark.parametrize("case", list(MODULE_LOAD_CASES))
def test_a_load_midway_trains_on_from_the_loaded_weights(two_ranks, case):
    run, reference = two_ranks[case], _reference(case)
    half = MODULE_LOAD_STEPS // 2
    unloaded = _reference(case, load=False)["losses"]
    assert all(abs(a - b) > 1e-3 for a, b in zip(reference["losses"][half:], unloaded[half:], strict=True))
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert run["state"].keys() == reference["state"].keys()
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(run["state"][name].float(), tensor, atol=1e-5, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------- one process
def _engine(**config):
    model = make_model()
    return initialize(model, make_optimizer(model), ZeroConfig(**config))


def test_the_master_takes_the_values_given_not_their_16_bit_cast():
    engine = _engine(stage=1, mixed_precision="bf16")
    given = make_model(seed=5).state_dict()
    engine.module.load_state_dict(given)
    frozen = {name for name, param in engine.module.named_parameters() if not param.requires_grad}
    for name, tensor in engine.full_state_dict().items():
        if name in frozen:
            continue  # frozen weights are kept in the compute dtype, as the engine documents
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, given[name]), name  # bf16 would have rounded them
    assert engine.module.blocks[0].up.weight.dtype == torch.bfloat16  # the views: the cast


def test_what_torch_copies_before_a_strict_error_reaches_the_master_too():
    engine = _engine(stage=2)
    given = make_model(seed=5).state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        engine.module.load_state_dict({**given, "no.such.weight": torch.zeros(1)})
    for name, tensor in engine.full_state_dict().items():
        assert torch.equal(tensor, given[name]), name


@pytest.mark.parametrize(
    ("config", "load", "error"),
    [
        ({"stage": 3, "param_persistence_threshold": 0}, {}, "stage 3 engine's module"),
        ({"stage": 1}, {"assign": True}, r"assign=True"),
    ],
    ids=["stage3", "assign"],
)
def test_a_load_the_engine_cannot_honour_is_refused_with_nothing_copied(config, load, error):
    engine = _engine(**config)
    before = engine.full_state_dict()
    given = make_model(seed=5).state_dict()
    with pytest.raises(RuntimeError, match=error):
        engine.module.load_state_dict(given, **load)
    with pytest.raises(RuntimeError, match=error):
        engine.load_state_dict({f"module.{k}": v for k, v in given.items()}, **load)
    with pytest.raises(RuntimeError, match=error):
        engine.module.blocks[1].norm.load_state_dict(
            {"weight": torch.zeros(16), "bias": torch.zeros(16)}, **load
        )
    for name, tensor in engine.full_state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert torch.equal(engine.module.frozen.weight, make_model().frozen.weight)  # not loaded either
    module = engine.module
    engine.close()
    if config["stage"] == 3:  # released parameters stay without storage: still refused, not a crash
        with pytest.raises(RuntimeError, match=error):
            module.load_state_dict(given)


def test_the_swap_tensors_mode_is_refused_with_nothing_copied():
    engine = _engine(stage=0)
    before = engine.full_state_dict()
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="set_swap_module_params_on_conversion"):
            engine.module.load_state_dict(make_model(seed=5).state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    for name, tensor in engine.full_state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_frozen_submodule_loads_as_usual_and_closing_removes_the_hooks():
    engine = _engine(stage=1)
    frozen = {"weight": torch.ones(16, 16), "bias": torch.zeros(16)}
    engine.module.frozen.load_state_dict(frozen, assign=True)  # no engine parameter below it: torch's load
    assert torch.equal(engine.module.frozen.weight, torch.ones(16, 16))
    module = engine.module
    engine.close()
    module.load_state_dict(make_model(seed=5).state_dict(), assign=True)  # a plain module again
    assert torch.equal(module.embed.weight, make_model(seed=5).embed.weight)
