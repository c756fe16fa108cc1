"""`load_state_dict` into an engine's module reaches the fp32 master.

[Note: module loads]
The module's trainable parameters are views of the groups' 16-bit buffers, and each optimizer step
writes them over from the fp32 master shards (flat_group.py). A plain `nn.Module.load_state_dict` copies
into the views only, so the next step undid it: `accelerator.unwrap_model(model).load_state_dict(...)`,
PEFT's `set_peft_model_state_dict`, or `engine.load_state_dict(...)` seemed to work and did not. A
load-state-dict pre-hook on each module whose subtree holds engine parameters settles it:

- stages 0-2: before torch copies a module's own parameters, the hook gives each one it will copy (its
  key present, a tensor of its shape, as torch decides) to `FlatGroup.load_slot`, which writes this rank's
  part of the fp32 master from the value as given (not from its 16-bit cast) and the full view. Torch's
  own copy into the view then writes the same value again. What torch loads, the master holds, also when
  torch goes on to raise for a missing or unexpected key under `strict` (it has copied the rest by then).
- stage 3, `assign=True` and torch's swap-tensors mode are refused before anything is copied: the hook of
  the module `load_state_dict` was called on runs first. Stage 3's parameters have no storage between
  gathers; assigning or swapping would put new tensors where the engine's views were, which the engine
  would neither update nor see.

Frozen parameters outside the groups (stages 0-2 keep them whole, as DDP does) load as usual. Optimizer
state is left as it is, as with `model.load_state_dict` beside a torch optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .flat_group import FlatGroup

_REFUSED_AT_STAGE_3 = (
    "load_state_dict into a ZeRO stage 3 engine's module: its parameters are sharded over the ranks and "
    "released between uses. Load an engine checkpoint with engine.load_checkpoint(DIR), or build the "
    "engine from saved weights with initialize(..., pretrained=PATH)"
)


def register_module_loads(module: nn.Module, groups: list[FlatGroup], stage: int) -> list[RemovableHandle]:
    """The pre-hooks of [Note: module loads] on every module of `module` whose subtree holds a parameter of
    `groups`. Returns the handles the engine's teardown removes: those of stages 0-2, whose parameters
    are plain full tensors after it. Stage 3's refusals stay: its released parameters stay without
    storage, and a copy into them would write where no memory is (a crash, not an error)."""
    slots = {id(param): (group, index) for group in groups for index, param in enumerate(group.params)}
    hook = _refuse_at_stage_3 if stage == 3 else _load_into_master(slots)
    handles = [
        submodule.register_load_state_dict_pre_hook(hook)
        for submodule in module.modules()
        if any(id(param) in slots for param in submodule.parameters())
    ]
    return [] if stage == 3 else handles


def _refuse_at_stage_3(module: nn.Module, *args: Any) -> None:
    raise RuntimeError(_REFUSED_AT_STAGE_3)


def _load_into_master(slots: Mapping[int, tuple[FlatGroup, int]]):
    def hook(
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        *args: Any,
    ) -> None:
        _refuse_replacing_parameters(local_metadata)
        with torch.no_grad():
            for name, param in module._parameters.items():
                if param is None or id(param) not in slots:
                    continue
                value = _value_torch_copies(param, state_dict.get(prefix + name))
                if value is not None:
                    group, index = slots[id(param)]
                    group.load_slot(index, value)

    return hook


def _refuse_replacing_parameters(local_metadata: Mapping[str, Any]) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            "load_state_dict(assign=True) into a ZeRO engine's module would replace the parameters the "
            "engine trains (views of its buffers) with the given tensors; load without assign=True"
        )
    if torch.__future__.get_swap_module_params_on_conversion():
        raise RuntimeError(
            "load_state_dict into a ZeRO engine's module under "
            "torch.__future__.set_swap_module_params_on_conversion(True) would swap out the parameters the "
            "engine trains (views of its buffers); turn that setting off around the load"
        )


def _value_torch_copies(param: torch.Tensor, given: Any) -> torch.Tensor | None:
    """What `nn.Module._load_from_state_dict` copies into `param` from `given`, or None where it copies
    nothing (no such key, not a tensor, another shape: torch reports those itself)."""
    if not isinstance(given, torch.Tensor):
        return None
    if param.dim() == 0 and given.shape == (1,):
        given = given[0]  # torch's backward-compatible reading of a 1-element vector for a scalar
    return given if given.shape == param.shape else None
