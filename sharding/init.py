"""Building a model on the meta device and materializing only this rank's shards.

[Note: seeded initialization]
A model built under `torch.device("meta")` has shapes and no storage. `materialize` gives each of its
meta tensors the value the model's own initialization gives it, one rule call at a time, under a seed
derived from (seed, module name), hands each parameter's value to `sink` (the engine keeps this
rank's part) and drops it. No torch constructor is patched.

The rule calls are the ones Transformers makes (`PreTrainedModel.initialize_weights`): every module,
children before their parent, gets `_init_weights` of its nearest enclosing model (a sub-model
brings its own), so a parent's rule comes last and wins: GPT-2's `_init_weights(GPT2Attention)`
rescales `c_proj.weight`, which the attention module does not own. As in Transformers, custom code
(a model class outside the transformers package, TNLG's included) skips the modules that own no
tensor to initialize. A model without `_init_weights` gets `reset_parameters()` of each module that
owns such a tensor.

A rule may write any tensor of its module's subtree, so before any storage is allocated each call
is first run on meta stand-ins, whose version counters (and `.data` reads) say which tensors it
writes. The real pass then allocates, for each call, only the tensors it writes, keeps a tensor
from its first writer to its last (one block's worth for GPT-2's parent rules) and drops it there;
everything else in the subtree is a meta stand-in during the call, so a rule can write nothing
else. A tensor shared by several modules (a tied output layer) is written only through its first
name, as `named_parameters` lists it: Transformers initializes the tied copy before tying it, and
tying keeps the source's value. Meta buffers (e.g. rotary `inv_freq`) are initialized the same way
and kept whole on every rank; a meta tensor that no rule writes is refused by name.

Seeding per call makes the values independent of the world size, the stage and the order of
materialization: `init_weights(model, seed)` on an ordinary (unsharded) model gives exactly the
values that the shards of every rank hold after `materialize(..., seed)`. Each call draws its own
random numbers, so the values differ from Transformers' (one generator over the whole model) but
follow the same rules, hence the same distributions.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

Rule = Callable[[nn.Module], None]
_DATA_GETTER = torch.Tensor.data.__get__


def module_seed(seed: int, module_name: str) -> int:
    """A per-module seed that is the same in every process (unlike Python's salted `hash`)."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63)


@contextlib.contextmanager
def _seeded(seed: int, name: str, device: torch.device) -> Iterator[None]:
    """Run with the global RNG seeded for this module, restoring the caller's RNG state after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(module_seed(seed, name))
        yield


# ---------------------------------------------------------------------------------------------- tensors
def _own_tensors(module: nn.Module) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """(table, key, tensor) for each parameter and buffer `module` holds directly."""
    for table in (module._parameters, module._buffers):
        for key, tensor in list(table.items()):
            if tensor is not None:
                yield table, key, tensor


class _Tensors:
    """The tensors to initialize (by id), each written only through its first name's slot."""

    def __init__(self, model: nn.Module, tensors: Iterable[torch.Tensor], shapes: Mapping[int, tuple]):
        self.by_id = {id(t): t for t in tensors}
        self.shapes = shapes
        self.names: dict[int, str] = {}
        self.slots: dict[int, tuple[int, str]] = {}  # id -> (id of the owning module, key)
        for name, tensor in chain(model.named_parameters(), model.named_buffers()):
            if id(tensor) in self.by_id and id(tensor) not in self.names:
                owner, _, key = name.rpartition(".")
                self.names[id(tensor)] = name
                self.slots[id(tensor)] = (id(model.get_submodule(owner)), key)

    def under(self, module: nn.Module) -> list[int]:
        """The tensors whose first slot lies in `module`'s subtree."""
        return [
            id(t)
            for sub in module.modules()
            for _, key, t in _own_tensors(sub)
            if self.slots.get(id(t)) == (id(sub), key)
        ]

    def owned_by(self, module: nn.Module) -> list[int]:
        """The tensors whose first slot is `module`'s own."""
        return [id(t) for _, key, t in _own_tensors(module) if self.slots.get(id(t)) == (id(module), key)]

    def blank(self, tid: int, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor like `tid` (a parameter cut by tensor slicing at its whole shape)."""
        like = self.by_id[tid]
        return _kind_of(like, torch.empty(self.shapes.get(tid, like.shape), dtype=like.dtype, device=device))


def _kind_of(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as a parameter if `like` is one (rules test `isinstance(..., nn.Parameter)`), else as is."""
    return nn.Parameter(value, requires_grad=like.requires_grad) if isinstance(like, nn.Parameter) else value


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return _kind_of(tensor, torch.empty_like(tensor, device="meta"))


class _SlotReplaced(ValueError):
    """A rule assigned a new tensor to a slot instead of writing the one it found."""


@contextlib.contextmanager
def _installed(module: nn.Module, working: Mapping[int, torch.Tensor], tensors: _Tensors) -> Iterator[None]:
    """`module`'s subtree as one rule call sees it: each tensor of `working` in its first slot, every
    other real tensor replaced by a meta stand-in (so that the rule can write nothing else)."""
    saved = []
    for sub in module.modules():
        for table, key, tensor in _own_tensors(sub):
            if id(tensor) in working and tensors.slots[id(tensor)] == (id(sub), key):
                table[key] = working[id(tensor)]
            elif not tensor.is_meta:
                table[key] = _meta_like(tensor)
            else:
                continue
            saved.append((table, key, tensor, table[key]))
    try:
        yield
    finally:
        replaced = []
        for table, key, tensor, installed in reversed(saved):
            if table[key] is not installed:
                replaced.append(key)
            table[key] = tensor
    if replaced:
        # The value would be lost on restoring the slot; Transformers' rules write in place (`init.*`).
        raise _SlotReplaced(
            f"the initializer of {type(module).__name__} replaced {sorted(set(replaced))} with new tensors "
            "instead of writing them in place (e.g. with torch.nn.init): meta-device materialization "
            "cannot follow it"
        )


class _DataReads(TorchFunctionMode):
    """Records the tensors whose `.data` a rule takes: writes through it bypass the version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == _DATA_GETTER and args:
            self.ids.add(id(args[0]))
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------- the calls
@dataclass(frozen=True)
class _Call:
    name: str
    module: nn.Module
    rule: Rule
    writes: tuple[int, ...]  # ids of the tensors it writes
    # A rule the meta probe could not run: its own tensors only, each checked to be written (a blank
    # left as it was would be uninitialized memory handed on as a value).
    checked: bool = False


def _model_rule(module: nn.Module) -> Rule | None:
    rule = getattr(module, "_init_weights", None)
    return rule if callable(rule) else None


@dataclass(frozen=True)
class _Scope:
    """The rule a module gets (its nearest enclosing model's) and whether that model skips the modules
    owning nothing to initialize (custom code, or a model without _init_weights: reset_parameters)."""

    rule: Rule
    owners_only: bool


def _scope_of(model: nn.Module, outer: _Scope | None) -> _Scope:
    rule = _model_rule(model)
    if rule is None:
        return outer if outer is not None else _Scope(_reset, owners_only=True)
    is_custom_code = getattr(model, "is_custom_code", None)
    # Transformers skips, in custom code, the modules whose own tensors are all initialized already.
    return _Scope(rule, owners_only=callable(is_custom_code) and bool(is_custom_code()))


def _post_order(
    module: nn.Module, scope: _Scope, name: str = "", seen: set[int] | None = None
) -> Iterator[tuple[str, nn.Module, _Scope]]:
    """Every module once, children first, with the scope of its nearest enclosing model, as
    Transformers' `smart_apply` visits them (a shared module under the name it is first reached by)."""
    seen = set() if seen is None else seen
    seen.add(id(module))
    for child_name, child in module.named_children():
        if id(child) not in seen:
            child_name = f"{name}.{child_name}" if name else child_name
            yield from _post_order(child, _scope_of(child, scope), child_name, seen)
    yield name, module, scope


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def _candidate_calls(model: nn.Module, wanted: set[int]) -> Iterator[tuple[str, nn.Module, Rule]]:
    """The rule calls Transformers' `initialize_weights` makes (or `reset_parameters()` of each module
    owning a wanted tensor, where no enclosing model has `_init_weights`)."""
    for name, module, scope in _post_order(model, _scope_of(model, None)):
        owns = [t for _, _, t in _own_tensors(module) if id(t) in wanted]
        if scope.owners_only and not owns:
            continue
        if scope.rule is _reset and not hasattr(module, "reset_parameters"):
            if any(isinstance(t, nn.Parameter) for t in owns):
                raise ValueError(
                    f"cannot initialise {type(module).__name__} ({name or 'the model'}): it has parameters but no "
                    "reset_parameters(), and no enclosing model has _init_weights()"
                )
            continue  # buffers only: refused below as written by nothing
        yield name, module, scope.rule


def _probe(module: nn.Module, rule: Rule, tensors: _Tensors) -> tuple[tuple[int, ...], bool]:
    """The tensors `rule(module)` writes, found by running it on meta stand-ins, and whether they must
    be checked after the real call (a rule that cannot run on meta: its own tensors, as a rule
    initializes its module's own, each checked to be written)."""
    stand_ins = {tid: tensors.blank(tid, torch.device("meta")) for tid in tensors.under(module)}
    reads = _DataReads()
    try:
        with (
            _installed(module, stand_ins, tensors),
            torch.random.fork_rng(devices=[]),
            torch.no_grad(),
            reads,
        ):
            rule(module)
    except _SlotReplaced:
        raise
    except Exception as error:  # a rule that needs values cannot run on meta
        logger.warning(
            "the initializer of %s does not run on meta tensors (%s): it is given its own tensors only, and "
            "what it writes elsewhere is not followed",
            type(module).__name__, error,
        )  # fmt: skip
        return tuple(tensors.owned_by(module)), True
    return tuple(tid for tid, s in stand_ins.items() if s._version > 0 or id(s) in reads.ids), False


def _plan(model: nn.Module, tensors: _Tensors, wanted: set[int]) -> list[_Call]:
    """The calls that write a wanted tensor, each with every tensor it writes."""
    calls = []
    for name, module, rule in _candidate_calls(model, wanted):
        writes, checked = _probe(module, rule, tensors)
        if any(tid in wanted for tid in writes):
            calls.append(_Call(name, module, rule, writes, checked))
    return calls


def _run(
    calls: list[_Call],
    tensors: _Tensors,
    wanted: set[int],
    seed: int,
    device_of: Callable[[torch.Tensor], torch.device],
    finish: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Make the calls on real tensors; `finish(tensor, value)` each wanted one after its last writer.
    Tensors a call writes beside the wanted ones get blanks, dropped after it: a rule draws the same
    random numbers whatever is wanted."""
    last = {tid: index for index, call in enumerate(calls) for tid in call.writes}
    pending: dict[int, torch.Tensor] = {}
    for index, call in enumerate(calls):
        working = {
            tid: pending.pop(tid) if tid in pending else tensors.blank(tid, device_of(tensors.by_id[tid]))
            for tid in call.writes
        }
        device = next(iter(working.values())).device
        if call.checked:
            _mark_unwritten(working)
        with _installed(call.module, working, tensors), _seeded(seed, call.name, device), torch.no_grad():
            call.rule(call.module)
        if call.checked:
            _refuse_still_marked(call, working, tensors)
        for tid, value in working.items():
            if tid in wanted and last[tid] == index:
                finish(tensors.by_id[tid], value.detach())
            elif tid in wanted:
                pending[tid] = value


def _mark_unwritten(working: Mapping[int, torch.Tensor]) -> None:
    with torch.no_grad():
        for value in working.values():
            if value.is_floating_point():
                value.fill_(float("nan"))


def _refuse_still_marked(call: _Call, working: Mapping[int, torch.Tensor], tensors: _Tensors) -> None:
    """ValueError naming the floating tensors a checked call left as `_mark_unwritten` made them."""
    left = [tensors.names[tid] for tid, v in working.items() if v.is_floating_point() and v.isnan().all()]
    if left:
        raise ValueError(
            f"the initializer of {type(call.module).__name__} ({call.name or 'the model'}) does not run on meta "
            f"tensors and leaves {left} unwritten: build the model on a real device, or initialize them in it"
        )


# ---------------------------------------------------------------------------------------------- entry points
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise an ordinary model's parameters in place, with per-module seeds (see [Note: seeded
    initialization]); parameters no rule writes keep their values."""
    parameters = list(model.parameters())
    tensors = _Tensors(model, parameters, {})
    wanted = set(tensors.by_id)

    def finish(param: torch.Tensor, value: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(value)

    _run(_plan(model, tensors, wanted), tensors, wanted, seed, lambda t: t.device, finish)


def materialize(
    model: nn.Module,
    seed: int,
    device: torch.device,
    sink: Callable[[nn.Parameter, torch.Tensor], None],
    only: Collection[int] | None = None,
    whole_shapes: Mapping[int, tuple[int, ...]] | None = None,
) -> None:
    """Give `sink(parameter, full_value)` every meta parameter's initial value, and every meta buffer
    its value in place (kept whole, on `device`), one rule call at a time.

    The parameter objects stay meta (and stay the ones the optimizer holds); `sink` decides what
    this rank keeps. `only` (tensor ids) limits it to those parameters and buffers, e.g. the ones a
    checkpoint lacks, initialized as Transformers initializes the keys `from_pretrained` finds
    missing. `whole_shapes` (parameter id: shape) initialises a parameter cut for tensor slicing at
    its whole shape, so that `sink` gets the whole value (and keeps its slice of it) and every layout
    starts from the same weights. A meta tensor that no rule writes is an error naming it.
    """
    meta = [t for t in chain(model.parameters(), model.buffers()) if t.is_meta]
    tensors = _Tensors(model, meta, whole_shapes or {})
    wanted = set(tensors.by_id) if only is None else set(tensors.by_id) & set(only)
    calls = _plan(model, tensors, wanted)
    _refuse_unwritten(tensors, wanted, calls)

    def finish(tensor: torch.Tensor, value: torch.Tensor) -> None:
        if isinstance(tensor, nn.Parameter):
            sink(tensor, value)
        else:  # a buffer: the same on every rank, kept whole in place
            torch.utils.swap_tensors(tensor, value)

    _run(calls, tensors, wanted, seed, lambda _: device, finish)


def _refuse_unwritten(tensors: _Tensors, wanted: set[int], calls: list[_Call]) -> None:
    written = {tid for call in calls for tid in call.writes}
    unwritten = sorted(tensors.names[tid] for tid in wanted - written)
    if unwritten:
        listed = ", ".join(unwritten[:5]) + (f", ... ({len(unwritten)} in all)" if len(unwritten) > 5 else "")
        raise ValueError(
            f"no initializer gives these meta-device tensors a value: {listed}. The model's _init_weights "
            "(or the module's reset_parameters()) must write them, or build the model with them on a real "
            "device"
        )
