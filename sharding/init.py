"""Building a model on the meta device and materializing only this rank's shards.

[Note: seeded initialization]
A model built under `torch.device("meta")` has shapes and no storage. `materialize` walks its
modules in order and, for each one, allocates its own parameters for real, runs the model's
initializer on them (Transformers' `_init_weights`, else the module's `reset_parameters`) under a
seed derived from (seed, module name), hands each value to `sink` (the engine keeps this rank's
part) and drops it. So no rank ever holds more than one module's own parameters in full beyond its
shards, and no torch constructor is patched.

Seeding per module makes the values independent of the world size, the stage and the order of
materialization: `init_weights(model, seed)` on an ordinary (unsharded) model gives exactly the
values that the shards of every rank hold after `materialize(..., seed)`.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping

import torch
from torch import nn


def module_seed(seed: int, module_name: str) -> int:
    """A per-module seed that is the same in every process (unlike Python's salted `hash`)."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63)


def initializer(model: nn.Module) -> Callable[[nn.Module], None]:
    """The function that initialises one module's own parameters in place."""
    init_weights = getattr(model, "_init_weights", None)
    if callable(init_weights):
        return init_weights

    def reset(module: nn.Module) -> None:
        if not hasattr(module, "reset_parameters"):
            raise ValueError(
                f"cannot initialise {type(module).__name__}: it has parameters but no reset_parameters(), and the "
                "model has no _init_weights()"
            )
        module.reset_parameters()

    return reset


@contextlib.contextmanager
def _seeded(seed: int, name: str, device: torch.device) -> Iterator[None]:
    """Run with the global RNG seeded for this module, restoring the caller's RNG state after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(module_seed(seed, name))
        yield


def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise an ordinary model's parameters in place, module by module, with per-module seeds."""
    initialize_module = initializer(model)
    done: set[int] = set()
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) not in done]
        if not own:
            continue
        with _seeded(seed, name, own[0].device), torch.no_grad():
            initialize_module(module)
        done.update(id(p) for p in own)


def materialize(
    model: nn.Module,
    seed: int,
    device: torch.device,
    sink: Callable[[nn.Parameter, torch.Tensor], None],
    only: Collection[int] | None = None,
    whole_shapes: Mapping[int, tuple[int, ...]] | None = None,
) -> None:
    """Give `sink(parameter, full_value)` every meta parameter's initial value, one module at a time.

    The parameter objects stay meta (and stay the ones the optimizer holds); `sink` decides what
    this rank keeps. `only` (parameter ids) limits it to those parameters, e.g. the ones a
    checkpoint lacks; their values are the same as without `only`. `whole_shapes` (parameter id: shape)
    initialises a parameter cut for tensor slicing at its whole shape, so that `sink` gets the whole
    value (and keeps its slice of it) and every layout starts from the same weights. Meta buffers
    cannot be initialised generically and are refused.
    """
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    if meta_buffers and only is None:
        raise ValueError(f"meta-device buffers cannot be materialized (no initializer): {meta_buffers}")
    initialize_module = initializer(model)
    done: set[int] = set()
    for name, module in model.named_modules():
        own = {k: p for k, p in module._parameters.items() if p is not None and id(p) not in done}
        if not own or (only is not None and not any(id(p) in only for p in own.values())):
            done.update(id(p) for p in own.values())
            continue
        originals = dict(module._parameters)
        real = {
            k: nn.Parameter(
                torch.empty((whole_shapes or {}).get(id(p), p.shape), dtype=p.dtype, device=device),
                requires_grad=p.requires_grad,
            )
            for k, p in own.items()
        }
        module._parameters.update(real)
        try:
            with _seeded(seed, name, device), torch.no_grad():
                initialize_module(module)
        finally:
            module._parameters.update(originals)
        for key, param in own.items():
            done.add(id(param))
            value = real.pop(key).detach()
            if only is None or id(param) in only:
                sink(param, value)
