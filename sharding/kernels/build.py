"""Building the C++ kernels on first use, cached, and never leaving a user stuck on a build.

`torch.utils.cpp_extension.load` compiles a source once per machine and source version (it
caches by a hash of the sources and flags under TORCH_EXTENSIONS_DIR) and imports the result. A
machine without a compiler, or a build that fails, gives `None` with one warning naming the
reason; callers then fall back to torch's own kernels. `TNLG_KERNELS=torch` skips the build.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
# -fno-math-errno: without it sqrt must set errno, which keeps the Adam loop from vectorising
# (3.5x slower). -ffp-contract=off: no fused multiply-adds, so that the rounding is torch's own.
# -march=native: the build is for this machine only (the cache is per machine).
CPU_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]


class KernelUnavailable(RuntimeError):
    pass


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
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}) on PATH")
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name=f"tnlg_{name}",
            sources=[str(SOURCES / f"{name}.cpp")],
            extra_cflags=CPU_FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a failed compile raises RuntimeError / subprocess errors / OSError
        last = str(error).strip().splitlines()[-1:] or ["unknown error"]
        raise KernelUnavailable(f"the build failed: {last[0]}") from error
