"""The main job for real: `accelerate launch` with 2 processes runs scripts/pretrain.py.

Its per-step losses are compared with a committed baseline (tests/assets), so a change that alters
the numerics of the model, the engine or the data pipeline shows up here; a run stopped at a
checkpoint and resumed continues with exactly the same losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tnlg import TNLGForCausalLM

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "tests" / "assets" / "pretrain_debug_losses.json"
STEPS = 8


def launch(output: Path, cache: Path, *overrides: str) -> list[float]:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(REPO / "scripts" / "pretrain.py"),
        "--train.max_steps",
        str(STEPS),
        "--train.eval_every",
        "4",
        "--train.save_every",
        "4",
        "--train.output_dir",
        str(output),
        *overrides,
    ]
    environment = {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((output / "loss_curve.json").read_text())["losses"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tnlg-cache")


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache):
    output = tmp_path_factory.mktemp("run")
    return output, launch(output, cache)


def test_losses_match_the_committed_baseline(run):
    _, losses = run
    baseline = json.loads(BASELINE.read_text())
    assert losses == pytest.approx(baseline["losses"], rel=1e-4)
    assert losses[-1] < losses[0]


def test_the_run_leaves_a_loadable_model_a_curve_and_checkpoints(run):
    output, _ = run
    model = TNLGForCausalLM.from_pretrained(output / "model")
    assert model.config.vocab_size == 2048
    assert (output / "model" / "tokenizer.json").is_file()
    assert (output / "loss_curve.png").stat().st_size > 1000
    assert json.loads((output / "checkpoints" / "latest").read_text()) == {"checkpoint": "step-00000008"}


def test_a_resumed_run_continues_with_the_same_losses(run, cache, tmp_path):
    _, losses = run
    launch(tmp_path, cache, "--train.max_steps", "4")
    resumed = launch(tmp_path, cache, "--resume", "latest")
    assert resumed == pytest.approx(losses[4:], rel=1e-6)
