"""The CUDA fused Adam extension (csrc/fused_adam.cpp + csrc/fused_adam_kernel.cu), built on first use.

`torch.utils.cpp_extension.load` compiles it with nvcc once per machine and source version and
caches the result. Where it cannot be built (no CUDA, no nvcc, a failed compile, `TNLG_KERNELS`
set to `torch` or `triton`) `cuda_extension()` is None after one warning, and `fused_adam` uses the
Triton kernel instead.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from types import ModuleType

import torch

from .build import SOURCES, KernelUnavailable

# -fmad=false: no fused multiply-adds: every operation rounds as the source writes it.
CUDA_FLAGS = ["-O3", "-fmad=false"]
KERNEL_SOURCE = SOURCES / "fused_adam_kernel.cu"
BINDING_SOURCE = SOURCES / "fused_adam.cpp"


@functools.cache
def cuda_extension() -> ModuleType | None:
    """The compiled extension, or None (warned once) where it cannot be built."""
    try:
        return _build()
    except KernelUnavailable as reason:
        warnings.warn(
            f"tnlg: the CUDA fused Adam extension is unavailable ({reason}); using the Triton kernel",
            stacklevel=3,
        )
        return None


def _build() -> ModuleType:
    choice = os.environ.get("TNLG_KERNELS", "").lower()
    if choice in ("torch", "triton"):
        raise KernelUnavailable(f"TNLG_KERNELS={choice}")
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA device")
    from torch.utils import cpp_extension

    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None
    if nvcc is None or not (os.path.exists(nvcc) or shutil.which("nvcc")):
        raise KernelUnavailable("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    try:
        return cpp_extension.load(
            name="tnlg_fused_adam",
            sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=CUDA_FLAGS,
            extra_include_paths=[str(SOURCES)],
            verbose=False,
        )
    except Exception as error:  # a failed compile raises RuntimeError / subprocess errors / OSError
        last = str(error).strip().splitlines()[-1:] or ["unknown error"]
        raise KernelUnavailable(f"the build failed: {last[0]}") from error
