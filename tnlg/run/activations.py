"""Activation checkpointing and its CPU offload, as a run turns them on (`model.activation_checkpointing`).

    enable_activation_checkpointing(model)       # before the engine is built
    with offloaded_activations(enabled=True):    # around each training forward; backward may run after
        loss = engine(**batch).loss

Checkpointing is the model's own (Transformers' `activation_checkpointing_enable`, each `TNLGBlock` a
checkpointed layer, non-reentrant). What is recomputed is the block's forward, its hooks outside
([Note: checkpointing the forward] in transformers_compat.py): the ZeRO-3 engine has gathered the
block's parameters for its backward before the recomputation reads them (tnlg.sharding.params).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tnlg.modeling.transformers_compat import enable_checkpointing
from tnlg.run.config import ActivationCheckpointingSection

# Non-reentrant checkpointing: the recomputation runs inside the ordinary backward, so the engine's
# hooks and gradient reduction see it like any other backward (the reentrant variant runs a nested
# backward per block and needs inputs that require grad).
CHECKPOINT_KWARGS = {"use_reentrant": False}


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Turn on activation checkpointing in a Transformers model (or a wrapper that forwards to one, such
    as a peft model); works on the meta device, since it only sets each block's checkpoint function."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"model.activation_checkpointing.enabled: {type(model).__name__} does not support activation "
            "checkpointing (it is no Transformers model with checkpointed layers)"
        )
    enable_checkpointing(model, dict(CHECKPOINT_KWARGS))


def is_activation_checkpointing(model: nn.Module) -> bool:
    """Whether any layer of `model` recomputes its forward in backward (both transformers spellings)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Tensors autograd saves for backward go to host memory and come back when backward reads them.

    Like `torch.autograd.graph.save_on_cpu`, except that parameters stay where they are: a saved
    weight (the tied output layer's, 2 GB at 530B in bf16) is no activation, the engine already holds it,
    and copying it out and back every micro-batch would only cost time and pinned memory. With
    checkpointing on, what is saved during forward is each checkpointed block's input (the non-reentrant
    checkpoint saves them through these hooks) and the tensors outside the blocks (final LayerNorm,
    output layer, loss); the tensors saved during a recomputation are not offloaded (they live only
    for that block's backward). `packed_bytes` counts what was moved.
    """

    def __init__(self, pin_memory: bool):
        self.packed_bytes = 0

        def pack(tensor: torch.Tensor) -> Any:
            if isinstance(tensor, nn.Parameter):
                return tensor
            self.packed_bytes += tensor.numel() * tensor.element_size()
            if not pin_memory:
                return tensor.device, tensor.cpu()  # on a CPU run the same tensor: nothing to move
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            host.copy_(tensor)
            return tensor.device, host

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def check_activation_offload(section: ActivationCheckpointingSection, pipeline: int) -> None:
    """`model.activation_checkpointing.cpu_offload` under `parallel.pipeline` > 1 is refused: the
    pipeline schedule interleaves the micro-batches' forwards and backwards inside the engine
    (`engine.train_batch`), where the loop's `offloaded_activations` around each forward cannot reach,
    so the setting would be silently ignored. Refused when the run is built, before anything is
    written or removed."""
    if section.cpu_offload and pipeline > 1:
        raise ValueError(
            f"model.activation_checkpointing.cpu_offload is not supported with parallel.pipeline {pipeline} (the "
            "pipeline schedule runs the forwards inside the engine, where the offload does not apply): set "
            "cpu_offload false (checkpointing alone still recomputes each block), or train without pipeline "
            "stages"
        )


def offloaded_activations(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """`HostActivations` (pinned host memory when CUDA is available) when `enabled`, else nothing."""
    if not enabled:
        return contextlib.nullcontext()
    return HostActivations(pin_memory=torch.cuda.is_available())
