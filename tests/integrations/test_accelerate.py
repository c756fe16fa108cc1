"""ZeroAccelerator: the standard Accelerate loop, unchanged, trains like plain Accelerate (DDP)."""

from __future__ import annotations

import pytest
import torch

from tests.support.accelerate_cases import accelerate_loop
from tnlg import TNLGForCausalLM
from tnlg.accelerate import ZeroAccelerator, zero_config_from_environment
from tnlg.launch_settings import STAGE_VARIABLES
from tnlg.sharding import DeepSpeedConfig, ZeroConfig
from tnlg.tools.spawn import run_distributed


def _all(rank: int, world_size: int, directory: str) -> dict:
    runs = {"ddp": accelerate_loop(rank, world_size, None, save_to=f"{directory}/ddp")}
    for stage in (0, 1, 2, 3):
        runs[stage] = accelerate_loop(rank, world_size, stage, save_to=f"{directory}/stage{stage}")
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    return run_distributed(_all, 2, str(directory), timeout=600)[0], directory


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.slow
def test_losses_equal_plain_accelerate(runs, stage):
    results, _ = runs
    assert results[stage]["losses"] == pytest.approx(results["ddp"]["losses"], rel=1e-5)
    assert results[stage]["norms"] == pytest.approx(results["ddp"]["norms"], rel=1e-5)
    assert results[stage]["lrs"] == results["ddp"]["lrs"]  # the scheduler turned the engine's knob
    assert len(results["ddp"]["norms"]) == 4  # clipped once per optimizer step, not per micro-step


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_model_reloads_with_from_pretrained(runs, stage):
    results, directory = runs
    assert results[stage]["unwrapped"] == "TNLGForCausalLM"
    model = TNLGForCausalLM.from_pretrained(directory / f"stage{stage}")
    reference = TNLGForCausalLM.from_pretrained(directory / "ddp")  # what plain Accelerate trained
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=1e-5, rtol=0, msg=name)
    assert (directory / f"stage{stage}" / "model.safetensors.index.json").is_file()


def test_environment_selects_the_engine(monkeypatch, tmp_path):
    monkeypatch.delenv("TNLG_ZERO_CONFIG", raising=False)
    monkeypatch.delenv("TNLG_ZERO_STAGE", raising=False)
    assert zero_config_from_environment() is None
    monkeypatch.setenv("TNLG_ZERO_STAGE", "2")
    monkeypatch.setenv("TNLG_ZERO_GRADIENT_CLIPPING", "1.5")
    config = zero_config_from_environment("bf16")
    assert (config.stage, config.gradient_clipping, config.mixed_precision) == (2, 1.5, "bf16")
    monkeypatch.setenv("TNLG_ZERO_OFFLOAD_OPTIMIZER", "cpu")
    monkeypatch.setenv("TNLG_ZERO_OFFLOAD_PARAM", "CPU")
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        zero_config_from_environment()
    monkeypatch.setenv("TNLG_ZERO_STAGE", "3")
    config = zero_config_from_environment()
    assert (config.stage, config.offload_optimizer, config.offload_param) == (3, "cpu", "cpu")
    for name in (
        "TNLG_ZERO_OFFLOAD_OPTIMIZER",
        "TNLG_ZERO_OFFLOAD_PARAM",
        "TNLG_ZERO_STAGE",
        "TNLG_ZERO_GRADIENT_CLIPPING",
    ):
        monkeypatch.delenv(name)  # a JSON states them itself: beside it they are refused (below)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}')
    monkeypatch.setenv("TNLG_ZERO_CONFIG", str(tmp_path / "ds.json"))
    config = zero_config_from_environment("bf16")
    assert (config.stage, config.mixed_precision) == (3, "bf16")
    monkeypatch.setenv("TNLG_ZERO_CONFIG", "")
    monkeypatch.setenv("TNLG_ZERO_STAGE", "three")
    with pytest.raises(ValueError, match="TNLG_ZERO_STAGE"):
        zero_config_from_environment()


ZERO_VARIABLES = ("TNLG_ZERO_CONFIG", "TNLG_ZERO_STAGE", *STAGE_VARIABLES)


@pytest.mark.parametrize(
    ("variable", "value"),
    [("TNLG_ZERO_STAGE", "2"), ("TNLG_ZERO_CONFIG", "ds.json"), ("TNLG_ZERO_OFFLOAD_OPTIMIZER", "cpu")],
)
@pytest.mark.parametrize(
    "given", [ZeroConfig(stage=1), DeepSpeedConfig(ZeroConfig(stage=1))], ids=["zero", "ds"]
)
def test_a_zero_config_beside_the_environments_is_refused(monkeypatch, variable, value, given):
    # the variable would be ignored: the zero_config argument decides when it is given
    for name in ZERO_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}={value} is set, but ZeroAccelerator\(zero_config=\.\.\.\) "
                       rf"states the ZeRO engine's settings and the variable would be ignored: unset {variable},"):  # fmt: skip
        ZeroAccelerator(zero_config=given, cpu=True)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"TNLG_ZERO_CONFIG": "ds.json", "TNLG_ZERO_STAGE": "3"}, "TNLG_ZERO_CONFIG=ds.json gives the engine's "
         "settings whole, so TNLG_ZERO_STAGE would be ignored"),
        ({"TNLG_ZERO_OFFLOAD_OPTIMIZER": "cpu"}, "TNLG_ZERO_OFFLOAD_OPTIMIZER shape the engine TNLG_ZERO_STAGE "
         "selects, and it is not set"),
    ],
    ids=["stage-beside-json", "offload-without-stage"],
)  # fmt: skip
def test_a_launch_variable_the_others_would_leave_unread_is_refused(monkeypatch, variables, message):
    for name in ZERO_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        zero_config_from_environment()


def test_without_a_zero_config_it_is_a_plain_accelerator(monkeypatch):
    monkeypatch.delenv("TNLG_ZERO_CONFIG", raising=False)
    monkeypatch.delenv("TNLG_ZERO_STAGE", raising=False)
    accelerator = ZeroAccelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    prepared = accelerator.prepare(model)
    assert accelerator.zero_config is None and not accelerator.engines
    assert accelerator.unwrap_model(prepared) is model


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_save_state_and_load_state_continue_exactly(tmp_path, stage):
    from tests.support.accelerate_cases import save_and_load_state

    results = run_distributed(save_and_load_state, 2, stage, str(tmp_path / "state"))
    result = results[0]
    assert result["rest"] == pytest.approx(result["whole"][result["half"] :], rel=1e-6)
    # The layout of a run checkpoint: the engine in engine/, RNG per rank, the scheduler.
    assert result["files"] == ["engine", "rank-00000.json", "rank-00001.json", "scheduler.json"]
    # A missing state file fails on every rank, before the engine's load (where a lone rank would hang).
    assert all("rank-00001.json is missing" in r["missing"] for r in results), results
