"""The one place that adapts the model to the installed Transformers release.

[Note: the cache's name] Transformers 5.24 renamed the key-value cache from `past_key_values` to `cache`:
the keyword `generate()` hands the model, the field of the model outputs and the argument of
`create_causal_mask`. The old name is deprecated there (removed in 5.40), while the floor release (5.17)
knows only the old one. A model that reads one name loses the cache on the other release without an
error: every decoding step then sees only its newest token. So:

- `CACHE_NAME` is the name the installed release uses, read from `create_causal_mask`'s public
  signature (a feature, not a version number).
- Every call into Transformers that carries the cache passes it as `**cache_kwarg(cache)`, and a model
  output's cache is read with `output_cache(outputs)`.
- The model's own forwards take `cache`, and `accepts_legacy_cache_name` maps `past_key_values` onto it:
  that is what 5.17's `generate()` passes, and what user code written for it still passes.

Likewise Transformers 5.23 renamed `gradient_checkpointing_enable` to `activation_checkpointing_enable`
(the old name warns): `enable_checkpointing` calls whichever the installed release has.

[Note: checkpointing the forward] Up to 5.23 `GradientCheckpointingLayer` checkpoints the layer's
`__call__`, so the module's hooks (the ZeRO-3 gather, FSDP2's) run again inside the recomputation; from
5.24 it checkpoints `forward` and the hooks stay outside. `CheckpointedLayer` is the 5.24 behaviour on
every release (feature-detected: whether the base class defines `__call__`). It matters to compiled
blocks too: the engine compiles a block's `forward`, so with the checkpoint in `forward` Dynamo traces
it and inductor plans the recomputation into the block's backward graph (torchtitan's order: checkpoint,
then compile); with it in `__call__` a compiled forward runs a second time inside an eager checkpoint,
which on an H100 gained nothing over eager (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

logger = logging.getLogger(__name__)

LEGACY_CACHE_NAME = "past_key_values"
CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else LEGACY_CACHE_NAME

Function = TypeVar("Function", bound=Callable[..., Any])


def cache_kwarg(cache: Cache | None) -> dict[str, Cache | None]:
    """The cache as the keyword the installed Transformers reads."""
    return {CACHE_NAME: cache}


def output_cache(outputs: ModelOutput) -> Cache | None:
    """The cache a model output carries, under whichever name the installed release gives the field."""
    return getattr(outputs, CACHE_NAME, None)


def causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor | None,
) -> Any:
    """`create_causal_mask` with the cache under the installed release's name.

    `position_ids` are the caller's own, or None where the model counted them (0, 1, ... in every
    row). Given positions, with no mask and no cache (training), Transformers looks for several
    sequences packed in a row, where a position starts again from 0, and reading the answer back from
    the device waits for it once per forward; counted positions hold one sequence a row, so there is
    nothing to find and no wait. (Flash attention searches the positions a block is given the same way,
    in every layer at batch 1: the blocks get the caller's positions only, too.)

    An empty dynamic cache is left out of the mask ([Note: packed sequences and an empty cache])."""
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **cache_kwarg(None if is_empty_dynamic_cache(cache) else cache),
    )


def is_empty_dynamic_cache(cache: Cache | None) -> bool:
    """Whether `cache` is a `DynamicCache` holding no tokens yet.

    [Note: packed sequences and an empty cache]
    Transformers keeps sequences packed in a row apart (positions restarting at 0, no mask) only when no
    cache is given. An evaluation forward builds a cache of its own unless it computes a loss (see
    TNLGForCausalLM.forward), so with a cache in the mask the same packed inputs would attend across
    their documents without labels and apart with them. An empty dynamic cache adds no tokens to attend
    to and sizes the mask as no cache does (its keys are the new tokens), so the mask is made without it
    and both forwards give the same logits. A static cache is kept: it sizes the mask to its capacity.
    """
    return isinstance(cache, DynamicCache) and cache.get_seq_length() == 0


def accepts_legacy_cache_name(forward: Function) -> Function:
    """Let a forward that takes `cache` also be called with `past_key_values` (never both).

    Under a release that still uses the old name this is how its `generate()` reaches us, so it is
    silent; under one that deprecated it, the caller is told once, as Transformers' own models do.
    """

    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if LEGACY_CACHE_NAME in kwargs:
            legacy = kwargs.pop(LEGACY_CACHE_NAME)
            if kwargs.get("cache") is not None and legacy is not None:
                raise ValueError("pass the key-value cache once, as `cache` (not also as `past_key_values`)")
            if legacy is not None:
                kwargs["cache"] = legacy
            if CACHE_NAME != LEGACY_CACHE_NAME and not torch.compiler.is_compiling():
                _warn_legacy_name_once()
        return forward(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def enable_checkpointing(model: Any, checkpoint_kwargs: dict[str, Any], every_n_layers: int = 1) -> None:
    """Turn on a Transformers model's activation checkpointing (or a wrapper's that forwards to one, as
    a peft model does) with `checkpoint_kwargs` for torch.utils.checkpoint, in every `every_n_layers`-th
    layer, by the release's name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=checkpoint_kwargs, every_n_layers=every_n_layers
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=checkpoint_kwargs, every_n_layers=every_n_layers
        )


# Whether the installed release checkpoints `__call__` ([Note: checkpointing the forward]).
CHECKPOINTS_CALL = "__call__" in vars(GradientCheckpointingLayer)
# What a checkpointed training forward must not write into: backward's recomputation would write it again.
CACHE_KEYWORDS = (LEGACY_CACHE_NAME, "cache", "layer_past")


class CheckpointedLayer(GradientCheckpointingLayer):
    """`GradientCheckpointingLayer` checkpointing its `forward`, its hooks outside, on every release
    ([Note: checkpointing the forward]). From 5.24 that is the base class itself; before, the subclass's
    own forward is wrapped here as 5.24 wraps it, and `__call__` is `nn.Module`'s again."""

    if CHECKPOINTS_CALL:
        __call__ = nn.Module.__call__

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            if "forward" in vars(cls):  # not a subclass that only inherits it (FSDP2's FSDP<Layer>)
                cls.forward = _checkpointed(cls.forward)


def _checkpointed(forward: Function) -> Function:
    @functools.wraps(forward)
    def checkpointed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        outermost = type(self).forward is checkpointed_forward  # a subclass's forward may wrap this one
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled() and outermost):
            return forward(self, *args, **kwargs)
        dropped = [name for name in CACHE_KEYWORDS if kwargs.get(name) is not None]
        kwargs.update(dict.fromkeys(dropped))
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
            dropped.append("use_cache")
        if dropped and not torch.compiler.is_compiling():
            _warn_cache_dropped_once(type(self).__name__, tuple(dropped))
        return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs), *args)

    return checkpointed_forward  # type: ignore[return-value]


@functools.cache
def _warn_cache_dropped_once(layer: str, names: tuple[str, ...]) -> None:
    logger.warning(
        "Caching is incompatible with activation checkpointing in %s: %s unset", layer, ", ".join(names)
    )


@functools.cache
def _warn_legacy_name_once() -> None:
    logger.warning("`past_key_values` is deprecated by the installed Transformers: pass the cache as `cache`")


__all__ = [
    "CACHE_NAME",
    "CHECKPOINTS_CALL",
    "LEGACY_CACHE_NAME",
    "CheckpointedLayer",
    "accepts_legacy_cache_name",
    "cache_kwarg",
    "causal_mask",
    "enable_checkpointing",
    "is_empty_dynamic_cache",
    "output_cache",
]
