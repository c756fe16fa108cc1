"""Pipeline stages of TNLG: which layers each stage holds, and a stage's forward and loss.

[Note: pipeline split]
A model of L layers cut into S stages gives each stage a contiguous run of layers, as evenly as S
divides L (`stage_layers`); the token and position embeddings go with the first stage, the final
LayerNorm, the output layer and the loss with the last. Where S does not divide L, the extra layers go
to the stages between first and last, which carry neither the embeddings nor the head.

`split_pipeline(model, stages, num_stages)` cuts a `TNLGForCausalLM` in place for the stages one rank
holds (one, or several with interleaved schedules: rank r of p holds stages r, r + p, ...); the model
declares it as its `split_pipeline` method, the hook an engine calls. What the rank does not hold is
replaced by a `DroppedModule` without parameters, so the state-dict names of what stays are those of
the whole model (`model.layers.17.mlp.fc_in.weight` on whichever stage holds layer 17): checkpoints and
consolidation need no renaming across layouts.

With tied word embeddings the last stage keeps the token embedding too, as the weight of its output
layer: first and last stage then hold the same parameter under the same name, and `PipelineSplit.shared`
says so, so that whoever trains the stages sums its gradient over them (Megatron's embedding group)
and counts it once in the gradient norm.

The stage modules take and return plain tensors, as `torch.distributed.pipelining` sends them: the
first stage takes the token ids, every other stage the hidden states (B, T, H) of the one before; the
last stage returns its final hidden states, and `PipelineSplit.loss(hidden, labels)` is the causal-LM
loss on them (vocabulary-parallel under tensor slicing, as the whole model's). Position ids, when given,
reach every stage as a keyword argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import tensor_parallel
from .configuration_tnlg import has_dropout
from .transformers_compat import causal_mask


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The layers of each of `num_stages` stages (see [Note: pipeline split]); ValueError when a stage
    would get none."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages need at least one layer each, but the model has {num_layers} layers"
        )
    sizes = [num_layers // num_stages] * num_stages
    inner, outer = list(range(1, num_stages - 1)), [0, num_stages - 1][: min(num_stages, 2)]
    for stage in (inner + outer)[: num_layers % num_stages]:
        sizes[stage] += 1
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


class DroppedModule(nn.Module):
    """What a pipeline stage holds in place of a module another stage holds: nothing, and an error if
    called (the whole model's forward cannot run on one stage's rank)."""

    held_by_other_stage = True  # read by the tensor-parallel plan, which skips it

    def __init__(self, name: str, stages: list[int]):
        super().__init__()
        self.dropped_name = name
        self.held_stages = stages

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"{self.dropped_name} is not on this rank: it holds pipeline stages {self.held_stages} only; train "
            "through engine.train_batch, or consolidate the model (engine.full_state_dict) to run it whole"
        )


@dataclass
class PipelineSplit:
    """What `split_pipeline` made of a model: this rank's stage modules (in stage order), their stage
    indices, the loss the last stage computes, and the parameters more than one stage holds
    ({name: stage indices}: the tied embedding)."""

    stages: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shared: dict[str, list[int]]
    layers: list[range]
    hidden_size: int  # what the stages send each other: (batch, length, hidden_size)
    max_positions: int  # the longest sequence they take
    # What the first stage's embedding and the last stage's loss take: token ids and labels in
    # [0, vocab_size), labels also `ignore_index` (no loss). Declared so that an engine can refuse a bad
    # value before a schedule starts, where only one stage would meet it and the others would wait.
    vocab_size: int
    ignore_index: int | None = tensor_parallel.IGNORE_INDEX


class TNLGPipelineStage(nn.Module):
    """One stage's forward over modules of the (cut) model; it owns none of them (the model does)."""

    def __init__(self, causal_lm: nn.Module, index: int, num_stages: int, layers: range):
        super().__init__()
        object.__setattr__(self, "causal_lm", causal_lm)  # not a submodule: the model owns the weights
        self.index, self.num_stages, self.layers = index, num_stages, layers

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def checks_before_schedule(self) -> bool:
        """Whether `schedule_problem` checks anything: training with dropout under tensor slicing, where
        the tensor ranks' generators must agree (the same on every rank of a job)."""
        sliced = tensor_parallel.tensor_group(self._sliced_module()) is not None
        return self.causal_lm.training and sliced and has_dropout(self.causal_lm.config)

    def schedule_problem(self) -> str | None:
        """Why this stage cannot run a training schedule now, or None: its tensor group's default
        generators out of step ([Note: dropout under tensor slicing] in tensor_parallel.py). Collective
        over the tensor group; the caller agrees on the verdict with the other stages."""
        module = self._sliced_module()
        try:
            tensor_parallel.check_rng_in_sync(module, next(module.parameters()).device)
        except ValueError as error:
            return f"pipeline stage {self.index}: {error}"
        return None

    def _sliced_module(self) -> nn.Module:
        """A module of this stage that tensor slicing cuts (its first layer's QKV projection)."""
        return self.causal_lm.model.layers[self.layers[0]].self_attn.qkv_proj

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        model = self.causal_lm.model
        config = model.config
        length = inputs.shape[1]
        given_positions = position_ids  # on to the mask and the blocks, as TNLGModel's forward does
        if position_ids is None:
            position_ids = torch.arange(length, device=inputs.device).unsqueeze(0)  # (1, T)
        if self.is_first:
            hidden = model.embed_tokens(inputs) + model.embed_positions(position_ids)
            hidden = model.embed_dropout(hidden)  # (B, T, H)
        else:
            hidden = inputs
        mask = causal_mask(config, hidden, attention_mask=None, cache=None, position_ids=given_positions)
        for index in self.layers:
            hidden = model.layers[index](hidden, attention_mask=mask, position_ids=given_positions)
        if self.is_last:
            hidden = model.final_layernorm(hidden)
        return hidden


def split_pipeline(model: nn.Module, stages: Sequence[int], num_stages: int) -> PipelineSplit:
    """Cut `model` (a `TNLGForCausalLM`, on any device, meta included) in place down to `stages` of
    `num_stages`; see [Note: pipeline split]."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        raise ValueError(f"split_pipeline needs a TNLGForCausalLM, got {type(model).__name__}")
    if getattr(model, "_tnlg_pipeline_split", None) is not None:
        raise RuntimeError("split_pipeline: this model is already cut into pipeline stages")
    if tensor_parallel.is_sliced(model):
        raise RuntimeError(
            "split_pipeline before apply_tensor_parallel: cut the stages first, then slice them"
        )
    stages = sorted(stages)
    if not stages or stages[0] < 0 or stages[-1] >= num_stages or len(set(stages)) != len(stages):
        raise ValueError(f"pipeline stages {stages} are not distinct stages of 0..{num_stages - 1}")
    layers = stage_layers(len(base.layers), num_stages)
    kept = {i for s in stages for i in layers[s]}
    owner = {i: s for s, run in enumerate(layers) for i in run}
    for index in range(len(base.layers)):
        if index not in kept:
            base.layers[index] = DroppedModule(f"model.layers.{index}", [owner[index]])
    first, last = 0 in stages, num_stages - 1 in stages
    tied = model.lm_head.weight is base.embed_tokens.weight
    if not first:
        base.embed_positions = DroppedModule("model.embed_positions", [0])
        if not (last and tied):  # the last stage keeps a tied embedding as its output layer's weight
            base.embed_tokens = DroppedModule("model.embed_tokens", [0])
    if not last:
        base.final_layernorm = DroppedModule("model.final_layernorm", [num_stages - 1])
        model.lm_head = DroppedModule("lm_head", [num_stages - 1])
    shared = {"model.embed_tokens.weight": [0, num_stages - 1]} if tied and num_stages > 1 else {}
    modules = [TNLGPipelineStage(model, s, num_stages, layers[s]) for s in stages]
    config = model.config
    split = PipelineSplit(
        modules,
        stages,
        num_stages,
        model.pipeline_loss,
        shared,
        layers,
        config.hidden_size,
        config.max_position_embeddings,
        config.vocab_size,
    )
    model._tnlg_pipeline_split = split
    return split


def pipeline_split(model: nn.Module) -> PipelineSplit | None:
    """What `split_pipeline(model, ...)` made (None if the model is whole)."""
    return getattr(model, "_tnlg_pipeline_split", None)
