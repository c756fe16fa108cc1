"""Building the C++ kernels on first use, cached, and never leaving a user stuck on a build.

`torch.utils.cpp_extension.load` compiles a source once per machine and source version (it
caches by a hash of the sources and flags, here in a directory per extension, Python and torch build
under TORCH_EXTENSIONS_DIR; a build killed midway does not leave the next one waiting silently
forever: [Note: stale build locks] in build_lock.py) and imports the result. A
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
import warnings
from pathlib import Path
from types import ModuleType

from .build_lock import load_extension

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
