"""CPU offload (ZeRO-Offload): which buffers live in host memory, and the copies between host and device.

[Note: offload]
`offload_optimizer="cpu"` (stages 1-3) moves what only the optimizer step reads into host memory:

    fp32 master shard + optimizer state   host
    gradient shard, stages 2-3            host, fp32: each unit's reduced piece is copied out as its
                                          reduce-scatter completes (asynchronously on CUDA, through a
                                          pinned staging buffer, settled when backward ends) and
                                          accumulated there across micro-steps
    gradient, stage 1                     stays on the device (stage 1 keeps full gradients); this
                                          rank's pieces are copied out at the step
    16-bit parameters                     the device, as without offload

The step runs on the host. For Adam and AdamW (the optimizers ZeRO-Offload is used with) it is
`CPUAdam`'s one pass, which reads the gradient shard as it is (16-bit or fp32) with unscaling and
clipping folded into its read, and writes the updated 16-bit values into a pinned host shard;
that shard is copied to the device and all-gathered (stages 1-2) or becomes the device's 16-bit
shard (stage 3). Any other optimizer steps the host master tensors itself, and the master is
cast on its way back.

`offload_param="cpu"` (stage 3) keeps the 16-bit parameter shard in host memory; a gather first
copies this rank's piece of the unit to the device (asynchronously from pinned memory, so it
overlaps like the all-gather it precedes) and the staging copy is freed when the gather completes.

Only the buffers that cross to or from the device are pinned (the 16-bit copy the step writes, stage
3's host shard, staging buffers): torch's pinned allocator rounds each block up to a power of two, so
pinning the master and the moments, which only the CPU touches, could nearly double their host memory.
Every copy goes through a separate destination buffer even when the "device" is the CPU, so the
code paths (and their bookkeeping) are the same ones the tests run on CPU-only machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import CPUAdam
from .kernels.fused_adam import steps_like_adam

HOST = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Where a flat group's buffers live (see [Note: offload])."""

    device: torch.device  # where the model computes
    optimizer_on_host: bool = False  # fp32 master, optimizer state, stage 2-3 gradient shard
    params_on_host: bool = False  # stage 3: the 16-bit parameter shard

    @property
    def pin(self) -> bool:
        """Host buffers are pinned when there is a CUDA device to copy to and from asynchronously."""
        return self.device.type == "cuda"

    def host_zeros(self, numel: int, dtype: torch.dtype, transfer: bool = True) -> torch.Tensor:
        """A host buffer; pinned when it is copied to or from a CUDA device (`transfer`)."""
        return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=self.pin and transfer)

    def host_empty(self, numel: int, dtype: torch.dtype, transfer: bool = True) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pin and transfer)


class StagedGather:
    """The handle of an all-gather whose input was first copied to the device: it keeps that copy
    alive until the collective has read it (a gloo or NCCL collective reads it asynchronously)."""

    def __init__(self, handle, staged: torch.Tensor):
        self._handle = handle
        self._staged: torch.Tensor | None = staged

    def wait(self) -> bool:
        self._handle.wait()
        self._staged = None
        return True

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of `host`; asynchronous from pinned memory (ordered before later work on the
    current stream, which is where the collective that reads it is enqueued)."""
    staged = torch.empty(host.shape, dtype=host.dtype, device=device)
    staged.copy_(host, non_blocking=host.is_pinned())
    return staged


class GradientsToHost:
    """Reduced gradient pieces, copied off the device as they complete and added into a host shard.

    On CUDA the copy into a pinned staging buffer is asynchronous (an event marks its end); the
    additions run in `settle`, when backward ends, so the device never waits for the host.
    """

    def __init__(self, placement: Placement):
        self.placement = placement
        self._pending: list[tuple[torch.Tensor, torch.Tensor, float, torch.cuda.Event | None]] = []

    def add(self, target: torch.Tensor, reduced: torch.Tensor, alpha: float) -> None:
        """`target` (a host view) += `alpha` * `reduced` (on the device), once settled."""
        staging = self.placement.host_empty(reduced.numel(), reduced.dtype)
        event = None
        if reduced.device.type == "cuda":
            staging.copy_(reduced, non_blocking=True)  # on the current stream of reduced's device
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(reduced.device))
        else:
            staging.copy_(reduced)
        self._pending.append((target, staging, alpha, event))

    def settle(self) -> None:
        """Finish every pending addition (call before anything reads the host gradient shard)."""
        for target, staging, alpha, event in self._pending:
            if event is not None:
                event.synchronize()
            target.add_(staging, alpha=alpha)
        self._pending.clear()

    def discard(self) -> None:
        """Drop every pending addition (the engine is closing), after the copies into staging have
        finished: a pinned buffer must not be freed while a device copy still writes into it."""
        for _, _, _, event in self._pending:
            if event is not None:
                event.synchronize()
        self._pending.clear()

    def staging(self) -> list[torch.Tensor]:
        """The host staging buffers of additions not yet settled."""
        return [staging for _, staging, _, _ in self._pending]


def host_adam_for(optimizer: torch.optim.Optimizer) -> CPUAdam | None:
    """A `CPUAdam` that can step `optimizer`'s param groups and state in its place (see
    `steps_like_adam`); None where the optimizer must step itself."""
    if not steps_like_adam(optimizer):
        return None
    return CPUAdam([p for group in optimizer.param_groups for p in group["params"]])


def host_adam_step(
    adam: CPUAdam,
    optimizer: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    out16: list[torch.Tensor | None],
    grad_scale: float,
) -> None:
    """One `CPUAdam` pass over `optimizer`'s own param groups and state (bound at every step, since
    `optimizer.load_state_dict` replaces both objects), so its state dict, its learning-rate
    scheduler and torch's AdamW all keep seeing the same numbers."""
    adam.param_groups = optimizer.param_groups
    adam.state = optimizer.state
    adam.step(grads=grads, out16=out16, grad_scale=grad_scale)
