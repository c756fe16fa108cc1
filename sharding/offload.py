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
3's host shard, staging buffers); the master and the moments, which only the CPU touches, are not.
The buffers that live with a group are pinned at their exact size (`pinned_host`): torch's pinned
allocator (`pin_memory=True`) rounds each block up to a power of two, so that a 8.6 GB shard would
lock 16 GB. Only the short-lived staging buffers of `GradientsToHost`, one unit's piece each and
allocated again at every micro-step, come from torch's allocator, whose cache hands the same
blocks back without locking pages again.
Every copy goes through a separate destination buffer even when the "device" is the CPU, so the
code paths (and their bookkeeping) are the same ones the tests run on CPU-only machines.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from dataclasses import dataclass

import torch

from .kernels import CPUAdam
from .kernels.fused_adam import steps_like_adam

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
# cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinned host memory is.
HOST_REGISTER_PORTABLE = 1


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
        """A host buffer; pinned at its exact size when it is copied to or from a CUDA device
        (`transfer`; see `pinned_host`, whose memory starts zeroed)."""
        if self.pin and transfer:
            return pinned_host(numel, dtype, self.device)
        return torch.zeros(numel, dtype=dtype, device=HOST)

    def host_empty(self, numel: int, dtype: torch.dtype, transfer: bool = True) -> torch.Tensor:
        if self.pin and transfer:
            return pinned_host(numel, dtype, self.device)
        return torch.empty(numel, dtype=dtype, device=HOST)

    def staging_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A short-lived host buffer for one copy off the device: from torch's pinned allocator when
        there is a CUDA device (rounded up, but cached and reused; see [Note: offload])."""
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pin)


def pinned_host(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`numel` zeroed elements of host memory, page-locked at exactly their size for copies to and
    from `device` (a CUDA device).

    The memory is an anonymous mapping (page-aligned, so that no other allocation shares its pages,
    which cudaHostRegister would refuse to lock twice) registered with CUDA, as torch's distributed
    checkpoint stager pins its buffers. It is unregistered when the last tensor viewing it is freed,
    after the device has finished every copy that may still read or write it, and only then unmapped.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, device=HOST)
    mapping = mmap.mmap(-1, nbytes)
    view = memoryview(mapping)  # the tensor's storage holds this view; the finalizer holds `mapping`
    tensor = torch.frombuffer(view, dtype=dtype, count=numel)
    _page_lock(tensor.data_ptr(), nbytes)
    release = weakref.finalize(view, _release_pinned, tensor.data_ptr(), device, mapping)
    release.atexit = False  # at exit the CUDA context may be gone; the process frees everything anyway
    return tensor


def _page_lock(address: int, nbytes: int) -> None:
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed: {error}")


def _page_unlock(address: int) -> None:
    error = torch.cuda.cudart().cudaHostUnregister(address)
    if int(error) != 0:
        logger.warning("cudaHostUnregister of a pinned host buffer failed: %s", error)


def _release_pinned(address: int, device: torch.device, mapping: mmap.mmap) -> None:
    """A `pinned_host` buffer's end: unlocked once no copy can touch it. `mapping` is unmapped after
    this returns (the finalizer holds its last reference until then)."""
    torch.cuda.synchronize(device)
    _page_unlock(address)


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
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []

    def add(self, target: torch.Tensor, reduced: torch.Tensor) -> None:
        """`target` (a host view) += `reduced` (on the device), once settled."""
        staging = self.placement.staging_empty(reduced.numel(), reduced.dtype)
        event = None
        if reduced.device.type == "cuda":
            staging.copy_(reduced, non_blocking=True)  # on the current stream of reduced's device
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(reduced.device))
        else:
            staging.copy_(reduced)
        self._pending.append((target, staging, event))

    def settle(self) -> None:
        """Finish every pending addition (call before anything reads the host gradient shard)."""
        for target, staging, event in self._pending:
            if event is not None:
                event.synchronize()
            target.add_(staging)
        self._pending.clear()

    def discard(self) -> None:
        """Drop every pending addition (the engine is closing), after the copies into staging have
        finished: a pinned buffer must not be freed while a device copy still writes into it."""
        for _, _, event in self._pending:
            if event is not None:
                event.synchronize()
        self._pending.clear()

    def staging(self) -> list[torch.Tensor]:
        """The host staging buffers of additions not yet settled."""
        return [staging for _, staging, _ in self._pending]


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
