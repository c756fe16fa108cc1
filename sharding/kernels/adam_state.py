"""torch's Adam state for one parameter, created on its first step as `torch.optim.Adam` creates it:
a CPU float `step` and fp32 moments shaped like the parameter, so state dicts move between torch's
Adam/AdamW, `CPUAdam` and the fused kernels."""

from __future__ import annotations

import torch


def adam_state(state: dict, param: torch.Tensor, amsgrad: bool) -> dict:
    """`state` (an optimizer's `state[param]`), filled in on the first step."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
    return state
