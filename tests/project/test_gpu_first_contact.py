"""benchmarks/gpu_first_contact.py's --smoke mode: every row of the first GPU session's table at tiny
sizes on this machine, so that the script keeps working between the sessions that have a GPU; and a
comparison made wrong on purpose must fail the run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_first_contact import zero_settings
from tests.support import REPO
from tnlg.modeling import fused_ops


def _smoke(*flags: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.cuda.is_available():  # on a GPU the smoke run uses the compiled kernels
        environment.setdefault("TRITON_INTERPRET", "1")
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_first_contact", "--smoke", *flags],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _rows(stdout: str, check: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in stdout.splitlines()
        if line.startswith(f"| {check} |")
    ]


@pytest.mark.slow
@pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
def test_smoke_prints_every_row_and_passes():
    result = _smoke()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _rows(result.stdout, "offline editable install")[0][2] == "skipped"
    assert _rows(result.stdout, "gpu-marked tests")[0][2] == "ok"
    zero = _rows(result.stdout, "ZeRO vs fp32 reference")
    assert [row[1] for row in zero] == [str(setting) for setting in zero_settings()]
    assert len(zero) == 28  # stage 0: 2 precisions x no_sync; stages 1-3 also x optimizer offload
    assert _rows(result.stdout, "checkpoint round trip")[0][2] == "ok"
    for kernel in ("Triton LayerNorm", "Triton bias + GeLU", "chunked LM head + CE"):
        assert [row[1].split(",")[0] for row in _rows(result.stdout, f"fused {kernel}")] == [
            "hidden 4256",
            "hidden 20480",
        ]
    assert "(smoke)" in _rows(result.stdout, "fused Adam > 2^31 elements")[0][1]
    assert len(_rows(result.stdout, "training step")) == 2
    assert "ERROR" not in result.stdout and "MISMATCH" not in result.stdout


@pytest.mark.slow
def test_an_injected_mismatch_fails_the_run():
    result = _smoke("--rows", "zero", "--inject-mismatch")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    zero = _rows(result.stdout, "ZeRO vs fp32 reference")
    assert zero[0][2] == "MISMATCH" and all(row[2] == "ok" for row in zero[1:])
    assert "28 rows, 1 failed" in result.stdout


@pytest.mark.slow
def test_without_cuda_or_smoke_the_script_refuses():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full run would start")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_first_contact"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr


@pytest.mark.slow
def test_a_checkpoint_saved_by_two_ranks_resumes_on_one(tmp_path):
    """The reshape of docs/benchmarks.md's two-GPU plan, on 2 gloo processes: torchrun saves, one
    process resumes from the kept checkpoint and matches the two-rank uninterrupted run."""
    # On the CPU even on a GPU machine: two ranks on NCCL would need two GPUs.
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    flags = ["--smoke", "--rows", "checkpoint", "--checkpoint-dir", str(tmp_path)]
    script = ["-m", "benchmarks.gpu_first_contact", *flags]
    saved = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *script],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    assert "saved by 2 rank(s), resumed on 2" in saved.stdout
    resumed = subprocess.run(
        [sys.executable, *script], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    row = _rows(resumed.stdout, "checkpoint round trip")[0]
    assert "saved by 2 rank(s), resumed on 1" in row[1] and row[2] == "ok"
