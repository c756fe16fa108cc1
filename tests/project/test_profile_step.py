"""benchmarks/profile_step.py: the step report's arithmetic (busy time as a union of kernel intervals,
kernels ranked by total time, the longest gaps, the idle time the host caused) and the --smoke run end
to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import side_by_side
from benchmarks.profile_step import (
    HostWait,
    Kernel,
    busy_microseconds,
    host_wait,
    host_wait_line,
    report_lines,
)
from tests.support import REPO
from tnlg.modeling import fused_ops


def test_busy_time_counts_overlapping_kernels_once():
    kernels = [Kernel("a", 0, 10), Kernel("b", 5, 12), Kernel("c", 20, 25), Kernel("d", 21, 22)]
    assert busy_microseconds(kernels) == 17  # [0, 12] and [20, 25]


def test_report_ranks_kernels_by_total_time_and_gaps_by_length():
    kernels = [
        Kernel("gemm", 0, 400), Kernel("norm", 450, 460), Kernel("gemm", 1460, 1860),
        Kernel("norm", 1870, 1880), Kernel("adam", 1900, 2000),
    ]  # fmt: skip
    lines = report_lines(kernels, wall_us=2000)
    assert lines[0] == ("step wall 2.0 ms; kernels running 0.9 ms (46.0%), device idle 1.1 ms; 5 kernels")
    ranked = [line for line in lines if line.startswith("| ") and " | calls " not in line]
    assert ranked[0] == "| gemm | 2 | 0.80 | 40.0% |"
    assert ranked[1] == "| adam | 1 | 0.10 | 5.0% |"
    assert ranked[2] == "| norm | 2 | 0.02 | 1.0% |"
    gaps = lines[lines.index("| gap ms | after | before |") + 2 :]
    assert gaps[0] == "| 1.00 | norm | gemm |"  # the longest: 460 -> 1460
    assert gaps[1] == "| 0.05 | gemm | norm |"


def activity(correlation: int, start: float, end: float, category: str = "kernel") -> dict:
    return {"cat": category, "ts": start, "dur": end - start, "args": {"correlation": correlation}}


def launch(correlation: int, at: float, category: str = "cuda_runtime") -> dict:
    return {"cat": category, "ts": at, "dur": 1.0, "args": {"correlation": correlation}}


def test_host_wait_counts_the_gaps_whose_kernel_was_launched_after_the_device_ran_dry():
    events = [
        launch(1, 0), activity(1, 2, 10),
        launch(2, 4), activity(2, 12, 20),  # queued while 1 ran: a gap of 2, the device's own
        launch(3, 25, "cuda_driver"), activity(3, 30, 40),  # launched after 2 ended: 10 waiting for the host
        launch(4, 26), activity(4, 35, 45, "gpu_memset"),  # overlaps 3 (another stream): no gap
        launch(5, 44), activity(5, 50, 51, "gpu_memcpy"),  # launched before 4 ended: the device's own
        {"cat": "cpu_op", "ts": 60, "dur": 5, "args": {}},  # host work: not the device's
        activity(6, 70, 71),  # no launch call recorded: not attributed to the host
    ]  # fmt: skip
    assert host_wait(events) == HostWait(idle_us=2 + 10 + 5 + 19, waiting_us=10, gaps=1)
    assert host_wait_line(HostWait(2000.0, 1500.0, 3)) == (
        "device idle between its first and last kernel 2.0 ms, of which at least 1.5 ms (75%) waiting for the host "
        "to launch the next kernel (3 gaps)"
    )


def test_report_says_when_there_is_nothing_to_attribute():
    assert report_lines([], wall_us=1000) == [
        "no device kernels recorded (no CUDA device): nothing to attribute"
    ]


def test_the_fused_choice_reaches_the_tnlg_variants():
    settings = side_by_side.Settings.create(True, torch.device("cpu"), None, False, fused_kernels="triton")
    assert settings.config().fused_kernels == "triton"
    assert settings.config(fused_kernels="none").fused_kernels == "none"  # the gate's reference


@pytest.mark.slow
@pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
def test_smoke_run_profiles_one_step(tmp_path):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path)}
    if not torch.cuda.is_available():
        environment.setdefault("TRITON_INTERPRET", "1")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_step", "--smoke", "--stage", "3", "--compile", "on"],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tnlg stage 3, debug, micro-batch 2 x 32" in result.stdout
    assert "compile on" in result.stdout and "0 during the profiled step" in result.stdout
    trace = tmp_path / "step_trace_stage3_ckpt-on_fused-auto_compile-on.json.gz"
    assert trace.stat().st_size > 0
