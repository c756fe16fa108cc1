"""An inference-only engine (`initialize(model, None, config)`): sharded parameters, nothing to train."""

from __future__ import annotations

import pytest
import torch

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize, meta_from_pretrained
from tnlg.tools.spawn import run_distributed

IDS = torch.arange(24).reshape(2, 12) * 7 % 512


def _inference_engine(rank: int, world_size: int, path: str, stage: int, frozen: bool) -> dict:
    model = meta_from_pretrained(TNLGForCausalLM, path)
    if frozen:  # a frozen model is still sharded: without training there is no reason to keep it whole
        model.requires_grad_(False)
    engine = initialize(model, None, ZeroConfig(stage=stage, param_persistence_threshold=1_000))
    engine.eval()
    logits = engine(input_ids=IDS).logits  # gradients enabled: the engine itself turns them off
    refused = {}
    for name, call in {
        "backward": lambda: engine.backward(logits.sum()),
        "step": engine.step,
        "save_checkpoint": lambda: engine.save_checkpoint(f"{path}/never"),
        "no_sync": lambda: engine.no_sync().__enter__(),
    }.items():
        try:
            call()
        except RuntimeError as error:
            refused[name] = str(error)
    return {
        "logits": logits,
        "has_graph": logits.grad_fn is not None,
        "live_after_forward": engine.scheduler.live_numel() if engine.scheduler else 0,
        "memory": engine.memory_stats(),
        "gathers": engine.comm_stats().get("all_gather", {}).get("calls", 0),
        "refused": refused,
        "state": engine.full_state_dict(),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug")).eval()
    path = tmp_path_factory.mktemp("debug-model")
    model.save_pretrained(path)
    return str(path), model


def _every_case(rank: int, world_size: int, path: str) -> dict:
    return {
        (stage, frozen): _inference_engine(rank, world_size, path, stage, frozen)
        for stage, frozen in ((0, False), (3, False), (3, True))
    }


@pytest.fixture(scope="module")
def runs(checkpoint):
    return run_distributed(_every_case, 2, checkpoint[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", [(0, False), (3, False), (3, True)])
def test_inference_engine_computes_the_unsharded_logits_without_gradients(checkpoint, runs, case):
    _, model = checkpoint
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    for rank in runs:
        result = rank[case]
        torch.testing.assert_close(result["logits"], expected, atol=1e-5, rtol=1e-5)
        assert not result["has_graph"]
        assert result["memory"]["grads"] == 0 and result["memory"]["optimizer_state"] == 0
    state = runs[0][case]["state"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True])
def test_stage_3_inference_engine_holds_a_shard_and_releases_after_forward(checkpoint, runs, frozen):
    _, model = checkpoint
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    for rank in runs:
        result = rank[(3, frozen)]
        assert result["memory"]["params"] < 0.6 * full_bytes  # about half, plus the small persistent ones
        assert result["gathers"] > 0
        assert result["live_after_forward"] == 0  # a grad-enabled forward kept nothing gathered


@pytest.mark.slow
def test_training_calls_raise_naming_inference_only(runs):
    for rank in runs:
        for case in rank.values():
            assert set(case["refused"]) == {"backward", "step", "save_checkpoint", "no_sync"}
            assert all("inference only" in message for message in case["refused"].values())


def test_single_process_inference_engine_matches_the_plain_model():
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug")).eval()
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    engine = initialize(model, None, ZeroConfig(stage=3, param_persistence_threshold=0))
    assert engine.inference_only and engine.get_global_grad_norm() is None and not engine.step_was_skipped
    torch.testing.assert_close(engine(input_ids=IDS).logits, expected)
    with pytest.raises(RuntimeError, match="inference only"):
        engine.clip_grad_norm_(1.0)
