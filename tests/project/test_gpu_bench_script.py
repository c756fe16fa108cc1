"""benchmarks/gpu_bench.py's --smoke mode: the whole script (reference checks, timings, the training
step) at tiny sizes, so that the GPU benchmark keeps running between the sessions that have a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support import REPO
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
