"""Megatron-style tensor slicing of TNLG, on plain tensors (no DTensor), for training under ZeRO.

The plan is the one the model declares the Transformers way (`TNLGConfig.base_model_tp_plan`, plus
`TNLGForCausalLM._tp_plan` for the head), so `from_pretrained(path, tp_plan="auto")` (Transformers'
DTensor path, inference) and `apply_tensor_parallel` (ours, training) cut the same parameters alike.

`apply_tensor_parallel(model, group)` cuts a model holding full weights in place:

- column-parallel linear (`colwise`, `packed_colwise_qkv`): weight and bias cut by output rows; the
  input goes through `f` (identity forward, gradient all-reduced backward), the output stays local.
- row-parallel linear (`rowwise`): weight cut by input columns; the local product goes through `g`
  (all-reduce forward, identity backward); the bias, replicated, is added once after it.
- vocabulary-parallel embedding (`embedding_rowwise`): rank r holds rows [r V/t, (r+1) V/t); ids
  outside are looked up as 0, zeroed, and the partial embeddings all-reduced (`g`). An id outside the
  whole vocabulary is an error, as for `nn.Embedding` ([Note: ids outside the vocabulary]).
- the head (`colwise_gather_output`): the tied embedding rows; called as a module it all-gathers the
  logits over the vocabulary (full (B, T, V), what generation reads), while the model's loss uses the
  local logits (B, T, V/t) and `vocab_parallel_cross_entropy`, which never gathers them.

Parameters keep their identity (`param.data` is replaced by the local slice), so an optimizer built
before still holds them; the modules become subclasses of their own class (`isinstance` still holds,
state-dict names do not change). Replicated parameters (LayerNorms, positions, row-parallel biases)
get identical gradients on every tensor rank, by construction of `f` and `g`.

[Note: dropout under tensor slicing] Dropout needs the same mask on every tensor rank in the
replicated regions (embedding, residual stream after the row-parallel all-reduces) and different masks
in the sliced one (the attention probabilities: each rank holds different heads). Replicated regions
draw from the default generators, which must therefore be in the same state on every rank of a tensor
group (seed them alike: same seed, or seed + data-parallel rank); a training forward with dropout > 0
checks that with one small all-gather and raises `ValueError` otherwise. The sliced region
(`sliced_region_rng`) draws one seed from the default CPU generator (so that stream advances alike on
every rank), then runs under a forked RNG seeded with it plus an offset per tensor rank, as Megatron's
model-parallel RNG tracker does. Activation checkpointing restores the default generators before it
recomputes, so the recomputed masks are the same.

[Note: ids outside the vocabulary]
Cut by vocabulary, every rank sees most ids as someone else's: the embedding zeroes them and the loss
takes the target's logit as 0 from the ranks that do not own it. An id (or a label other than
`ignore_index`) that no rank owns would thus embed as a zero vector, or train on a logit of 0, where
the unsliced `nn.Embedding` and `F.cross_entropy` raise. Both check the range with
`torch._assert_async`: eager on the CPU it raises at once (RuntimeError); on CUDA it is a device-side
assert, as `F.cross_entropy`'s own, so the hot path gains no host synchronisation per step; and Dynamo
traces it into the graph (checked under `fullgraph=True`), so the compiled loss gains no graph break.
An `if bool(...)` test would do neither.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

IGNORE_INDEX = -100

# Styles of the declared plan that `apply_tensor_parallel` knows: (kind, parts of the packed rows).
_STYLES: dict[str, tuple[str, int]] = {
    "colwise": ("column", 1),
    "packed_colwise_qkv": ("column", 3),
    "colwise_gather_output": ("column_gather", 1),
    "colwise_rep": ("column_gather", 1),
    "rowwise": ("row", 1),
    "embedding_rowwise": ("embedding", 1),
}


@dataclass(frozen=True)
class TensorSlice:
    """How one parameter is cut across the tensor-parallel group.

    `parts` is 1, or 3 for the fused QKV: its rows are blocks [q; k; v], and each block is cut alike
    (rank r holds rows r of q, r of k and r of v, i.e. whole heads of each), not the rows as one run.
    """

    dim: int  # the dimension cut
    parts: int  # 1, or 3 for the fused QKV
    degree: int  # tensor-parallel size
    rank: int  # this rank in the tensor group

    def __post_init__(self) -> None:
        if self.parts not in (1, 3) or self.degree < 1 or not 0 <= self.rank < self.degree:
            raise ValueError(f"invalid {self}: parts is 1 or 3, and 0 <= rank < degree")

    def _check(self, size: int, what: str) -> None:
        if size % (self.parts * self.degree):
            raise ValueError(
                f"{what}: dimension {self.dim} of size {size} does not split into {self.parts} "
                f"part(s) x {self.degree} ranks"
            )

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full` (a new contiguous tensor)."""
        self._check(full.shape[self.dim], f"slicing a tensor of shape {tuple(full.shape)}")
        blocks = full.chunk(self.parts, dim=self.dim)
        mine = [block.chunk(self.degree, dim=self.dim)[self.rank] for block in blocks]
        return torch.cat(mine, dim=self.dim).contiguous()

    def full_shape(self, local_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.degree
        return tuple(shape)

    def assemble(self, slices: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order (the inverse of `local`)."""
        if len(slices) != self.degree:
            raise ValueError(f"assemble needs {self.degree} slices (one per tensor rank), got {len(slices)}")
        per_rank = [s.chunk(self.parts, dim=self.dim) for s in slices]  # [rank][part]
        blocks = [
            torch.cat([per_rank[r][p] for r in range(self.degree)], dim=self.dim) for p in range(self.parts)
        ]
        return torch.cat(blocks, dim=self.dim)


# ---------------------------------------------------------------------------------------------------
# Megatron's conjugate operators f (copy to the tensor region) and g (reduce from it), and the gather.


class _CopyToTensorRegion(torch.autograd.Function):
    """f: identity forward; backward all-reduces the input gradient (each rank saw part of the outputs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorRegion(torch.autograd.Function):
    """g: all-reduce forward (sum of partial results); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather over the last dimension in rank order; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def copy_to_tensor_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTensorRegion.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherLastDim.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits cut over the vocabulary, without gathering them.

    Forward: global max (all-reduce MAX), global sum of exp (all-reduce SUM), and the target's logit
    from the rank owning it (all-reduce SUM). Backward: softmax - onehot, locally. Tokens labelled
    `ignore_index` get loss 0 and no gradient.
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup, ignore_index: int
    ) -> torch.Tensor:
        # logits (N, V/t) local, target (N,) global ids
        width = logits.shape[-1]
        start = dist.get_rank(group) * width
        logits32 = logits.float()
        top = logits32.max(dim=-1).values  # (N,)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits32 - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)  # (N,)
        dist.all_reduce(total, group=group)
        valid = target != ignore_index
        index = target - start
        owned = valid & (index >= 0) & (index < width)
        index = torch.where(owned, index, torch.zeros_like(index))
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * owned  # (N,)
        dist.all_reduce(picked, group=group)
        loss = (total.log() - picked) * valid
        exp.div_(total.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, index, owned, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, index, owned, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, index] -= owned.to(grad.dtype)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token loss (N,) of local logits (N, V/t); `ignore_index` targets give 0; a target outside
    [0, V) raises ([Note: ids outside the vocabulary])."""
    vocab = logits.shape[-1] * dist.get_world_size(group)
    _assert_in_vocabulary(target, vocab, "label", ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)


def _assert_in_vocabulary(ids: torch.Tensor, vocab: int, what: str, ignore_index: int | None = None) -> None:
    """Raise (or, on CUDA, assert on the device) unless every id is in [0, `vocab`) or `ignore_index`.
    [Note: ids outside the vocabulary]"""
    inside = (ids >= 0) & (ids < vocab)
    if ignore_index is not None:
        inside |= ids == ignore_index
    ignored = "" if ignore_index is None else f" (other than the ignored {ignore_index})"
    torch._assert_async(inside.all(), f"a {what}{ignored} is outside the vocabulary of {vocab} ids")


def vocab_parallel_causal_lm_loss(
    head: nn.Module,
    hidden_states: torch.Tensor,  # (B, T, H), replicated over the tensor group
    labels: torch.Tensor,  # (B, T); ignore_index = no loss; shifted here
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,  # (B, T), already shifted: used instead of labels
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The causal-LM loss of a head cut by `apply_tensor_parallel`, with the keywords of Transformers'
    `ForCausalLMLoss` and reduced as it does: sum over tokens / `num_items_in_batch` when given, else
    the mean over tokens not ignored. Only local logits (B, T, V/t) are made."""
    group = head.tp_group
    hidden = copy_to_tensor_region(hidden_states, group)
    logits = nn.functional.linear(hidden, head.weight, head.bias)  # (B, T, V/t)
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # t predicts t + 1
    target = shift_labels.reshape(-1).to(logits.device)
    losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target, group, ignore_index)
    if num_items_in_batch is None:
        return losses.sum() / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(losses.device)
    return losses.sum() / num_items_in_batch


# ---------------------------------------------------------------------------------------------------
# The sliced modules: subclasses made at apply time of each module's own class.


class _TensorParallelModule:
    tp_group: dist.ProcessGroup
    tp_degree: int
    tp_rank: int


class _ColumnParallel(_TensorParallelModule):
    """Linear cut by output rows; the output stays local unless `tp_gather_output`."""

    tp_gather_output: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(copy_to_tensor_region(x, self.tp_group), self.weight, self.bias)
        return gather_last_dim(out, self.tp_group) if self.tp_gather_output else out


class _RowParallel(_TensorParallelModule):
    """Linear cut by input columns; partial products summed, then the replicated bias added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tensor_region(nn.functional.linear(x, self.weight), self.tp_group)
        return out if self.bias is None else out + self.bias


class _VocabParallelEmbedding(_TensorParallelModule):
    """Embedding cut by vocabulary rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        _assert_in_vocabulary(ids, rows * self.tp_degree, "token id")  # else a silent zero vector
        local = ids - self.tp_rank * rows
        outside = (local < 0) | (local >= rows)
        found = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, H)
        return reduce_from_tensor_region(found.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_group)


_KIND_MIXIN = {
    "column": _ColumnParallel,
    "column_gather": _ColumnParallel,
    "row": _RowParallel,
    "embedding": _VocabParallelEmbedding,
}


@functools.cache
def _sliced_class(mixin: type, base: type) -> type:
    return type(f"TensorParallel{base.__name__}", (mixin, base), {"__module__": base.__module__})


def tensor_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The tensor group a module was cut for by `apply_tensor_parallel`, or None."""
    return module.tp_group if isinstance(module, _TensorParallelModule) else None


def is_sliced(model: nn.Module) -> bool:
    """Whether `apply_tensor_parallel` has cut any module of `model`."""
    return any(isinstance(m, _TensorParallelModule) for m in model.modules())


_SLICED_SEED_STRIDE = 1_000_003  # a prime: rank r's sliced-region seed is seed + r * stride


def check_rng_in_sync(module: nn.Module, device: torch.device) -> None:
    """Raise `ValueError` unless the default generator that drops out on `device` (CUDA's there, the
    CPU's otherwise) is in the same state on every rank of `module`'s tensor group.
    [Note: dropout under tensor slicing]"""
    group = module.tp_group
    cuda = device.type == "cuda"
    nccl = dist.get_backend(group) == "nccl"
    if nccl and not cuda:
        return  # a CPU model on an NCCL group cannot compare (NCCL moves CUDA tensors only)
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    state = state.to(device) if nccl else state  # gloo gathers CPU tensors
    states = [torch.empty_like(state) for _ in range(module.tp_degree)]
    dist.all_gather(states, state, group=group)
    if any(not torch.equal(other, states[0]) for other in states[1:]):
        raise ValueError(
            "dropout under tensor slicing needs the default RNG in the same state on every rank of a tensor "
            "group (the replicated activations must draw the same masks): seed those ranks alike"
        )


@contextlib.contextmanager
def sliced_region_rng(module: nn.Module, device: torch.device):
    """Run the body (a dropout over this rank's heads) under an RNG of its own per tensor rank, while
    the default generators advance alike on every rank. [Note: dropout under tensor slicing]"""
    seed = int(torch.randint(0, 2**62, ()))  # from the default CPU generator: the same on every rank
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed + module.tp_rank * _SLICED_SEED_STRIDE)
        else:
            torch.default_generator.manual_seed(seed + module.tp_rank * _SLICED_SEED_STRIDE)
        yield


# ---------------------------------------------------------------------------------------------------
# The plan and its application.


def _wildcard(name: str) -> str:
    """`layers.3.mlp.fc_in` -> `layers.*.mlp.fc_in`, the plan's key syntax (`*` for indices only)."""
    return re.sub(r"(?:(?<=\.)|^)\d+(?=\.|$)", "*", name)


def declared_plan(model: nn.Module) -> dict[str, str]:
    """{module name pattern in `model`: style}: the config's `base_model_tp_plan` under the base
    model's prefix, plus every `_tp_plan` a module class declares (the head's)."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        prefix = f"{_wildcard(name)}." if name else ""
        if module is getattr(module, "base_model", None) and config is not None:
            plan.update({prefix + k: v for k, v in (type(config).base_model_tp_plan or {}).items()})
        if isinstance(module, nn.Module) and hasattr(type(module), "_tp_plan") and config is not None:
            plan.update({prefix + k: v for k, v in (getattr(type(module), "_tp_plan", None) or {}).items()})
    return plan


def _plan_targets(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, style) for every module of `model` its declared plan cuts."""
    plan = declared_plan(model)
    targets = [
        (name, module, plan[_wildcard(name)])
        for name, module in model.named_modules()
        # A module another pipeline stage holds is a placeholder here (modeling/pipeline.py).
        if _wildcard(name) in plan and not getattr(module, "held_by_other_stage", False)
    ]
    if not targets:
        raise ValueError(
            "apply_tensor_parallel: no module of this model matches its tensor-parallel plan; apply it to "
            "the whole model (a PreTrainedModel whose config declares base_model_tp_plan)"
        )
    unknown = sorted({style for style in plan.values() if style not in _STYLES})
    if unknown:
        raise ValueError(
            f"apply_tensor_parallel: plan styles {unknown} are not supported; known: {sorted(_STYLES)}"
        )
    return targets


def _cuts(
    model: nn.Module, targets: list[tuple[str, nn.Module, str]], degree: int, rank: int
) -> dict[str, TensorSlice]:
    """{parameter name: slice} of every parameter the targets cut (column-parallel: the weight's rows and
    the bias; row-parallel: the weight's columns). A tied parameter appears once, under its first name;
    cut two different ways, or a plan entry without a weight, raises."""
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters: their first name
    slices: dict[str, TensorSlice] = {}
    for name, module, style in targets:
        kind, parts = _STYLES[style]
        if not isinstance(getattr(module, "weight", None), nn.Parameter):
            raise ValueError(
                f"apply_tensor_parallel: plan entry {name!r} ({style}) is not a module with a weight"
            )
        dims = {"weight": 1 if kind == "row" else 0}
        if kind in ("column", "column_gather") and getattr(module, "bias", None) is not None:
            dims["bias"] = 0
        for attr, dim in dims.items():
            key, cut = (
                names[id(getattr(module, attr))],
                TensorSlice(dim=dim, parts=parts, degree=degree, rank=rank),
            )
            if slices.setdefault(key, cut) != cut:
                raise ValueError(f"apply_tensor_parallel: tied parameter {key} is cut two different ways")
    _refuse_a_cut_seen_whole(model, targets, slices, names)
    return slices


def _refuse_a_cut_seen_whole(
    model: nn.Module, targets: list[tuple[str, nn.Module, str]], slices: dict[str, TensorSlice], names: dict
) -> None:
    """ValueError when a parameter the plan cuts is also held by a module the plan leaves whole: a tied
    embedding under a sliced head (Transformers' Llama with tie_word_embeddings declares only the head)
    would look up ids in this rank's rows as if they were the whole vocabulary, silently."""
    cut_by = {
        id(param): (name, style)
        for name, module, style in targets
        for param in module.parameters(recurse=False)
        if names[id(param)] in slices
    }
    targeted = {id(module) for _, module, _ in targets}
    for name, module in model.named_modules():
        if id(module) in targeted or getattr(module, "held_by_other_stage", False):
            continue  # a module another pipeline stage holds is a placeholder here (modeling/pipeline.py)
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in cut_by:
                owner, style = cut_by[id(param)]
                raise ValueError(
                    f"apply_tensor_parallel: {name}.{attr} is the parameter the plan cuts for {owner!r} ({style}), "
                    f"but the plan leaves {name!r} whole: it would read this rank's slice as the whole tensor. "
                    f"Declare {name!r} in the plan (e.g. embedding_rowwise for a tied embedding), or untie it "
                    "(tie_word_embeddings=False)"
                )


def plan_slices(model: nn.Module, degree: int, rank: int = 0) -> dict[str, TensorSlice]:
    """{parameter name: slice} that `apply_tensor_parallel` cuts for tensor rank `rank` of `degree`, without
    a process group or any change to `model` (which may be on the meta device): what a memory plan of
    one rank's shards needs."""
    return _cuts(model, _plan_targets(model), degree, rank)


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup) -> dict[str, TensorSlice]:
    """Cut `model` in place for the tensor group `group`, following its declared plan. Returns {parameter
    name: slice} for every cut parameter; the others are replicated (same values on every tensor rank).
    Parameters stay the same `nn.Parameter`s. A model on the meta device is cut in shape only: its values
    come later (the ZeRO engine initializes whole tensors and keeps this rank's slices, so every layout
    starts from the same weights). Applying twice is an error."""
    if is_sliced(model):
        raise RuntimeError("apply_tensor_parallel: this model is already cut for tensor parallelism")
    targets = _plan_targets(model)
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "check_tensor_parallel"):
        config.check_tensor_parallel(degree)
    elif config is not None:
        _check_whole_heads(config, degree)

    slices = _cuts(model, targets, degree, rank)
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for key, cut in slices.items():
            parameters[key].data = cut.local(parameters[key].data)
    for _, module, style in targets:
        kind = _STYLES[style][0]
        module.__class__ = _sliced_class(_KIND_MIXIN[kind], type(module))
        module.tp_group, module.tp_degree, module.tp_rank = group, degree, rank
        if kind == "column_gather":
            module.tp_gather_output = True
    model._tnlg_tensor_slices = dict(slices)
    return slices


def _check_whole_heads(config: Any, degree: int) -> None:
    """ValueError when a Transformers config's attention heads do not divide into `degree` slices: the
    projections' rows would still divide (1 key/value head of 16 rows cuts into 8 + 8), and the first
    forward would fail reshaping half a head, naming neither the heads nor the degree."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % degree:
            raise ValueError(
                f"apply_tensor_parallel: {field} = {heads} does not divide into {degree} tensor slices: each "
                f"slice would hold part of a head; use a tensor degree that divides {heads}"
            )


def tensor_slices(model: nn.Module) -> dict[str, TensorSlice]:
    """What `apply_tensor_parallel(model, ...)` recorded (empty if it was not applied)."""
    return dict(getattr(model, "_tnlg_tensor_slices", {}))


# ---------------------------------------------------------------------------------------------------
# Transformers' side: the packed QKV style for `from_pretrained(tp_plan="auto")`.


def register_transformers_styles() -> None:
    """Register "packed_colwise_qkv" in Transformers' `ALL_PARALLEL_STYLES` (5.17 and later).

    Transformers' own `packed_colwise` splits in 2 blocks (gate/up) and cuts a 1-D bias contiguously,
    which mixes q, k and v rows of the bias: this one cuts weight and bias as 3 blocks alike.
    """
    try:
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, PackedColwiseParallel
    except ImportError:  # torch without distributed, or a Transformers without the DTensor TP path
        return

    class PackedColwiseQKV(PackedColwiseParallel):
        # Transformers 5.25 passes `config=` and `mesh_manager=` too (keywords this cut needs not); 5.17
        # passes neither: accepting any keyword keeps one signature across the supported range.
        def shard_param(self, module, param, mesh, **_keywords):
            meta = module._parameters.get(param)
            if meta is None:
                return
            placement = _StridedShard(dim=0, split_factor=self.split_factor)  # weight rows and bias alike
            module._parameters[param] = nn.Parameter(
                distribute_tensor(meta, mesh, [placement], src_data_rank=None),
                requires_grad=meta.requires_grad,
            )

    ALL_PARALLEL_STYLES.register("packed_colwise_qkv", PackedColwiseQKV(split_factor=3))


register_transformers_styles()
