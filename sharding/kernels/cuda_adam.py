"""The CUDA fused Adam extension (csrc/fused_adam.cpp + csrc/fused_adam_kernel.cu), built once per process.

`torch.utils.cpp_extension.load` compiles it with nvcc once per machine and source version and
caches the result (a later process only loads it). Where it cannot be built (no CUDA, no nvcc or
ninja, a failed compile, `TNLG_KERNELS` set to `torch` or `triton`) `cuda_extension()` is None
after one warning, and `fused_adam` uses the Triton kernel instead; `require_cuda_extension()`
raises with the reason instead, for a caller that asked for this kernel by name. The engine builds
it when it is initialized (see `fused_adam.ready_backend`), so that a compile of a minute or a
failed one happens before training starts rather than inside the first step; the time is logged.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import warnings
from types import ModuleType

import torch

from .build import SOURCES, KernelUnavailable, ToolchainMissing, require_ninja
from .build_lock import load_extension

logger = logging.getLogger(__name__)

# -fmad=false: no fused multiply-adds: every operation rounds as the source writes it.
CUDA_FLAGS = ["-O3", "-fmad=false"]
KERNEL_SOURCE = SOURCES / "fused_adam_kernel.cu"
BINDING_SOURCE = SOURCES / "fused_adam.cpp"


@functools.cache
def cuda_extension() -> ModuleType | None:
    """The compiled extension, or None (warned once) where it cannot be built."""
    loaded = _load()
    if isinstance(loaded, KernelUnavailable):
        warnings.warn(
            f"tnlg: the CUDA fused Adam extension is unavailable ({loaded}); using the Triton kernel",
            stacklevel=3,
        )
        return None
    return loaded


def require_cuda_extension() -> ModuleType:
    """The compiled extension; a `KernelUnavailable` (a `ToolchainMissing` where a tool is absent)
    naming why where it cannot be built."""
    loaded = _load()
    if isinstance(loaded, KernelUnavailable):
        raise type(loaded)(f"the CUDA fused Adam extension is unavailable: {loaded}")
    return loaded


@functools.cache
def _load() -> ModuleType | KernelUnavailable:
    """The build's outcome, tried once per process: the module, or why there is none."""
    try:
        return _build()
    except KernelUnavailable as reason:
        return reason


def _build() -> ModuleType:
    choice = os.environ.get("TNLG_KERNELS", "").lower()
    if choice in ("torch", "triton"):
        raise KernelUnavailable(f"TNLG_KERNELS={choice}")
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA device")
    from torch.utils import cpp_extension

    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None
    if nvcc is None or not (os.path.exists(nvcc) or shutil.which("nvcc")):
        raise ToolchainMissing("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    require_ninja()
    started = time.perf_counter()
    try:
        module = load_extension(
            name="tnlg_fused_adam",
            sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=CUDA_FLAGS,
            extra_include_paths=[str(SOURCES)],
        )
    except Exception as error:  # a failed compile raises RuntimeError / subprocess errors / OSError
        last = str(error).strip().splitlines()[-1:] or ["unknown error"]
        raise KernelUnavailable(f"the build failed: {last[0]}") from error
    # A first build compiles for about a minute; a later process loads the cached build in a second.
    logger.info("the CUDA fused Adam extension is ready in %.1f s", time.perf_counter() - started)
    return module
