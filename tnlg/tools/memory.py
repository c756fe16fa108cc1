"""Per-rank memory estimates for ZeRO training of TNLG models, and the smallest world size that fits.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 5): with Ψ parameters,
16-bit parameters and gradients (2 bytes each) and K = 12 bytes of fp32 master weights plus Adam's
two fp32 moments per parameter, one data-parallel rank of N holds

    stage 0: 2Ψ + 2Ψ + 12Ψ = 16Ψ        stage 2: 2Ψ + (2 + 12)Ψ/N
    stage 1: 2Ψ + 2Ψ + 12Ψ/N           stage 3: (2 + 2 + 12)Ψ/N

A sharded buffer holds ceil(Ψ/N) elements per rank (the engine pads its flat buffers so that every
rank owns an equal piece), so the division is exact whenever N divides Ψ. With `mixed_precision="no"`
parameters and gradients are fp32 and the engine still keeps a separate fp32 master copy: 4 + 4 + 4
bytes, plus the optimizer state.

With tensor slicing t and pipeline stages p (`estimate_memory(tensor_parallel=, pipeline_parallel=)`)
Ψ is what one rank holds (its pipeline stages' layers, embeddings or head, cut t ways) and N the data
degree, world / (t·p): ZeRO shards over the data ranks only, as the engine does.

On top of the model states the estimate counts activations (see `activation_bytes`) and, for stage 3,
the blocks gathered around their use (see `_stage3_gathered_elements`). Not counted: the CUDA context,
allocator fragmentation, the reduce buckets of stages 2-3, stage 3 prefetching (which may gather one
more decoder layer, bounded by `ZeroConfig.max_live_parameters`) and alignment padding: the meta-device
plan (memory_plan.py) counts these from the engine's own layout.

CPU offload is estimated as the engine places it (see [Note: offload] in sharding/offload.py):
`offload_optimizer` moves the fp32 master and optimizer state to the host, and in stages 2-3 the
gradient shard too (kept there in fp32). Stage 1 keeps its full gradients on the device and copies
the shard into a host buffer for each step, kept across steps (`host_step_grad_bytes`). Adam's
offloaded step with 16-bit parameters also keeps a 16-bit copy of the shard on the host
(`offload_copy`, see `writes_16bit_copy`). `offload_param` moves stage 3's 16-bit parameter shard to
the host.
`offload_activations` (activation checkpointing's CPU offload) moves the checkpointed blocks' inputs there.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tnlg.modeling import TNLGConfig
from tnlg.modeling.pipeline import stage_layers
from tnlg.sharding.config import ZeroConfig
from tnlg.sharding.parallel import ParallelDims, rank_stages

logger = logging.getLogger(__name__)

# Bytes of optimizer state per fp32 master element (torch.optim's fp32 state tensors).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}
# The kinds whose offloaded step the engine runs as CPUAdam (sharding/offload.py `host_adam_for`);
# any other optimizer steps the fp32 master itself.
HOST_ADAM_KINDS = ("adam", "adamw")
FP32_BYTES = 4
# The engine's default: parameters with at most this many elements stay whole on every rank in stage 3.
DEFAULT_PERSISTENCE_THRESHOLD = ZeroConfig().param_persistence_threshold
GB = 10**9  # the ZeRO paper's figures (31.4GB, 16.6GB, ...) are decimal gigabytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one data-parallel rank holds during a training step, and the setup they were estimated for.

    `params`, `grads`, `master` and `optimizer_state` are the rank's model states (the 16-bit or fp32
    compute copy, its gradients, the fp32 master weights and e.g. Adam's moments), wherever they
    live. `gathered` is stage 3's working set of whole blocks, `activations` what forward keeps for
    backward. `offload_copy` is the host's 16-bit copy of the updated shard (offloaded Adam).
    `host_grads` is the part of `grads` in host memory (offload: stages 2-3's gradient shard, stage
    1's step buffer).
    `offloaded_activations` is the part of `activations` held in host memory (checkpointing's CPU offload).
    `device_bytes` and `cpu_bytes` split the total by the offload settings. With pipeline stages, all
    of these are pipeline rank `pipeline_rank`'s of `pipeline_parallel`.
    """

    num_parameters: int
    world_size: int
    stage: int
    mixed_precision: str
    offload_optimizer: str
    offload_param: str
    params: int
    grads: int
    master: int
    optimizer_state: int
    offload_copy: int = 0
    host_grads: int = 0
    gathered: int = 0
    activations: int = 0
    offloaded_activations: int = 0
    pipeline_parallel: int = 1
    pipeline_rank: int = 0  # the pipeline rank estimated (estimate_memory's default: the worst)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_state + self.offload_copy

    @property
    def cpu_bytes(self) -> int:
        offloaded = 0
        if self.offload_optimizer == "cpu":
            offloaded += self.master + self.optimizer_state + self.offload_copy
        offloaded += self.host_grads
        offloaded += self.offloaded_activations
        return offloaded + (self.params if self.offload_param == "cpu" else 0)

    @property
    def device_bytes(self) -> int:
        return self.model_states + self.gathered + self.activations - self.cpu_bytes


def model_state_estimate(
    num_parameters: int,
    *,
    world_size: int,
    stage: int,
    mixed_precision: str = "bf16",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """The ZeRO paper's per-rank model states for `num_parameters` parameters (no activations)."""
    # The engine's own checks and messages: a stage, precision or offload the engine refuses (a bad
    # value, or offload at a stage that partitions nothing to offload) is refused here alike.
    zero = ZeroConfig(
        stage=stage,
        mixed_precision=mixed_precision,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
    )
    return _model_states(num_parameters, world_size, zero, optimizer)


def _model_states(num_parameters: int, world_size: int, zero: ZeroConfig, optimizer: str) -> MemoryEstimate:
    """`model_state_estimate` for the engine settings `zero`; the checks here are for what ZeroConfig
    does not hold."""
    _check_positive_int("num_parameters", num_parameters)
    _check_positive_int("world_size", world_size)
    _check_choice("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    stage, offload_param = zero.stage, zero.offload_param
    compute = _compute_bytes(zero.mixed_precision)
    whole = num_parameters
    shard = math.ceil(num_parameters / world_size)
    optimizer_elements = whole if stage == 0 else shard  # stage >= 1 partitions master + optimizer
    host_optimizer = zero.offload_optimizer == "cpu"
    # offloaded stages 2-3 accumulate the gradient shard on the host in fp32
    grad_bytes = FP32_BYTES if host_optimizer and stage >= 2 else compute
    grads = grad_bytes * (shard if stage >= 2 else whole)
    step_grad = host_step_grad_bytes(zero, optimizer) * shard  # stage 1: the host copy of the shard
    return MemoryEstimate(
        num_parameters=num_parameters,
        world_size=world_size,
        stage=stage,
        mixed_precision=zero.mixed_precision,
        offload_optimizer=zero.offload_optimizer,
        offload_param=offload_param,
        params=compute * (shard if stage == 3 else whole),
        grads=grads + step_grad,
        master=FP32_BYTES * optimizer_elements,
        optimizer_state=OPTIMIZER_STATE_BYTES[optimizer] * optimizer_elements,
        offload_copy=compute * shard if writes_16bit_copy(zero, optimizer) else 0,
        host_grads=(grads if host_optimizer and stage >= 2 else 0) + step_grad,
    )


def writes_16bit_copy(zero: ZeroConfig, optimizer: str) -> bool:
    """Whether the offloaded step keeps a host buffer of its own for the updated 16-bit shard
    (`offload_copy`; the engine's `_host_16bit_shard` in sharding/optimizer.py): CPUAdam writes one
    (the Adam kinds; another optimizer steps the fp32 master, cast on the device), with 16-bit
    parameters only (fp32 ones go back as the master itself), and not in stage 3 with
    `offload_param`, whose host parameter shard it writes directly. The estimate and the meta-device
    plan both ask this."""
    return (
        zero.offload_optimizer == "cpu"
        and optimizer in HOST_ADAM_KINDS
        and _compute_bytes(zero.mixed_precision) < FP32_BYTES
        and zero.offload_param != "cpu"
    )


def host_step_grad_bytes(zero: ZeroConfig, optimizer: str) -> int:
    """Bytes per shard element of the host buffer stage 1's offloaded step copies the gradient shard
    into (the engine's `FlatGroup.host_step_grad`, kept across steps, since pinning at exact size is
    costly): the compute dtype for CPUAdam (the Adam kinds), which reads gradients as they are; fp32
    for another optimizer, which steps the fp32 master. 0 without offload, and in stages 2-3, whose
    gradient shard is on the host already. The estimate and the meta-device plan both ask this."""
    if zero.offload_optimizer != "cpu" or zero.stage != 1:
        return 0
    return _compute_bytes(zero.mixed_precision) if optimizer in HOST_ADAM_KINDS else FP32_BYTES


def estimate_memory(
    config: TNLGConfig,
    *,
    world_size: int,
    stage: int,
    mixed_precision: str = "bf16",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: bool = True,
    offload_activations: bool = False,
    optimizer: str = "adamw",
    param_persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_stages: int = 1,
    pipeline_rank: int | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of model states, stage 3 gathered blocks and activations for training `config`.

    `tensor_parallel` t slices every layer across t ranks as the model's plan does (QKV, attention output,
    both MLP matrices and the token embedding / output layer cut; LayerNorms, the row-parallel biases and
    the position embedding whole on every tensor rank); activations follow Korthikanti et al.'s eq. 2.

    `pipeline_parallel` p cuts the layers into p x `virtual_stages` stages as the engine does
    (`tnlg.modeling.pipeline.stage_layers`, rank r holding stages r, r + p, ...): the first stage holds
    the embeddings, the last the final LayerNorm and output layer (with tied embeddings the embedding
    matrix too). ZeRO shards each rank's parameters over the data degree world_size / (t x p).
    Activations follow the schedule (see `activation_bytes`). `pipeline_rank` picks the rank to
    estimate; None (the default) estimates every pipeline rank and returns the one needing the most
    device memory (its `pipeline_rank` says which; the first on a tie).

    `seq_len` defaults to `config.max_position_embeddings`; `micro_batch_size` is per rank.
    `offload_activations` (with `activation_checkpointing`: the run's `model.activation_checkpointing.
    cpu_offload`) keeps the checkpointed blocks' inputs in host memory, all but the one a recomputation
    has brought back; the tensors outside the blocks come back at the start of backward and are
    counted on the device.

    Raises ValueError naming the first bad argument (the ZeRO settings with the engine's own ZeroConfig
    message, the layout with ParallelDims').
    """
    if not isinstance(config, TNLGConfig):
        raise ValueError(f"config must be a TNLGConfig, got {type(config).__name__}")
    zero = ZeroConfig(  # the engine's checks, as in `model_state_estimate`
        stage=stage,
        mixed_precision=mixed_precision,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        param_persistence_threshold=param_persistence_threshold,
    )
    degree = _check_tensor_parallel(config, tensor_parallel, world_size)
    dims = ParallelDims(tensor=degree, pipeline=pipeline_parallel, virtual_stages=virtual_stages)
    dims = dims.resolve(world_size)
    if not isinstance(offload_activations, bool):
        raise ValueError(f"offload_activations must be True or False, got {offload_activations!r}")
    if offload_activations and not activation_checkpointing:
        raise ValueError("offload_activations needs activation_checkpointing (it offloads what that keeps)")
    ranks = _pipeline_ranks(dims.pipeline, pipeline_rank)
    activation_options = {
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "compute_bytes": _compute_bytes(mixed_precision),
        "activation_checkpointing": activation_checkpointing,
    }
    estimates = [
        _estimate_rank(config, zero, dims, rank, optimizer, offload_activations, activation_options)
        for rank in ranks
    ]
    worst = max(estimates, key=lambda estimate: estimate.device_bytes)  # max keeps the first on a tie
    return replace(worst, world_size=world_size)


def _pipeline_ranks(degree: int, rank: Any) -> list[int]:
    """The pipeline ranks to estimate: `rank`, or all of them for None."""
    if rank is None:
        return list(range(degree))
    _check_int("pipeline_rank", rank, minimum=0, maximum=degree - 1)
    return [rank]


def _estimate_rank(
    config: TNLGConfig,
    zero: ZeroConfig,
    dims: ParallelDims,
    rank: int,
    optimizer: str,
    offload_activations: bool,
    activation_options: dict[str, Any],
) -> MemoryEstimate:
    """`estimate_memory` for pipeline rank `rank` of the resolved layout `dims`."""
    place = pipeline_place(config.num_hidden_layers, dims.pipeline, dims.virtual_stages, rank)
    degree = dims.tensor
    held = _rank_tensor_sizes(config, degree, place)
    states = _model_states(sum(held), dims.data, zero, optimizer)
    compute = activation_options["compute_bytes"]
    # Stage 3 gathers whole blocks into the compute dtype on the device, and autograd writes their
    # whole gradients there before they are reduce-scattered into the shard: params + grads.
    gathered = (
        2 * compute * _stage3_gathered_elements(config, zero.param_persistence_threshold, degree, place)
        if zero.stage == 3
        else 0
    )
    activations = activation_bytes(
        config,
        **activation_options,
        tensor_parallel=degree,
        pipeline_parallel=dims.pipeline,
        virtual_stages=dims.virtual_stages,
        pipeline_rank=rank,
    )
    seq_len = activation_options["seq_len"] or config.max_position_embeddings
    block_input = compute * activation_options["micro_batch_size"] * seq_len * config.hidden_size
    offloaded = (place.kept_layer_inputs - 1) * block_input if offload_activations else 0
    return replace(
        states,
        gathered=gathered,
        activations=activations,
        offloaded_activations=offloaded,
        pipeline_parallel=dims.pipeline,
        pipeline_rank=rank,
    )


@dataclass(frozen=True)
class PipelinePlace:
    """What pipeline rank `rank` of `degree` holds (see [Note: pipeline split] in modeling/pipeline.py),
    and how many of its stage chunks the schedule keeps in flight at the peak.

    `in_flight` counts micro-batch chunks (one micro-batch through one of the rank's stages) whose
    forward has run and whose backward has not, at most, with at least as many micro-batches per step
    as the schedule keeps in flight (what a pipeline needs to be full). Under 1F1B stage r keeps p - r
    (Narayanan et al. 2021, section 2.2.1: the first stage p); under interleaved 1F1B rank r keeps its
    warm-up's (v - 1)p + 2(p - 1 - r) chunks plus the one whose backward comes next (torch's
    `ScheduleInterleaved1F1B`), which for the first rank is p·v·(1 + (p - 1)/(p·v)) chunks of L/(p·v)
    layers: L·(1 + (p - 1)/(p·v)) layers' worth (section 2.2.2)."""

    rank: int
    degree: int
    stages: tuple[int, ...]
    layers: int  # decoder layers over all of the rank's stages
    holds_first: bool  # the embeddings
    holds_last: bool  # the final LayerNorm and output layer
    in_flight: int

    @property
    def virtual_stages(self) -> int:
        return len(self.stages)

    @property
    def kept_layer_inputs(self) -> int:
        """Decoder-layer inputs activation checkpointing keeps at the peak: the rank's layers per chunk
        (on average over its stages) times the chunks in flight."""
        return self.layers * self.in_flight // self.virtual_stages


def pipeline_place(num_layers: int, degree: int, virtual_stages: int, rank: int) -> PipelinePlace:
    """The `PipelinePlace` of pipeline rank `rank` (`degree` 1: the whole model on rank 0)."""
    _check_int("pipeline_rank", rank, minimum=0, maximum=degree - 1)
    num_stages = degree * virtual_stages
    layers = stage_layers(num_layers, num_stages)  # the engine's own split
    stages = tuple(rank_stages(rank, degree, virtual_stages))
    if virtual_stages == 1:
        in_flight = degree - rank
    else:
        in_flight = (virtual_stages - 1) * degree + 2 * (degree - 1 - rank) + 1
    return PipelinePlace(
        rank=rank,
        degree=degree,
        stages=stages,
        layers=sum(len(layers[s]) for s in stages),
        holds_first=0 in stages,
        holds_last=num_stages - 1 in stages,
        in_flight=in_flight,
    )


def activation_bytes(
    config: TNLGConfig,
    *,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    compute_bytes: int = 2,
    activation_checkpointing: bool = True,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_stages: int = 1,
    pipeline_rank: int = 0,
) -> int:
    """Bytes of activations forward keeps for backward, after Korthikanti et al. 2022.

    "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198), eq. 1: a
    pre-LN GPT layer stores 34·s·b·h + 5·a·s²·b bytes in 16-bit (s tokens, micro batch b, width h,
    a heads). Spelled out per stored tensor, with I the MLP width (4h in the paper) and c the compute
    dtype's bytes: c·(8sbh + 2sbI + 2as²b) for the 16-bit tensors (LayerNorm, QKV, Q, K, V,
    attention-output and MLP inputs, GeLU input and output, softmax output and its dropout) plus one
    byte per element of each dropout mask actually used (as²b attention-probability, 2sbh residual).
    With I = 4h, c = 2 and dropout on this is exactly the paper's 34sbh + 5as²b. The as² terms assume
    attention scores are materialised (eager attention); flash / SDPA kernels keep none of them.

    Outside the layers (paper, section 4.3): the final LayerNorm and output-projection inputs (c·sbh
    each), the fp32 logits cross-entropy keeps (4sbv) and the embedding dropout mask (sbh) if used.

    With full activation checkpointing (each `TNLGBlock` is a checkpointed layer) forward keeps only
    every layer's input, c·sbh, and backward recomputes one layer at a time, adding its activations.

    With tensor slicing of degree t (no sequence parallelism) the tensors inside the sliced regions are
    cut t ways and the LayerNorm / linear inputs and residual dropout masks stay whole (eq. 2:
    sbh(10 + 24/t + 5as/(ht)) in the paper's setting); the vocabulary-parallel loss keeps 4sbv/t.

    With pipeline stages (`pipeline_parallel` p, `virtual_stages` v) this is pipeline rank
    `pipeline_rank`'s: each micro-batch in flight keeps what its layers (and, on the first stage, the
    embedding dropout mask) keep, times the chunks the schedule keeps in flight (`PipelinePlace`;
    paper, section 4.2.3: the first stage of 1F1B holds p micro-batches of L/p layers, L layers'
    worth); the one recomputed layer, and on the last stage the head's tensors, for one micro-batch.
    """
    seq_len = config.max_position_embeddings if seq_len is None else seq_len
    _check_positive_int("micro_batch_size", micro_batch_size)
    _check_int("seq_len", seq_len, minimum=1, maximum=config.max_position_embeddings)
    _check_choice("compute_bytes", compute_bytes, (2, 4))
    if not isinstance(activation_checkpointing, bool):
        raise ValueError(f"activation_checkpointing must be True or False, got {activation_checkpointing!r}")
    dims = ParallelDims(tensor=tensor_parallel, pipeline=pipeline_parallel, virtual_stages=virtual_stages)
    place = pipeline_place(config.num_hidden_layers, dims.pipeline, dims.virtual_stages, pipeline_rank)

    s, b, c = seq_len, micro_batch_size, compute_bytes
    h, i, a, v = config.hidden_size, config.intermediate_size, config.num_attention_heads, config.vocab_size
    sbh, scores = s * b * h, a * s * s * b
    t = tensor_parallel
    whole = c * 4 * sbh  # both LayerNorm inputs, the QKV and fc_in inputs (the LayerNorm outputs)
    sliced = c * (4 * sbh + 2 * s * b * i + 2 * scores) // t  # Q, K, V, attention output, GeLU in/out, scores
    attention_mask = scores // t if config.attention_dropout > 0 else 0
    residual_masks = 2 * sbh if config.hidden_dropout > 0 else 0
    layer = whole + sliced + attention_mask + residual_masks
    embedding_mask = sbh if config.embedding_dropout > 0 and place.holds_first else 0
    head = 2 * c * sbh + FP32_BYTES * s * b * v // t if place.holds_last else 0
    kept_per_layer = c * sbh if activation_checkpointing else layer
    per_micro_batch = place.layers * kept_per_layer + embedding_mask
    in_flight = per_micro_batch * place.in_flight // place.virtual_stages
    recomputed = layer if activation_checkpointing else 0
    return in_flight + recomputed + head


def _stage3_gathered_elements(
    config: TNLGConfig, threshold: int, tensor_parallel: int = 1, place: PipelinePlace | None = None
) -> int:
    """Elements stage 3 holds whole on a rank at the peak: the root block, one layer, the persistent ones.

    The engine (sharding/params.py) keeps the root block (embeddings, tied output layer) gathered
    from the start of forward to the end of backward and gathers decoder layers one at a time.
    Tensors of at most `threshold` elements (biases, LayerNorms) stay whole on every rank. `place`:
    the pipeline rank's layers and root pieces (default: the whole model).
    """
    place = place or pipeline_place(config.num_hidden_layers, 1, 1, 0)
    layer = _layer_tensor_sizes(config, tensor_parallel)
    root = _root_tensor_sizes(config, tensor_parallel, place.holds_first, place.holds_last)
    persistent = place.layers * sum(n for n in layer if n <= threshold)
    persistent += sum(n for n in root if n <= threshold)
    return sum(n for n in root if n > threshold) + sum(n for n in layer if n > threshold) + persistent


def _layer_tensor_sizes(config: TNLGConfig, tensor_parallel: int = 1) -> list[int]:
    """Element counts of one `TNLGBlock`'s tensors on one tensor rank (as in `TNLGConfig.num_parameters`
    with t = 1): QKV (weight and bias), the attention output weight and both MLP matrices (with fc_in's
    bias) cut t ways; LayerNorms and the row-parallel biases whole."""
    h, i, t = config.hidden_size, config.intermediate_size, tensor_parallel
    layer_norm = [h, h]
    attention = [h * 3 * h // t, 3 * h // t, h * h // t, h]
    mlp = [h * i // t, i // t, i * h // t, h]
    return layer_norm + attention + layer_norm + mlp


def _root_tensor_sizes(
    config: TNLGConfig, tensor_parallel: int = 1, holds_first: bool = True, holds_last: bool = True
) -> list[int]:
    """Element counts of the tensors outside the blocks on one tensor rank: the token embedding (and an
    untied output layer) cut by vocabulary, the position embedding and final LayerNorm whole. Of a
    pipeline rank: the embeddings if it holds the first stage, the final LayerNorm and output layer
    (with tied embeddings, the token embedding) if it holds the last."""
    h, v, t = config.hidden_size, config.vocab_size, tensor_parallel
    embeddings = [v * h // t, config.max_position_embeddings * h] if holds_first else []
    tied_copy = config.tie_word_embeddings and not holds_first  # one tensor when one rank holds both
    output_layer = [v * h // t] if holds_last and (tied_copy or not config.tie_word_embeddings) else []
    final_layer_norm = [h, h] if holds_last else []
    return embeddings + final_layer_norm + output_layer


def _rank_tensor_sizes(config: TNLGConfig, tensor_parallel: int, place: PipelinePlace) -> list[int]:
    """Element counts of every tensor one (tensor, pipeline) rank holds."""
    layers = place.layers * _layer_tensor_sizes(config, tensor_parallel)
    return layers + _root_tensor_sizes(config, tensor_parallel, place.holds_first, place.holds_last)


def tensor_rank_parameters(
    config: TNLGConfig,
    tensor_parallel: int = 1,
    *,
    pipeline_parallel: int = 1,
    virtual_stages: int = 1,
    pipeline_rank: int = 0,
) -> int:
    """Parameters one rank holds: a tensor rank's slices of pipeline rank `pipeline_rank`'s stages (all
    of them with t = p = 1); the tied embedding counts on both the first and the last stage."""
    place = pipeline_place(config.num_hidden_layers, pipeline_parallel, virtual_stages, pipeline_rank)
    return sum(_rank_tensor_sizes(config, tensor_parallel, place))


def _check_tensor_parallel(config: TNLGConfig, degree: Any, world_size: Any) -> int:
    """The model's own check (TNLGConfig.check_tensor_parallel: whole heads, MLP columns, vocabulary
    rows, naming the valid degrees), then that the degree divides the world."""
    _check_positive_int("tensor_parallel", degree)
    _check_positive_int("world_size", world_size)
    config.check_tensor_parallel(degree)
    if world_size % degree:
        raise ValueError(f"tensor_parallel={degree} does not divide world_size={world_size}")
    return degree


def smallest_world_size(
    config: TNLGConfig,
    *,
    device_memory_bytes: int,
    stage: int,
    max_world_size: int = 4096,
    **options: Any,
) -> int | None:
    """The smallest power-of-two world size, up to `max_world_size`, whose per-device estimate fits.

    Powers of two because that is how data-parallel jobs are sized (nodes of 8 devices); since every
    term is non-increasing in the world size, the first one that fits is the answer. None if even
    `max_world_size` does not fit (activations do not shrink with more ranks, nor anything in stage 0).
    `options` are `estimate_memory`'s other keyword arguments; with `tensor_parallel` t and
    `pipeline_parallel` p the sizes are t x p times the powers of two (t x p ranks per data replica).
    """
    _check_positive_int("device_memory_bytes", device_memory_bytes)
    _check_positive_int("max_world_size", max_world_size)
    world_size = options.get("tensor_parallel", 1) * options.get("pipeline_parallel", 1)
    while world_size <= max_world_size:
        estimate = estimate_memory(config, world_size=world_size, stage=stage, **options)
        if estimate.device_bytes <= device_memory_bytes:
            return world_size
        logger.debug("stage %d, world size %d: %d bytes per device", stage, world_size, estimate.device_bytes)
        world_size *= 2
    return None


_COLUMNS = ("stage", "ranks", "offload", "params", "grads", "master", "optim", "gathered", "activ.", "device", "cpu")  # fmt: skip


def format_table(rows: Sequence[MemoryEstimate]) -> str:
    """A plain-text table of estimates, one per line, sizes in decimal GB (10^9 bytes)."""

    def gb(size: int) -> str:
        return f"{size / GB:.2f}"

    def offload(row: MemoryEstimate) -> str:
        cpu = [
            name
            for name, where in (
                ("opt", row.offload_optimizer),
                ("param", row.offload_param),
                ("act", "cpu" if row.offloaded_activations else "none"),
            )
            if where == "cpu"
        ]
        return "+".join(cpu) or "-"

    # With pipeline stages, which pipeline rank each row is of (the estimate's worst by default).
    piped = any(row.pipeline_parallel > 1 for row in rows)
    columns = (*_COLUMNS[:3], "pipe rank", *_COLUMNS[3:]) if piped else _COLUMNS
    cells = [columns] + [
        (
            str(row.stage),
            str(row.world_size),
            offload(row),
            *((f"{row.pipeline_rank}/{row.pipeline_parallel}",) if piped else ()),
            *(gb(x) for x in (row.params, row.grads, row.master, row.optimizer_state, row.gathered)),
            *(gb(x) for x in (row.activations, row.device_bytes, row.cpu_bytes)),
        )
        for row in rows
    ]
    widths = [max(len(line[k]) for line in cells) for k in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """'80GB' -> 80·10^9, '80GiB' -> 80·2^30, '1.5TB', '4096' (bytes); case-insensitive."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"not a positive memory size like 80GB or 80GiB: {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def _compute_bytes(mixed_precision: str) -> int:
    return FP32_BYTES if mixed_precision == "no" else 2


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _check_positive_int(name: str, value: Any) -> None:
    _check_int(name, value, minimum=1)
