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
A call given a KV cache (generation) runs the block's eager forward instead (`_eager_when_caching`).

CUDA graphs (inductor's `mode="reduce-overhead"` or `"max-autotune"`, or its option `triton.cudagraphs`;
Dynamo's `cudagraphs` backend) replay into the addresses they were recorded with; stage 3 (offloaded or
not) moves parameters between steps, so they are refused there (`check_compile_fits`).
"""

from __future__ import annotations

import difflib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._inductor  # list_mode_options and list_options, which `import torch` alone may not load
from torch import nn

from .config import ZeroConfig
from .plan import declared_block_classes, find_blocks

logger = logging.getLogger(__name__)

# torch.compile's modes and the inductor options each turns on, as the installed torch lists them (its
# documented `list_mode_options`), so that a mode a newer torch adds is accepted and none is guessed.
MODE_OPTIONS: dict[str, dict[str, Any]] = torch._inductor.list_mode_options()
COMPILE_MODES = tuple(MODE_OPTIONS)
# Inductor's switch for recording and replaying CUDA graphs, which a mode or the options may turn on.
CUDA_GRAPHS_OPTION = "triton.cudagraphs"
CUDA_GRAPHS_BACKEND = "cudagraphs"  # Dynamo's backend that records the traced graphs as CUDA graphs
CUDA_GRAPH_MODES = tuple(mode for mode, options in MODE_OPTIONS.items() if options.get(CUDA_GRAPHS_OPTION))
# Inductor's own setting for where it keeps compiled graphs and kernels across processes.
CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
COMPILED_MARK = "_tnlg_compiled_block"


# torch's own backends that take options only to log "ignoring extra kwargs" and compile without them
# (torch 2.13); others (tvm, a third party's) may read them. A mode is inductor's alone.
IGNORE_OPTIONS = frozenset(
    {"eager", "aot_eager", "aot_eager_decomp_partition", "aot_eager_default_partitioner", "cudagraphs"}
)


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
        ignored = self._ignored_by_the_backend()
        if ignored:
            them = "them" if len(ignored) > 1 else "it"
            raise ValueError(
                f"compile {' and '.join(ignored)}: backend {self.backend!r} ignores {them} (a mode is inductor's); "
                f"remove {them}, or compile with backend 'inductor'"
            )
        if self.mode is not None and self.options:
            raise ValueError("give compile mode or options, not both (torch.compile takes one of them)")
        if self.options:
            _check_options(self.compile_kwargs())

    def _ignored_by_the_backend(self) -> list[str]:
        """The settings given that the backend would drop: a mode (inductor's alone; "default" is none),
        and options for a backend of `IGNORE_OPTIONS`."""
        if self.backend == "inductor":
            return []
        ignored = ["mode"] if self.mode not in (None, "default") else []
        if self.options and self.backend in IGNORE_OPTIONS:
            ignored.append("options")
        return ignored

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether the compiled code replays CUDA graphs: Dynamo's `cudagraphs` backend, or inductor with
        a mode or options that turn them on (only inductor takes mode and options)."""
        if self.backend == CUDA_GRAPHS_BACKEND:
            return True
        chosen = {**MODE_OPTIONS.get(self.mode or "default", {}), **self.options}
        return self.backend == "inductor" and bool(chosen.get(CUDA_GRAPHS_OPTION, False))

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


def dotted_options(options: dict[str, Any]) -> dict[str, Any]:
    """Inductor's options under its own dotted names (`triton.cudagraphs`) from a nesting of them, as YAML
    or a dotted command-line override writes them (`triton: {cudagraphs: true}`); a mapping that is an
    option's value (`post_grad_fusion_options`) stays whole."""
    known = set(torch._inductor.list_options())
    flat: dict[str, Any] = {}

    def add(prefix: str, nested: dict[str, Any]) -> None:
        for name, value in nested.items():
            if isinstance(value, dict) and prefix + name not in known:
                add(f"{prefix}{name}.", value)
            else:
                flat[prefix + name] = value

    add("", options)
    return flat


def _check_options(kwargs: dict[str, Any]) -> None:
    """Let torch.compile itself check the options (a name it lacks, a value of the wrong type) now, when
    the setting is read, not when the engine compiles: it checks them when called, and compiles nothing
    until the function it returns runs."""
    try:
        torch.compile(_never_run, **kwargs)
    except RuntimeError as error:
        # torch lists every option it knows after the problem (hundreds): name the closest instead
        problem = str(error).split(", known options are")[0]
        known = torch._inductor.list_options()
        close = [
            match
            for name in kwargs["options"]
            for match in difflib.get_close_matches(name, known, n=1)
            if match != name
        ]
        hint = (
            f" (did you mean {', '.join(close)}? torch._inductor.list_options() lists them)" if close else ""
        )
        raise ValueError(f"compile options: {problem}{hint}") from None


def _never_run(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def check_compile_fits(compile_config: CompileConfig, zero: ZeroConfig) -> None:
    """Refuse CUDA graphs where the engine moves parameters between steps ([Note: compiled blocks])."""
    if compile_config.uses_cuda_graphs and zero.partitions_parameters:
        if compile_config.backend == CUDA_GRAPHS_BACKEND:
            chosen, instead = f"compile backend {CUDA_GRAPHS_BACKEND!r}", "use another backend"
        else:
            chosen = (
                f"compile mode {compile_config.mode!r}"
                if compile_config.mode is not None
                else f"compile option {CUDA_GRAPHS_OPTION}"
            )
            modes = ", ".join(repr(mode) for mode in COMPILE_MODES if mode not in CUDA_GRAPH_MODES)
            instead = f"use mode {modes}, or leave {CUDA_GRAPHS_OPTION} off"
        raise ValueError(
            f"{chosen} replays CUDA graphs at the parameter addresses they were recorded with, but ZeRO "
            f"stage 3 frees and regathers parameters around every block: {instead}"
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
        forward = _eager_when_caching(plan.module.forward, torch.compile(plan.module.forward, **kwargs))
        setattr(forward, COMPILED_MARK, compile_config)
        plan.module.forward = forward
    logger.info(
        "compile: %d blocks compiled with %s (a call given a KV cache, as in generation, runs them eagerly)",
        len(blocks),
        kwargs,
    )
    return [plan.name for plan in blocks]


# The keywords Transformers' decoder layers take their KV cache by, as its GradientCheckpointingLayer
# reads them (the name has changed between releases and differs between models).
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _eager_when_caching(eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    """The block's forward: compiled, except in a call given a KV cache, which runs the eager one.

    A cache is generation's (prefill and every decoded token): each layer writes its own entry of it, so
    Dynamo's guards on that entry (`cache.layers[i]`, `layer_idx`) differ from block to block, and the
    length grows by a token a step. Compiled, the first eight blocks would each compile a frame of their
    own, the rest run eagerly once Dynamo's recompile limit is hit, and decoding would compile again for
    the new shapes. Training and loss evaluation pass no cache and keep the one compiled graph."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(name) is not None for name in CACHE_KEYWORDS):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward


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
