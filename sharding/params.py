"""Stage 3 parameter lifecycle: gather each block just before use, prefetch the next, release after.

[Note: stage 3 block lifecycle]
Every block (a `_no_split_modules` instance, else a child of the model; the model itself is the
root block holding what is left, typically the embeddings and the tied output layer) moves
through asserted states:

    SHARDED --gather()--> GATHERING --wait()--> GATHERED --release()--> SHARDED

forward pre-hook:   wait for (or start) its gather; prefetch the following blocks asynchronously
forward post-hook:  release it (reshard_after_forward), and hook its outputs' gradients so that
                    backward gathers it again before its own backward runs (and prefetches the
                    block before it)
gradients reduced:  once every unit of the block has been reduced, release it
backward end:       release everything still gathered (unused blocks, the root)

The root block stays gathered from the start of forward to the end of backward: its parameters
are used first and last in forward and first in backward. Without gradients (evaluation,
generation) blocks are released after their forward and when the root's forward returns, except
those a pending backward still needs (an evaluation between a training forward and its backward).
A block's forward re-run inside backward (activation recomputation) neither prefetches nor
releases. A block whose outputs carry no tensor that requires grad stays gathered until backward
ends. The order of gathers is the same on every rank, since it follows the same module calls.
In training they run on a process group of their own, so that a prefetch in backward does not queue
behind the gradient reductions (see [Note: gather group] in collectives.py).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from .collectives import Collectives
from .config import ZeroConfig
from .flat_group import FlatGroup
from .grads import WeakHook
from .partition import Unit
from .plan import BlockPlan


class BlockState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Block:
    def __init__(self, plan: BlockPlan, units: list[tuple[FlatGroup, Unit]]):
        self.name = plan.name or "<root>"
        self.module = plan.module
        self.is_root = plan.is_root
        self.units = units
        self.numel = sum(unit.numel for _, unit in units)
        self.state = BlockState.SHARDED
        self._handles: list[object] = []
        self.units_reduced = 0
        self.backward_prepared = False
        self.needed_by_backward = False  # a grad-enabled forward left it gathered for its backward

    def gather(self) -> None:
        assert self.state is BlockState.SHARDED, f"{self.name}: gather while {self.state.value}"
        self._handles = [group.gather(unit, async_op=True) for group, unit in self.units]
        self.state = BlockState.GATHERING

    def wait(self) -> None:
        assert self.state is BlockState.GATHERING, f"{self.name}: wait while {self.state.value}"
        for handle in self._handles:
            handle.wait()
        self._handles = []
        self.state = BlockState.GATHERED

    def ensure_gathered(self) -> None:
        if self.state is BlockState.SHARDED:
            self.gather()
        if self.state is BlockState.GATHERING:
            self.wait()

    def release(self) -> None:
        if self.state is BlockState.GATHERING:
            self.wait()  # never free a buffer a collective is still writing
        if self.state is BlockState.GATHERED:
            for group, unit in self.units:
                group.release(unit)
        self.state = BlockState.SHARDED


class ParameterScheduler:
    def __init__(
        self, plans: list[BlockPlan], groups: list[FlatGroup], config: ZeroConfig, collectives: Collectives
    ):
        self.config = config
        self.collectives = collectives
        units: dict[int, list[tuple[FlatGroup, Unit]]] = {i: [] for i in range(len(plans))}
        self._block_of: dict[tuple[int, int], Block] = {}
        unit_blocks = {}
        for group in groups:
            for unit in group.layout.units:
                block_index = group.unit_blocks[unit.index]
                if block_index is not None:
                    units[block_index].append((group, unit))
                    unit_blocks[(id(group), unit.index)] = block_index
        self.blocks = [Block(plan, units[i]) for i, plan in enumerate(plans)]
        for (group_id, unit_index), block_index in unit_blocks.items():
            self._block_of[(group_id, unit_index)] = self.blocks[block_index]
        self.root = self.blocks[-1]
        self.root_held = False  # a pipeline schedule's whole batch: see hold_root
        self.ordered = [b for b in self.blocks if not b.is_root and b.units]
        # Weak: the user keeps the model (and perhaps a loss and its graph) after dropping the engine;
        # these hooks must not keep the scheduler, and through it every shard, alive (see
        # [Note: engine lifetime] in grads.py). Blocks are named by position, not held.
        self._hooks = []
        for position, block in enumerate(self.ordered):
            self._hooks.append(block.module.register_forward_pre_hook(WeakHook(self._pre_forward, position)))
            self._hooks.append(block.module.register_forward_hook(WeakHook(self._post_forward, position)))
        self._hooks.append(self.root.module.register_forward_pre_hook(WeakHook(self._root_pre_forward)))
        self._hooks.append(self.root.module.register_forward_hook(WeakHook(self._root_post_forward)))
        self._warn_if_prefetch_cannot_happen()

    def _warn_if_prefetch_cannot_happen(self) -> None:
        needed = prefetch_floor(self.root.numel, [block.numel for block in self.ordered])
        if self.config.prefetch_bucket_size > 0 and needed > self.config.max_live_parameters:
            warnings.warn(
                f"ZeRO stage 3: max_live_parameters={self.config.max_live_parameters:,} is below the "
                f"{needed:,} gathered elements that prefetching needs (the root block's "
                f"{self.root.numel:,} and the two largest neighbouring blocks), so some blocks (all, if "
                "the blocks are alike) will be gathered only when they run, without overlap; raise "
                "max_live_parameters to at least that, or set prefetch_bucket_size=0 to say so",
                stacklevel=2,
            )

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Wait for every gather in flight (a prefetch a forward never used), release every block, unhook."""
        self.release_all()
        self.remove_hooks()

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module: nn.Module, args: tuple) -> None:
        self.root.ensure_gathered()
        if torch.is_grad_enabled():
            self.root.needed_by_backward = True

    def _root_post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if not torch.is_grad_enabled():
            # An evaluation forward (perhaps between a training forward and its backward): free
            # what it gathered, but nothing a pending backward still needs.
            for block in self.blocks:
                if not block.needed_by_backward:
                    block.release()

    def _pre_forward(self, position: int, module: nn.Module, args: tuple) -> None:
        self.ordered[position].ensure_gathered()
        if not _in_backward():  # a recomputation inside backward must not prefetch forward
            self._prefetch(position, step=1)

    def _post_forward(self, position: int, module: nn.Module, args: tuple, output: object) -> None:
        if _in_backward():
            return  # activation recomputation: the block's own backward comes next
        block = self.ordered[position]
        if not torch.is_grad_enabled():
            if not block.needed_by_backward:
                block.release()
            return
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors:
            # No output through which backward would announce itself: keep the block until
            # backward ends rather than risk its backward reading released parameters.
            block.needed_by_backward = True
            return
        if self.config.reshard_after_forward:
            block.release()
        else:
            block.needed_by_backward = True
        block.backward_prepared = False
        for tensor in tensors:
            tensor.register_hook(WeakHook(self._pre_backward, position))

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, position: int, grad: torch.Tensor) -> None:
        block = self.ordered[position]
        if not block.backward_prepared:
            block.backward_prepared = True
            block.ensure_gathered()
            self._prefetch(position, step=-1)

    def on_unit_reduced(self, group: FlatGroup, unit: Unit) -> None:
        block = self._block_of.get((id(group), unit.index))
        if block is None:
            return
        block.units_reduced += 1
        if block.units_reduced == len(block.units) and not block.is_root:
            block.release()

    def release_all(self) -> None:
        for block in self.blocks:
            if block.is_root and self.root_held:
                continue
            block.release()
            block.units_reduced = 0
            block.backward_prepared = False
            block.needed_by_backward = False

    @contextlib.contextmanager
    def hold_root(self) -> Iterator[None]:
        """Keep the root block gathered across several forwards and backwards: a pipeline schedule
        interleaves its micro-batches' forwards and backwards, and calls the stage's modules, not the
        root module whose forward hooks gather it otherwise. Released at the end."""
        self.root.ensure_gathered()
        self.root_held = True
        try:
            yield
        finally:
            self.root_held = False
            self.release_all()

    # ------------------------------------------------------------------ prefetch
    def _prefetch(self, position: int, step: int) -> None:
        """Start gathering the blocks after (step=1) or before (step=-1) `position`, within budget."""
        chosen = blocks_to_prefetch(
            [block.numel for block in self.ordered],
            [block.state is not BlockState.SHARDED for block in self.ordered],
            position,
            step,
            live=self.live_numel(),
            budget=self.config.prefetch_bucket_size,
            max_live=self.config.max_live_parameters,
        )
        for index in chosen:
            self.ordered[index].gather()

    def live_numel(self) -> int:
        return sum(b.numel for b in self.blocks if b.state is not BlockState.SHARDED)


def blocks_to_prefetch(
    numels: Sequence[int],
    gathered: Sequence[bool],
    position: int,
    step: int,
    *,
    live: int,
    budget: int,
    max_live: int,
) -> list[int]:
    """The blocks (of the ordered, non-root ones) to start gathering after (step=1) or before (step=-1)
    `position`, in order: the next ones along until `budget` elements of them are gathered or under way,
    stopping at the first that would take the `live` gathered elements above `max_live`. Pure, so that
    the memory plan (tnlg.tools.memory) replays the scheduler's own policy."""
    chosen = []
    index = position + step
    while 0 <= index < len(numels) and budget > 0:
        if not gathered[index]:
            if live + numels[index] > max_live:
                break
            chosen.append(index)
            live += numels[index]
        budget -= numels[index]
        index += step
    return chosen


def prefetch_floor(root_numel: int, numels: Sequence[int]) -> int:
    """The smallest `max_live_parameters` that lets every block be prefetched by its neighbour: the root
    block (gathered all step) plus the largest pair of neighbouring blocks."""
    pairs = [a + b for a, b in itertools.pairwise(numels)]
    return root_numel + max(pairs, default=0)


def _tensors(output: object) -> list[torch.Tensor]:
    """The tensors in a module's output, however nested (tuples, dicts, ModelOutput, ...)."""
    return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (e.g. recomputing a checkpoint)."""
    return torch._C._current_graph_task_id() != -1
