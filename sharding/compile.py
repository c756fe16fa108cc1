"""torch.compile through the engine: each block's forward compiled, the engine's hooks left eager.

[Note: compiled blocks]
`initialize` compiles the forward of every block the sharding plan finds (the model's
`_no_split_modules` instances: the decoder layers), after the model is cut to this rank's pipeline
stages and tensor slices and before the engine registers its hooks, the order torchtitan uses; never the
whole model. What is compiled is the block's `forward` (an attribute of the instance), not its
`__call__` as `nn.Module.compile()` would: the module's hooks (stage 3's gather, prefetch and release,
the gradient hooks on its outputs) then run eagerly around the compiled code instead of being traced
into it, where their collectives and state changes would break the graph. Parameter names and the
state dict stay the model's own (no `_orig_mod.` prefix, as wrapping in `torch.compile(module)` gives).
An engine built later over the same model replaces these forwards with its own setting's, or with the
class's forward when it compiles nothing: what an engine runs is what it was given.

Why one graph serves every block and every step:
- The blocks run the same code; Dynamo lifts their parameters into graph inputs
  (`inline_inbuilt_nn_modules`, torch's default), so blocks of one shape share a compiled graph.
- Stage 3 frees a block's parameters by resizing their storage to nothing and gathers into the same
  views (flat_group.py): the parameter objects, shapes and strides a guard checks do not change.
- `param.grad` is the engine's placeholder between steps: it answers the metadata Dynamo reads to
  fake it (flat_group.py), and it is the same kind of tensor at every step.
A new graph is compiled when something a guard reads changes: training against evaluation
(dropout), gradients on against off, a new sequence length (`dynamic` decides how that is handled).

CUDA graphs (`mode="reduce-overhead"` or `"max-autotune"`) replay into the addresses they were
recorded with; stage 3 (offloaded or not) moves parameters between steps, so those modes are
refused there (`check_compile_fits`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .config import ZeroConfig
from .plan import declared_block_classes, find_blocks

logger = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes whose compiled code replays CUDA graphs (torch's own list of what they switch on).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# Inductor's own setting for where it keeps compiled graphs and kernels across processes.
CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
COMPILED_MARK = "_tnlg_compiled_block"


@dataclass(frozen=True)
class CompileConfig:
    """How `initialize` compiles each block (see [Note: compiled blocks]): `torch.compile`'s own
    `backend`, `mode`, `fullgraph`, `dynamic` and `options`, and `cache_dir`, where inductor keeps what
    it compiled, so that a resumed run (or any later one with the same model) reads it and skips most of
    the compiling (Dynamo still traces the blocks)."""

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        known = torch.compiler.list_backends(exclude_tags=())
        if self.backend not in known:
            raise ValueError(
                f"compile backend {self.backend!r} is not one torch knows: {', '.join(sorted(known))}"
            )
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {self.mode!r} is not one of {', '.join(COMPILE_MODES)}")
        if self.mode is not None and self.options:
            raise ValueError("give compile mode or options, not both (torch.compile takes one of them)")

    def compile_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options:
            kwargs["options"] = dict(self.options)
        return kwargs


def check_compile_fits(compile_config: CompileConfig, zero: ZeroConfig) -> None:
    """Refuse CUDA-graph modes where the engine moves parameters between steps ([Note: compiled blocks])."""
    if compile_config.mode in CUDA_GRAPH_MODES and zero.partitions_parameters:
        raise ValueError(
            f"compile mode {compile_config.mode!r} replays CUDA graphs at the parameter addresses they were "
            "recorded with, but ZeRO stage 3 frees and regathers parameters around every block: use mode "
            "'default' or 'max-autotune-no-cudagraphs'"
        )


def compile_blocks(module: nn.Module, compile_config: CompileConfig | None) -> list[str]:
    """Compile the forward of each block of `module` in place (a forward compiled for an earlier engine
    over the same module is replaced); with `compile_config=None` undo that, so that an engine built
    without compiling runs eager code. Returns the names of the blocks compiled."""
    blocks = [plan for plan in find_blocks(module) if not plan.is_root]  # the root: embeddings, head
    for plan in blocks:
        own = vars(plan.module).get("forward")
        if getattr(own, COMPILED_MARK, None) is not None:
            del plan.module.forward  # the class's forward again
        elif own is not None and compile_config is not None:
            raise ValueError(
                f"compile: block {plan.name} has a forward set on the instance, not its class's; compiling "
                "it would hide which one runs"
            )
    if compile_config is None:
        return []
    if not declared_block_classes(module):
        raise ValueError(
            f"compile: {type(module).__name__} declares no repeated blocks to compile (_no_split_modules, as "
            "Transformers models do); the engine compiles those, never the whole model"
        )
    _use_cache_dir(compile_config.cache_dir)
    kwargs = compile_config.compile_kwargs()
    for plan in blocks:
        compiled = torch.compile(plan.module.forward, **kwargs)
        setattr(compiled, COMPILED_MARK, compile_config)
        plan.module.forward = compiled
    logger.info("compile: %d blocks compiled with %s", len(blocks), kwargs)
    return [plan.name for plan in blocks]


def _use_cache_dir(cache_dir: str | None) -> None:
    """Point inductor's cache at `cache_dir`. Inductor reads the variable whenever it looks for or writes
    a cached graph, so setting it before the first compile is enough; like inductor's cache it is
    process-wide, and stays set for later compiles in the process."""
    if cache_dir is None:
        return
    path = os.path.abspath(cache_dir)
    previous = os.environ.get(CACHE_DIR_VARIABLE)
    if previous is not None and os.path.abspath(previous) != path:
        logger.info(
            "compile: cache_dir %s replaces %s=%s for this process", path, CACHE_DIR_VARIABLE, previous
        )
    os.makedirs(path, exist_ok=True)
    os.environ[CACHE_DIR_VARIABLE] = path


class CompileClock:
    """Counts Dynamo's compilations in this process and the wall time they take, from the compile
    callbacks torch runs around each one (a backward graph compiled lazily counts too), until `close`.
    `torch._dynamo.reset()` drops every such callback, so compilations after a reset are not counted."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self._started: float | None = None
        self._handler = torch._dynamo.callback.callback_handler
        self._handler.register_start_callback(self._start)
        self._handler.register_end_callback(self._end)

    def _start(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, *args: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compiles += 1
            self._started = None

    def close(self) -> None:
        if self._start in self._handler.start_callbacks:  # a torch._dynamo.reset() may have removed it
            self._handler.remove_start_callback(self._start)
        if self._end in self._handler.end_callbacks:
            self._handler.remove_end_callback(self._end)
