"""Fused optimizer kernels: `CPUAdam` (C++, for ZeRO-Offload); built on first use, with torch fall-backs."""

from .cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
