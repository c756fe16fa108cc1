"""Pretraining with `--parallel.tensor 2` and `--parallel.pipeline 2`: the run config's layout reaches the
engine, the data and the evaluation, and trains as data parallelism alone does on the same global batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.support import REPO
from tests.support.parallel_run_cases import (
    STEPS,
    debug_run_losses,
    pipeline_train_with_final_evaluation,
    poisoned_pipeline_run,
)
from tests.support.run_cases import DEBUG
from tnlg.modeling import TNLGForCausalLM
from tnlg.run.build import architecture
from tnlg.run.config import load_run_config
from tnlg.run.loop import pipeline_micro_batches
from tnlg.tools.spawn import run_distributed

# debug.yaml trains in fp32; its warmup (20 steps) is the whole run, so the learning rates do not depend on
# max_steps and the first steps of the committed 8-step baseline are these steps' reference.
FP32_STEPS = ["--train.max_steps", str(STEPS), "--train.eval_every", "0", "--train.eval_batches", "2"]
BASELINE = json.loads((REPO / "tests" / "assets" / "pretrain_debug_losses.json").read_text())


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def data_2(cache, tmp_path_factory) -> dict:
    """The baseline's layout: two data replicas of 8 sequences each."""
    output = str(tmp_path_factory.mktemp("data-2"))
    return run_distributed(debug_run_losses, 2, cache, output, FP32_STEPS, timeout=600)[0]


def assert_trains_like(result: dict, reference: dict) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert result["evaluation"] == pytest.approx(reference["evaluation"], rel=1e-5)
    assert sorted(result["state"]) == sorted(reference["state"])
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(result["state"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_tensor_2_x_data_2_trains_like_data_2(cache, data_2, tmp_path):
    sliced = run_distributed(
        debug_run_losses, 4, cache, str(tmp_path), [*FP32_STEPS, "--parallel.tensor", "2"], timeout=600
    )
    # The same two data replicas read the same batches; the tensor ranks of one replica share them.
    assert_trains_like(sliced[0], data_2)


@pytest.mark.slow
@pytest.mark.parametrize("virtual_stages", [1, 2])
def test_pipeline_2_x_data_2_trains_like_the_data_2_baseline(cache, data_2, tmp_path, virtual_stages):
    overrides = ["--parallel.pipeline", "2", "--parallel.virtual_stages", str(virtual_stages)]
    staged = run_distributed(
        debug_run_losses, 4, cache, str(tmp_path), [*FP32_STEPS, *overrides], timeout=600
    )
    # Each replica's batch of 8 is cut into 2 micro-batches of 4 for the 1F1B schedule: the same mean loss.
    assert staged[0]["losses"] == pytest.approx(BASELINE["losses"][:STEPS], rel=1e-5)
    assert_trains_like(staged[0], data_2)
    # train_batch's loss is the same on every rank: every stage takes the same non-finite-loss decision.
    assert all(result["losses"] == staged[0]["losses"] for result in staged)


@pytest.mark.slow
def test_tensor_2_x_pipeline_2_trains_like_one_process(cache, tmp_path):
    # Data 1: a global batch of 8 sequences, half the baseline's; the reference is one process on it.
    layout = ["--parallel.tensor", "2", "--parallel.pipeline", "2"]
    cut = run_distributed(
        debug_run_losses, 4, cache, str(tmp_path / "cut"), [*FP32_STEPS, *layout], timeout=600
    )
    whole = run_distributed(debug_run_losses, 1, cache, str(tmp_path / "whole"), FP32_STEPS, timeout=600)
    assert_trains_like(cut[0], whole[0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallel.pipeline", "2"], ["--parallel.tensor", "2"]])
def test_stages_and_slices_start_from_init_from_like_data_2(cache, tmp_path, layout):
    # Each stage reads its own layers (and the tied embedding) of the checkpoint, each tensor rank its
    # slices, through pretrained=: no rank loads the whole model.
    checkpoint = tmp_path / "checkpoint"
    torch.manual_seed(7)
    TNLGForCausalLM(architecture(load_run_config(DEBUG).model)).save_pretrained(checkpoint)
    steps = [*FP32_STEPS, "--model.init_from", str(checkpoint)]
    staged = run_distributed(
        debug_run_losses,
        4,
        cache,
        str(tmp_path / "staged"),
        [*steps, *layout],
        timeout=600,
    )
    plain = run_distributed(debug_run_losses, 2, cache, str(tmp_path / "plain"), steps, timeout=600)
    assert staged[0]["losses"] != pytest.approx(BASELINE["losses"][:STEPS], rel=1e-3)  # not the seeded start
    assert_trains_like(staged[0], plain[0])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_loss_under_pipeline_stages_follows_the_policy(cache, tmp_path, policy):
    overrides = [*FP32_STEPS, "--parallel.pipeline", "2", "--train.on_nonfinite_loss", policy]
    results = run_distributed(poisoned_pipeline_run, 4, cache, str(tmp_path), overrides, timeout=600)
    for result in results:  # every rank: the mean loss train_batch returns is the same on all of them
        if policy == "stop":
            assert f"step {STEPS}: the mean loss over the ranks is nan" in result["error"]
        else:
            assert math.isnan(result["losses"][-1]) and result["nonfinite_steps"] == 1
    if policy == "skip":  # train_batch stepped, but the non-finite gradient norm held the update back
        assert results[0]["unchanged"]


@pytest.mark.slow
def test_pipeline_run_skips_the_whole_model_evaluation_and_saves_the_whole_model(cache, tmp_path):
    results = run_distributed(pipeline_train_with_final_evaluation, 4, cache, str(tmp_path), timeout=600)
    for result in results:
        assert result["evaluation"] == {}
        assert [w for w in result["warnings"] if "pipeline stages split" in w] == [
            f"the evaluation {when} training runs the whole model, which pipeline stages split across ranks: "
            f"skipped (evaluate the saved model, {tmp_path / 'model'}, with scripts/evaluate.py)"
            for when in ("before", "after")
        ]
    # The consolidated model: every stage's layers and the tied embedding (lm_head's weight) in one file.
    saved = safetensors.torch.load_file(Path(results[0]["model"]) / "model.safetensors")
    whole = TNLGForCausalLM(architecture(load_run_config(DEBUG).model)).state_dict()
    assert sorted(saved) == sorted(name for name in whole if name != "lm_head.weight")


def rows(count: int, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    ids = torch.arange(count * 3).reshape(count, 3)
    return {"input_ids": ids, "labels": ids.clone(), **extra}


def test_pipeline_micro_batches_fill_the_pipeline():
    # One batch of 4 rows for 2 pipeline ranks: two micro-batches of 2 rows, in order.
    parts = pipeline_micro_batches([rows(4)], pipeline=2)
    assert [part["input_ids"][:, 0].tolist() for part in parts] == [[0, 3], [6, 9]]
    # As many batches as pipeline ranks: the batches as they are; an all-ones attention mask is dropped.
    whole = pipeline_micro_batches([rows(2, attention_mask=torch.ones(2, 3))] * 2, pipeline=2)
    assert len(whole) == 2 and sorted(whole[0]) == ["input_ids", "labels"]


def test_pipeline_micro_batches_name_what_cannot_be_cut():
    with pytest.raises(ValueError, match=r"pipeline 4 .* 1 batch\(es\) of 3 rows .* multiple of 4"):
        pipeline_micro_batches([rows(3)], pipeline=4)
    padded = torch.ones(2, 3)
    padded[1, 2] = 0
    with pytest.raises(ValueError, match=r"attention_mask .*masks 1 of 6 positions"):
        pipeline_micro_batches([rows(2, attention_mask=padded)], pipeline=2)
