"""A C++ kernel build stopped midway does not leave the next process waiting forever for torch's build
lock (see [Note: stale build locks] in sharding/kernels/build_lock.py): the next holder of tnlg's build
lock removes torch's when the build that left it has stopped, says so, and builds; when that build may
be running still (a holder on another node, a compiler still working there) it waits, saying which file
to remove if none is."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from tnlg.sharding.kernels import build, build_lock

_HERE = socket.gethostname()


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def _left_by(directory: Path, holder: str) -> None:
    """The build directory as a build of `holder` ("host pid") leaves it when it is killed midway."""
    directory.mkdir(parents=True)
    (directory / build_lock.BUILD_LOCK).write_text(holder + "\n")
    (directory / build_lock.TORCH_BATON).touch()


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """cpp_extension.load recorded instead of run (it would wait for the baton or compile)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **options: calls.append(options) or "module")
    return calls


def test_a_baton_left_by_a_stopped_build_on_this_host_is_removed(loads, caplog):
    directory = build_lock.build_directory("tnlg_probe")
    pid = _dead_pid()
    _left_by(directory, f"{_HERE} {pid}")
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__):
        assert build_lock.load_extension("tnlg_probe", sources=["probe.cpp"]) == "module"
    assert not (directory / build_lock.TORCH_BATON).exists()
    assert f"the build of tnlg_probe by process {pid} was stopped before it finished" in caplog.text
    assert loads == [
        {"name": "tnlg_probe", "build_directory": str(directory), "verbose": False, "sources": ["probe.cpp"]}
    ]
    assert (directory / build_lock.BUILD_LOCK).read_text() == f"{_HERE} {os.getpid()}\n"  # the holder now


def test_a_baton_of_a_holder_on_another_host_is_waited_for(loads, caplog):
    directory = build_lock.build_directory("tnlg_probe")
    _left_by(directory, "another-node 4242")  # flock may not reach across nodes: it may be building
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__):
        build_lock.load_extension("tnlg_probe", sources=["probe.cpp"])
    assert (directory / build_lock.TORCH_BATON).exists()
    assert "it was left by process 4242 on another-node, which may still be building" in caplog.text
    assert "If no process is building tnlg_probe, remove that file" in caplog.text
    assert len(loads) == 1  # torch's load, which waits for the baton


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs /proc to see processes' directories")
def test_a_baton_is_kept_while_a_process_still_works_in_the_directory(loads, caplog):
    directory = build_lock.build_directory("tnlg_probe")
    _left_by(directory, f"{_HERE} {_dead_pid()}")
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=directory)
    try:  # a compiler that outlived the builder killed alone
        with caplog.at_level(logging.WARNING, logger=build_lock.__name__):
            build_lock.load_extension("tnlg_probe", sources=["probe.cpp"])
    finally:
        compiler.kill()
        compiler.wait()
    assert (directory / build_lock.TORCH_BATON).exists()
    assert f"processes {compiler.pid} still work in that directory" in caplog.text


def test_the_caller_chooses_verbosity_not_the_directory(loads):
    build_lock.load_extension("tnlg_probe", sources=["probe.cpp"], verbose=True)
    assert loads[0]["verbose"] is True
    with pytest.raises(TypeError, match="do not pass build_directory"):
        build_lock.load_extension("tnlg_probe", sources=["probe.cpp"], build_directory="elsewhere")


_BUILD = (
    "import logging\n"
    "logging.basicConfig(level=logging.WARNING)\n"
    "from tnlg.sharding.kernels.build import cpu_extension\n"
    "kernel = cpu_extension('cpu_adam')\n"
    "print('built' if kernel is not None else 'unavailable')\n"
)


@pytest.mark.slow  # it compiles the CPU Adam kernel in a fresh cache (about a minute)
def test_a_real_build_after_a_killed_one_removes_its_baton_and_builds(tmp_path):
    missing = build.missing_cpu_tool()
    if missing is not None:
        pytest.skip(f"the CPUAdam C++ kernel cannot be built here: {missing}")
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    environment.pop("TNLG_KERNELS", None)
    find = "from tnlg.sharding.kernels.build_lock import build_directory as d; print(d('tnlg_cpu_adam'))"
    directory = subprocess.run(
        [sys.executable, "-c", find], env=environment, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert directory.startswith(str(tmp_path)), directory
    _left_by(Path(directory), f"{_HERE} {_dead_pid()}")
    done = subprocess.run(
        [sys.executable, "-c", _BUILD], env=environment, capture_output=True, text=True, timeout=600
    )  # without the removal, torch waits for that file forever: the timeout fails the test
    assert done.returncode == 0 and done.stdout.strip() == "built", done.stdout + done.stderr
    assert "was stopped before it finished" in done.stderr, done.stderr
    assert not (Path(directory) / build_lock.TORCH_BATON).exists()
    again = subprocess.run(
        [sys.executable, "-c", _BUILD], env=environment, capture_output=True, text=True, timeout=600
    )  # the next process loads the cached build, with nothing to remove
    assert again.returncode == 0 and again.stdout.strip() == "built", again.stdout + again.stderr
    assert "stopped before it finished" not in again.stderr and "waiting for" not in again.stderr, (
        again.stderr
    )
