"""benchmarks/host_overhead.py: each variant's backward is set against torch's of the same kind (eager
or compiled), and the benchmark runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.host_overhead import table_lines
from tests.support import REPO


def test_each_backward_is_set_against_torchs_of_the_same_kind():
    ms = 1e-3
    medians = {
        "torch": {"forward": 10 * ms, "backward": 8 * ms, "step": 5 * ms},
        "tnlg stage 0": {"forward": 10 * ms, "backward": 11 * ms, "step": 1 * ms},
        "torch compiled": {"forward": 6 * ms, "backward": 4 * ms, "step": 5 * ms},
        "tnlg stage 0 compiled": {"forward": 6 * ms, "backward": 6.5 * ms, "step": 1 * ms},
    }
    rows = table_lines(medians)[2:]
    assert rows == [
        "| torch | 10.00 | 8.00 | 5.00 | 23.00 | +0.00 ms |",
        "| tnlg stage 0 | 10.00 | 11.00 | 1.00 | 22.00 | +3.00 ms |",
        "| torch compiled | 6.00 | 4.00 | 5.00 | 15.00 | +0.00 ms |",
        "| tnlg stage 0 compiled | 6.00 | 6.50 | 1.00 | 13.50 | +2.50 ms |",
    ]


@pytest.mark.slow
def test_the_benchmark_runs_every_variant():
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_overhead", "--rounds", "1"],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [
        line.split(" | ")[0]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and line.endswith(" ms |")
    ]
    assert rows == [
        "| torch", "| tnlg stage 0", "| tnlg stage 3",
        "| torch compiled", "| tnlg stage 0 compiled", "| tnlg stage 3 compiled",
    ]  # fmt: skip


def test_rounds_must_be_positive():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_overhead", "--rounds", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--rounds must be at least 1, got 0" in result.stderr
