"""Building the C++ kernels on first use, cached, and never leaving a user stuck on a build.

`torch.utils.cpp_extension.load` compiles a source once per machine and source version (it
caches by a hash of the sources and flags, here in a directory per extension, Python and torch under
TORCH_EXTENSIONS_DIR; a build killed midway does not leave the next one waiting: [Note: stale build
locks]) and imports the result. A
machine without a compiler, or a build that fails, gives `None` with one warning naming the
reason; callers then fall back to torch's own kernels. `TNLG_KERNELS=torch` skips the build.
A missing tool (compiler, ninja, nvcc) is a `ToolchainMissing`, told apart from a failed compile so
that tests skip on a machine without the tools but fail on a build that breaks.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# -fno-math-errno: without it sqrt must set errno, which keeps the Adam loop from vectorising
# (3.5x slower). -ffp-contract=off: no fused multiply-adds, so that the rounding is torch's own.
# -march=native: the build is for this machine only (the cache is per machine).
CPU_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why."""


class ToolchainMissing(KernelUnavailable):
    """A tool the build needs is not installed (nothing was compiled)."""


# [Note: stale build locks]
# cpp_extension.load lets one process build while the others wait for its `lock` file in the build
# directory to go; a build killed midway (Ctrl-C, the OOM killer, a launcher stopping its ranks) leaves
# that file behind, and every later process then waits for it forever, printing nothing (DeepSpeed's
# JIT builds are known for the same hang). So tnlg builds each extension in a directory of its own and
# holds an flock on `tnlg-build.lock` there around the load: the kernel releases it when its holder
# dies, so a process that holds it knows that no other tnlg process is building, and a `lock` it finds
# is stale: it is removed, with a warning. Where flock is unavailable (no fcntl, a file system without
# locks) the load runs as torch's alone.
BUILD_LOCK = "tnlg-build.lock"
TORCH_BATON = "lock"  # the file cpp_extension.load's FileBaton creates while a process builds


def build_directory(name: str) -> Path:
    """Where extension `name` is built and cached: under TORCH_EXTENSIONS_DIR (else torch's default
    root), one directory per Python and torch build, so that a venv of another torch never waits for
    or reuses another's."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(root) / f"{name}-{python}-torch{torch.__version__}"


def load_extension(name: str, **options) -> ModuleType:
    """`cpp_extension.load(name=name, **options)` in `build_directory(name)`, under the build lock that a
    killed build does not leave held (see [Note: stale build locks])."""
    from torch.utils import cpp_extension

    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)

    def load() -> ModuleType:
        return cpp_extension.load(name=name, build_directory=str(directory), verbose=False, **options)

    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        return load()
    with open(directory / BUILD_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds; freed if it dies
        except OSError as error:  # a file system without locks
            logger.warning("cannot lock %s (%s): building under torch's lock alone", handle.name, error)
            return load()
        try:
            baton = directory / TORCH_BATON
            if baton.exists():
                logger.warning(
                    "removing %s: a build of %s was stopped before it finished (no tnlg process is building "
                    "it now), and torch would wait for that file forever",
                    baton, name,
                )  # fmt: skip
                baton.unlink(missing_ok=True)
            return load()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def require_ninja() -> None:
    """`cpp_extension.load` builds with ninja only: name its absence before a build is tried."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise ToolchainMissing("ninja is not installed (pip install ninja)")


def missing_cpu_tool() -> str | None:
    """Why no C++ kernel can be built here for want of a tool (compiler, ninja), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    try:
        require_ninja()
    except ToolchainMissing as missing:
        return str(missing)
    return None


@functools.cache
def cpu_extension(name: str) -> ModuleType | None:
    """The compiled `csrc/{name}.cpp`, or None (warned once) when it cannot be built here."""
    try:
        return _build_cpu(name)
    except KernelUnavailable as reason:
        warnings.warn(
            f"tnlg: the {name} C++ kernel is unavailable ({reason}); using torch's instead", stacklevel=3
        )
        return None


def _build_cpu(name: str) -> ModuleType:
    if os.environ.get("TNLG_KERNELS", "").lower() == "torch":
        raise KernelUnavailable("TNLG_KERNELS=torch")
    missing = missing_cpu_tool()
    if missing is not None:
        raise ToolchainMissing(missing)

    try:
        return load_extension(
            name=f"tnlg_{name}",
            sources=[str(SOURCES / f"{name}.cpp")],
            extra_cflags=CPU_FLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # a failed compile raises RuntimeError / subprocess errors / OSError
        last = str(error).strip().splitlines()[-1:] or ["unknown error"]
        raise KernelUnavailable(f"the build failed: {last[0]}") from error
