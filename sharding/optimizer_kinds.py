"""Which optimizers the engine can step exactly: those whose update is element-wise.

[Note: element-wise optimizers]
The engine rebuilds the user's optimizer over one flat 1-D fp32 master shard per param group (see
optimizer.py). An optimizer whose update of each element depends only on that element's gradient,
state and the group's scalars (the step count, lr, betas, ...) computes exactly what it would
unsharded. One that looks at a tensor's shape or at whole-tensor statistics (Adafactor's factored
second moment, LAMB / LARS trust ratios, Muon's orthogonalized matrices, LBFGS's global line search,
8-bit optimizers' block-wise quantization) sees a 1-D slice of several tensors instead and runs a
different algorithm, even on one process at stage 0: Transformers' Adafactor (the Trainer's
optim="adafactor") moved parameters further from plain training in 3 steps than its whole update.
DeepSpeed likewise refuses optimizers it has not tested with ZeRO unless `zero_allow_untested_optimizer`.

`ELEMENT_WISE_OPTIMIZERS` lists the classes read and found element-wise (torch 2.13's source: no
norm, shape or reduction over a tensor in their step); the engine's own `CPUAdam` steps the same
rule as torch's AdamW. The check is by exact class: a subclass may change step() (e.g. to clip by a
tensor's norm), so it is not taken for its base. Anything else needs
`ZeroConfig.allow_untested_optimizer`, which build.py checks at initialize before any work.
"""

from __future__ import annotations

import logging

import torch

from .kernels import CPUAdam

logger = logging.getLogger(__name__)

ELEMENT_WISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
        CPUAdam,
    }
)


def is_element_wise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s class is known to update each element on its own (exact class)."""
    return type(optimizer) in ELEMENT_WISE_OPTIMIZERS


def check_optimizer_kind(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Refuse an optimizer the flat shards would change (see [Note: element-wise optimizers]) unless
    `allow_untested` (ZeroConfig.allow_untested_optimizer), which is then logged as a warning."""
    if is_element_wise(optimizer):
        return
    name = _qualified_name(type(optimizer))
    if allow_untested:
        logger.warning(
            "training with %s, not known to update each element on its own, as "
            "allow_untested_optimizer permits: the engine steps flat 1-D shards, which changes the "
            "update of an optimizer that uses tensor shapes or whole-tensor statistics",
            name,
        )
        return
    known = ", ".join(sorted(kind.__name__ for kind in ELEMENT_WISE_OPTIMIZERS))
    raise ValueError(
        f"{name} is not known to update each element on its own: the ZeRO engine steps each param "
        "group as one flat 1-D shard of its parameters, which changes the update of an optimizer that "
        "uses tensor shapes or whole-tensor statistics (Adafactor's factored moments, LAMB's trust "
        f"ratio); use one of {known}, or, if {type(optimizer).__name__}'s update is element-wise, set "
        "ZeroConfig(allow_untested_optimizer=True) (a DeepSpeed JSON's zero_allow_untested_optimizer: "
        "true)"
    )


def _qualified_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"
