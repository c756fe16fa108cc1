"""What each rank runs in the pipeline-stage tests (module-level so that spawned processes import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.outcomes import raised_or
from tests.support.parallel_cases import tnlg_batches, tnlg_optimizer
from tests.support.tensor_parallel_cases import make_model as make_tnlg
from tests.support.traffic import counted_traffic, unit_sizes
from tnlg.sharding import ParallelDims, ZeroConfig, initialize

SMALL_UNITS = {"reduce_bucket_size": 500, "param_persistence_threshold": 40}


def data_share(engine, ids: torch.Tensor, labels: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """This rank's data replica's share of a global batch, one micro-batch per sequence."""
    rank, size = engine.parallel.rank("data"), engine.parallel.dims.data
    share = slice(rank * len(ids) // size, (rank + 1) * len(ids) // size)
    return [{"input_ids": i[None], "labels": t[None]} for i, t in zip(ids[share], labels[share], strict=True)]


def evaluate_after_training(rank: int, world_size: int, pipeline: int, tensor: int, stage: int) -> dict:
    """Two steps, then eval_batch on the next global batch: its loss, and the consolidated parameters it
    was computed with (to compare with the whole model's forward)."""
    model = make_tnlg()
    dims = ParallelDims(tensor=tensor, pipeline=pipeline)
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=stage, **SMALL_UNITS), parallel=dims)
    batches = tnlg_batches(3)
    for ids, labels in batches[:2]:
        engine.train_batch(data_share(engine, ids, labels))
    loss = engine.eval_batch(data_share(engine, *batches[2])).item()
    state = engine.full_state_dict()
    engine.close()
    return {"loss": loss, "state": state}


def pipeline_refusals(rank: int, world_size: int) -> list[str]:
    """What train_batch and forward refuse under pipeline stages, by message."""
    model = make_tnlg()
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=1), parallel=ParallelDims(pipeline=2))
    ids, labels = tnlg_batches(1)[0]
    messages = []
    attempts = [
        lambda: engine.train_batch(
            [{"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}]
        ),
        lambda: engine.train_batch([{"input_ids": ids}]),
        lambda: engine.train_batch(
            [{"input_ids": ids, "labels": labels}, {"input_ids": ids[:2], "labels": labels[:2]}]
        ),
        lambda: engine.train_batch([(ids, labels)]),
        lambda: engine(ids, labels=labels),
        # What a stage could only find in the middle of the schedule, leaving the others waiting:
        lambda: engine.train_batch([{"input_ids": ids, "labels": labels[:, :6]}] * 2),
        lambda: engine.eval_batch([{"input_ids": torch.zeros(1, 40, dtype=torch.long)} | {"labels": None}]),
        lambda: engine.eval_batch(
            [
                {
                    "input_ids": torch.zeros(1, 40, dtype=torch.long),
                    "labels": torch.zeros(1, 40, dtype=torch.long),
                }
            ]
            * 2
        ),
        lambda: engine.train_batch([{"input_ids": ids[0], "labels": labels[0]}] * 2),
        lambda: engine.train_batch(
            [{"input_ids": ids, "labels": labels, "position_ids": torch.arange(5)[None]}] * 2
        ),
    ]
    for attempt in attempts:
        try:
            attempt()
        except (ValueError, RuntimeError) as error:
            messages.append(str(error))
    engine.close()
    # A DeepSpeed config's own accumulation next to pipeline stages: refused when the engine is built.
    accumulating = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}
    try:
        model = make_tnlg()
        initialize(model, tnlg_optimizer(model), accumulating, parallel=ParallelDims(pipeline=2))
    except ValueError as error:
        messages.append(str(error))
    return messages


def pipeline_traffic(rank: int, world_size: int, stage: int) -> dict:
    """Bytes one train_batch step moves at pipeline 2 x data 2 (fp32, 2 micro-batches of one sequence),
    counted where the engine and torch's schedule call into torch.distributed, by kind and group; and the
    sizes the analytic volumes need."""

    model = make_tnlg()
    engine = initialize(
        model,
        tnlg_optimizer(model),
        ZeroConfig(stage=stage, **SMALL_UNITS),
        parallel=ParallelDims(pipeline=2),
    )
    ids, labels = tnlg_batches(1)[0]
    micro = data_share(engine, ids, labels)
    engine.train_batch(micro)  # warm-up: nothing left to build in the counted step
    names = {id(engine.parallel.group(d)): d for d in ("pipeline", "data", "tensor")}
    names.update({id(group): "shared" for group in engine.pipeline.shared.values()})
    names[id(dist.group.WORLD)] = "world"
    with counted_traffic(names) as counted:
        engine.train_batch(micro)
    result = {
        "bytes": counted,
        "units": unit_sizes(engine),
        "micro_batches": len(micro),
        "tokens": micro[0]["input_ids"].numel(),
        "first": engine.pipeline.holds_first,
    }
    engine.close()
    return result


def pretrained_layout(rank: int, world_size: int, path: str, stage: int, tensor: int, pipeline: int) -> dict:
    """A meta model of the checkpoint at `path`, cut `tensor` ways and into `pipeline` stages: each rank
    reads only its part of its stage's slices (bytes read reported); the consolidated state comes back."""
    from tnlg.modeling import TNLGForCausalLM
    from tnlg.sharding import meta_from_pretrained

    model = meta_from_pretrained(TNLGForCausalLM, path)
    dims = ParallelDims(tensor=tensor, pipeline=pipeline)
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=stage, **SMALL_UNITS), parallel=dims)
    state = engine.full_state_dict()
    read = engine.pretrained_bytes_read
    engine.close()
    return {"state": state, "bytes_read": read}


def train_mixed_precision(rank: int, world_size: int, precision: str, stage: int) -> dict:
    """Pipeline 2 x data 2 in 16-bit: the losses train_batch returns, the gradient norms, the final loss scale."""
    model = make_tnlg()
    engine = initialize(
        model,
        tnlg_optimizer(model),
        ZeroConfig(stage=stage, mixed_precision=precision, **SMALL_UNITS),
        parallel=ParallelDims(pipeline=2),
    )
    losses, norms = [], []
    for ids, labels in tnlg_batches():
        losses.append(engine.train_batch(data_share(engine, ids, labels)).item())
        norms.append(engine.get_global_grad_norm())
    result = {"losses": losses, "norms": norms, "loss_scale": engine.loss_scale}
    engine.close()
    return result


def frozen_tied_embedding(rank: int, world_size: int) -> dict:
    """Pipeline 2 x data 2 with the tied embedding frozen: the losses and the final state."""
    model = make_tnlg()
    model.model.embed_tokens.weight.requires_grad_(False)
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=2), parallel=ParallelDims(pipeline=2))
    losses = [engine.train_batch(data_share(engine, ids, labels)).item() for ids, labels in tnlg_batches()]
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def dropout_generators_out_of_step(rank: int, world_size: int) -> str:
    """Tensor 2 x pipeline 2 with dropout, the second stage's tensor ranks seeded apart: what every rank
    raises at train_batch (the first stage's ranks agree; only the later stage could see it)."""
    model = make_tnlg(hidden_dropout=0.1)
    engine = initialize(
        model, tnlg_optimizer(model), ZeroConfig(stage=1), parallel=ParallelDims(tensor=2, pipeline=2)
    )
    torch.manual_seed(7 + (rank if engine.parallel.rank("pipeline") == 1 else 0))
    ids, labels = tnlg_batches(1)[0]
    try:
        engine.train_batch(
            [{"input_ids": i[None], "labels": t[None]} for i, t in zip(ids, labels, strict=True)]
        )
    except ValueError as error:
        return str(error)
    finally:
        engine.close()
    return "trained"


def optimizer_beyond_the_model(rank: int, world_size: int) -> str:
    """An optimizer holding a parameter the model lacks, under pipeline stages: the engine's error."""
    model = make_tnlg()
    stray = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([*model.parameters(), stray])
    try:
        initialize(model, optimizer, ZeroConfig(stage=1), parallel=ParallelDims(pipeline=2))
    except ValueError as error:
        return str(error)
    return "accepted"


def _forward_states(stage) -> dict:
    """A torch PipelineStage's per-micro-batch forward states, which clear_runtime_states empties: torch's
    own attribute, `fwd_cache` up to 2.14 and `_forward_chunk_states` from 2.15 (no public reader)."""
    for name in ("_forward_chunk_states", "fwd_cache"):
        if hasattr(stage, name):
            return getattr(stage, name)
    raise AttributeError(f"{type(stage).__name__} has neither fwd_cache nor _forward_chunk_states")


def schedules_kept(rank: int, world_size: int) -> dict:
    """Steps at two sequence lengths, then an evaluation: how many schedules and stage states remain."""
    model = make_tnlg()
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=1), parallel=ParallelDims(pipeline=2))
    ids, labels = tnlg_batches(1)[0]
    for length in (12, 8):
        engine.train_batch(data_share(engine, ids[:, :length], labels[:, :length]))
    engine.eval_batch(data_share(engine, ids, labels))
    runner = engine.pipeline
    stages = runner._cached[2]
    result = {
        "key": runner._schedule_key,
        "leftovers": sum(len(_forward_states(stage)) + len(stage.output_chunks) for stage in stages),
        "training": engine.module.training,
    }
    engine.close()
    return result


def _micro_batches(ids: torch.Tensor, labels: torch.Tensor, count: int = 2, **extra) -> list[dict]:
    return [
        {"input_ids": i, "labels": t, **extra}
        for i, t in zip(ids.chunk(count), labels.chunk(count), strict=True)
    ]


def _with(tensor: torch.Tensor, row: int, value) -> torch.Tensor:
    changed = tensor.clone()
    changed[row, 5] = value
    return changed


def mid_schedule_refusals(rank: int, world_size: int) -> dict:
    """At pipeline 2 (and pipeline 2 x 2 virtual stages): what train_batch and eval_batch raise on each
    rank for values only one stage would meet mid-schedule, for micro-batches the ranks disagree on, and
    for counts torch's schedules refuse; then what a good step still gives. By case: "Type: message"."""
    model = make_tnlg()
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=2), parallel=ParallelDims(pipeline=2))
    ids, labels = tnlg_batches(1)[0]
    vocab = model.config.vocab_size
    positions = torch.arange(12)[None]
    length = 12 - 4 * rank  # rank 1's micro-batches are shorter
    one_bad = _with(ids, 0, vocab) if rank == 0 else ids  # as a data replica's alone may be
    cases = {
        "token": lambda: engine.train_batch(_micro_batches(_with(ids, 3, vocab), labels)),
        "negative token": lambda: engine.train_batch(_micro_batches(_with(ids, 0, -1), labels)),
        "label": lambda: engine.train_batch(_micro_batches(ids, _with(labels, 2, vocab))),
        "negative label": lambda: engine.train_batch(_micro_batches(ids, _with(labels, 1, -5))),
        "float labels": lambda: engine.train_batch(_micro_batches(ids, labels.float())),
        "negative position": lambda: engine.train_batch(
            _micro_batches(ids, labels, position_ids=_with(positions, 0, -1))
        ),
        "position beyond": lambda: engine.train_batch(
            _micro_batches(ids, labels, position_ids=_with(positions, 0, 40))
        ),
        "eval label": lambda: engine.eval_batch(_micro_batches(ids, _with(labels, 3, vocab))),
        "one rank's token": lambda: engine.train_batch(_micro_batches(one_bad, labels)),
        "counts": lambda: engine.train_batch(_micro_batches(ids, labels, count=2 + 2 * rank)),
        "lengths": lambda: engine.train_batch(_micro_batches(ids[:, :length], labels[:, :length])),
        "one micro-batch": lambda: engine.train_batch(_micro_batches(ids, labels, count=1)),
        "one micro-batch eval": lambda: engine.eval_batch(_micro_batches(ids, labels, count=1)),
    }
    result = {name: raised_or(attempt, "accepted") for name, attempt in cases.items()}
    # int32 labels are the int64 ones (the loss takes int64 only); then a good step trains on every rank.
    result["int32 labels"] = (
        engine.eval_batch(_micro_batches(ids, labels.int())).item(),
        engine.eval_batch(_micro_batches(ids, labels)).item(),
    )
    result["trained"] = engine.train_batch(_micro_batches(ids, labels)).item()
    engine.close()
    model = make_tnlg(num_hidden_layers=4)
    interleaved = ParallelDims(pipeline=2, virtual_stages=2)
    engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=1), parallel=interleaved)
    many_ids, many_labels = (torch.cat([t, t[:1]]) for t in tnlg_batches(1)[0])  # 5 rows
    result["interleaved 5"] = raised_or(
        lambda: engine.train_batch(_micro_batches(many_ids, many_labels, 5)), "accepted"
    )
    engine.close()
    return result
