"""A C++ kernel build stopped midway does not leave the next process waiting forever for torch's build
lock (see [Note: stale build locks] in sharding/kernels/build.py): the process that holds tnlg's build
lock removes it, says so, and builds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tnlg.sharding.kernels import build

pytestmark = pytest.mark.slow  # it compiles the CPU Adam kernel in a fresh cache (about a minute)

_BUILD = (
    "from tnlg.sharding.kernels.build import cpu_extension\n"
    "kernel = cpu_extension('cpu_adam')\n"
    "print('built' if kernel is not None else 'unavailable')\n"
)


def test_a_lock_left_by_a_killed_build_is_removed_and_the_kernel_builds(tmp_path):
    missing = build.missing_cpu_tool()
    if missing is not None:
        pytest.skip(f"the CPUAdam C++ kernel cannot be built here: {missing}")
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    environment.pop("TNLG_KERNELS", None)
    directory = subprocess.run(
        [sys.executable, "-c", "from tnlg.sharding.kernels.build import build_directory as d; print(d('tnlg_cpu_adam'))"],
        env=environment, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert directory.startswith(str(tmp_path)), directory
    os.makedirs(directory)
    open(os.path.join(directory, build.TORCH_BATON), "w").close()  # what a build killed midway leaves
    done = subprocess.run(
        [sys.executable, "-c", _BUILD], env=environment, capture_output=True, text=True, timeout=600
    )  # without the removal, torch waits for that file forever: the timeout fails the test
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "built", done.stdout + done.stderr
    assert "a build of tnlg_cpu_adam was stopped before it finished" in done.stderr, done.stderr
    assert not os.path.exists(os.path.join(directory, build.TORCH_BATON))
    again = subprocess.run(
        [sys.executable, "-c", _BUILD], env=environment, capture_output=True, text=True, timeout=600
    )  # the next process loads the cached build, with nothing to remove
    assert again.stdout.strip() == "built" and "stopped before it finished" not in again.stderr, again.stderr
