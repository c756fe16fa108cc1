"""benchmarks/gpu_bench.py's --smoke mode: the whole script (reference checks, timings, the training
step) at tiny sizes, so that the GPU benchmark keeps running between the sessions that have a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_bench
from tests.support import REPO
from tnlg import TNLGConfig
from tnlg.modeling import fused_ops


@pytest.mark.slow
@pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
def test_gpu_bench_smoke_runs_every_section():
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    if (
        not torch.cuda.is_available()
    ):  # on a GPU the smoke run uses the compiled kernels, as the full one does
        environment.setdefault("TRITON_INTERPRET", "1")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_bench", "--smoke"],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for heading in ("### Fused Adam", "### Model kernels", "### Training step"):
        assert heading in result.stdout
    assert "tnlg Triton fused Adam" in result.stdout and "tnlg chunked LM head" in result.stdout


@pytest.mark.slow
def test_gpu_bench_refuses_a_cpu_without_smoke():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full benchmark would run")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_bench"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "needs a CUDA device" in result.stderr


class _SpreadLogits:
    """TNLGConfig as gpu_bench's training step sees it, with the debug preset's logits spread as
    tnlg-1.3b's are at its init (std 1 / sqrt(hidden 64)): at the preset's 0.02 they are nearly flat,
    and no first-step loss would tell one model from another."""

    @staticmethod
    def from_preset(preset: str, **overrides):
        return TNLGConfig.from_preset(preset, **{**overrides, "initializer_range": 0.125})


def _recorded_builds(monkeypatch, other_seed_for_row: int | None = None) -> list[dict]:
    """Record what each training row's engine is built with; `other_seed_for_row`: that row's weights
    come from another seed (a step that computes another model)."""
    builds: list[dict] = []
    real = gpu_bench.initialize

    def initialize(model, optimizer, zero, **kwargs):
        if len(builds) == other_seed_for_row:
            kwargs["init_seed"] = 1
        builds.append({"kernels": model.config.fused_kernels, "zero": zero, "optimizer": type(optimizer)})
        return real(model, optimizer, zero, **kwargs)

    monkeypatch.setattr(gpu_bench, "initialize", initialize)
    monkeypatch.setattr(gpu_bench, "TNLGConfig", _SpreadLogits)
    return builds


def test_the_training_rows_differ_in_the_model_kernels_alone(monkeypatch):
    # On the CPU without Triton's interpreter "auto" runs the reference kernels: this checks what the
    # rows are built with (the smoke run above checks the Triton ones), timing two tiny steps.
    builds = _recorded_builds(monkeypatch)
    lines = gpu_bench.bench_training("debug", 2, 32, torch.device("cpu"), steps=1)
    assert [build["kernels"] for build in builds] == ["none", "auto"]
    assert builds[0]["zero"] == builds[1]["zero"], "the rows' engines differ in more than the kernels"
    assert builds[0]["optimizer"] is builds[1]["optimizer"]
    assert any(line.startswith("gate passed") for line in lines)


def test_a_fused_step_computing_another_model_is_not_timed(monkeypatch):
    _recorded_builds(monkeypatch, other_seed_for_row=1)  # the fused row starts from other weights
    timed_rows: list[object] = []
    real_timed = gpu_bench.timed

    def timed(run, device, repeats, warmup=3):
        timed_rows.append(run)
        return real_timed(run, device, repeats, warmup)

    monkeypatch.setattr(gpu_bench, "timed", timed)
    with pytest.raises(SystemExit, match="first-step loss"):
        gpu_bench.bench_training("debug", 2, 32, torch.device("cpu"), steps=1)
    assert len(timed_rows) == 1  # the torch row only
