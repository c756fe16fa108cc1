"""The meta-device memory plan: equal to what a real engine holds, and the big configs fit 80 GB."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.support import REPO
from tests.support.memory_plan_cases import (
    measured_memory,
    measured_pipeline_memory,
    measured_tensor_memory,
)
from tests.support.parallel_cases import tnlg_optimizer
from tests.support.tensor_parallel_cases import make_model as make_tnlg
from tests.support.zero_cases import SMALL
from tests.support.zero_models import make_model, make_optimizer
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.run.config import load_run_config
from tnlg.run.optim import build_optimizer
from tnlg.sharding import ZeroConfig
from tnlg.tools.memory import GB, activation_bytes, estimate_memory
from tnlg.tools.memory_plan import format_plans, plan_rank_memory
from tnlg.tools.spawn import run_distributed


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plan_equals_what_the_engine_holds(stage):
    measured = run_distributed(measured_memory, 2, stage, timeout=300)[0]
    model = make_model()
    with torch.device("meta"):
        meta = make_model()
    zero = ZeroConfig(**{**SMALL, "stage": stage, "mixed_precision": "no"})
    plan = plan_rank_memory(meta, make_optimizer(meta), zero, world_size=2, device_type="cpu")
    stats, compute = measured["stats"], measured["compute_bytes"]
    assert (plan.params, plan.grads, plan.master) == (stats["params"], stats["grads"], stats["master"])
    assert plan.optimizer_state == stats["optimizer_state"] - _step_counters(make_optimizer(model))
    if stage == 3:
        assert plan.gathered == compute * measured["peaks"]["gathered"]
        assert plan.prefetches
    if stage >= 2:
        # An upper bound (the order units complete in follows autograd), reached within a unit here.
        # Each bucket in flight comes with its reduce-scatter output, this rank's piece: 1/2 of it.
        def with_outputs(bucket_numel: int) -> int:
            return bucket_numel + bucket_numel // 2

        assert (
            compute * with_outputs(measured["peaks"]["buckets"])
            <= plan.buckets
            <= compute * with_outputs(measured["peaks"]["buckets"] + plan.largest_unit)
        )


def _step_counters(optimizer: torch.optim.Optimizer) -> int:
    """torch's Adam keeps a one-element fp32 `step` per tensor it steps (the engine's one flat shard per
    param group), which the plan leaves out."""
    return 4 * len(optimizer.param_groups)


@functools.cache  # the 530B config plans 35 pipeline ranks: once for the tests that share it
def _plan_config(path: str, world_size: int, parallel: tuple[int, int] | None = None, **zero_overrides):
    """The meta-device plan of a run config at `world_size` (`parallel`: (tensor, pipeline) in place of
    its own), every pipeline rank with its own activations, the worst returned."""
    run = load_run_config(REPO / path)
    tensor, pipeline = parallel or (run.parallel.tensor, run.parallel.pipeline)
    layout = {"tensor": tensor, "pipeline": pipeline}
    architecture = TNLGConfig.from_preset(run.model.preset)
    with torch.device("meta"):
        model = TNLGForCausalLM(architecture)
    zero = run.zero.to_zero_config(run.train.mixed_precision)
    zero = dataclasses.replace(zero, **zero_overrides)
    activations = [
        activation_bytes(
            architecture,
            micro_batch_size=run.train.micro_batch_size,
            seq_len=run.data.seq_len,
            activation_checkpointing=run.model.activation_checkpointing.enabled,
            tensor_parallel=layout["tensor"],
            pipeline_parallel=layout["pipeline"],
            pipeline_rank=rank,
        )
        for rank in range(layout["pipeline"])
    ]
    optimizer = build_optimizer(model, run.optimizer)
    return plan_rank_memory(
        model,
        optimizer,
        zero,
        world_size=world_size,
        activations=activations,
        tensor_parallel=layout["tensor"],
        pipeline_parallel=layout["pipeline"],
    )


@pytest.mark.parametrize(
    ("path", "world_size"),
    [("configs/pretrain/tnlg-17b.yaml", 32), ("configs/pretrain/mt-nlg-530b.yaml", 2240)],
)
def test_the_big_configs_fit_an_80gb_gpu_at_their_layout(path, world_size):
    """One rank's actual shards (its pipeline stage, its tensor slices, its ZeRO piece), planned on meta."""
    plan = _plan_config(path, world_size)
    print(format_plans([plan], 80 * GB))
    assert plan.stage == 1  # both at their paper's layout: tensor slicing (and pipeline stages), ZeRO-1
    assert plan.device <= 80 * GB


def test_the_530b_plan_agrees_with_the_estimate_on_the_worst_pipeline_rank():
    run = load_run_config(REPO / "configs/pretrain/mt-nlg-530b.yaml")
    assert (run.parallel.tensor, run.parallel.pipeline) == (8, 35)  # MT-NLG's replica of 280 GPUs
    plan = _plan_config("configs/pretrain/mt-nlg-530b.yaml", 2240)
    estimate = estimate_memory(
        TNLGConfig.from_preset(run.model.preset),
        world_size=2240,
        stage=run.zero.stage,
        seq_len=run.data.seq_len,
        micro_batch_size=run.train.micro_batch_size,
        tensor_parallel=8,
        pipeline_parallel=35,
    )
    # Under 1F1B the first stage keeps 35 micro-batches in flight: the most activations, and the embeddings.
    assert (plan.pipeline_rank, estimate.pipeline_rank, plan.pipeline_parallel) == (0, 0, 35)
    assert plan.activations == estimate.activations
    # The engine's layout pads each unit's pieces to alignment; the estimate counts parameters alone.
    for kind in ("params", "grads", "master", "optimizer_state"):
        assert getattr(plan, kind) == pytest.approx(getattr(estimate, kind), rel=1e-5)
        assert getattr(plan, kind) >= getattr(estimate, kind)


def test_the_530b_layer_is_cut_into_bucket_sized_units_under_stage_3():
    # Data parallelism alone (MT-NLG's model at stage 3 on 512 ranks): units and prefetching.
    whole = (1, 1)  # (tensor, pipeline)
    path = "configs/pretrain/mt-nlg-530b.yaml"
    plan = _plan_config(path, 512, whole, stage=3, max_live_parameters=12 * 10**9)
    assert plan.largest_unit == 4 * 20480 * 20480  # an MLP weight, alone: no unit spans a whole layer
    assert plan.prefetches
    # Below the root block and two layers, nothing is prefetched.
    assert not _plan_config(path, 512, whole, stage=3, max_live_parameters=2 * 10**9).prefetches


def test_bad_inputs_are_named():
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        plan_rank_memory(model, make_optimizer(model), ZeroConfig(stage=3), world_size=0)
    with pytest.raises(ValueError, match="optimizer_kind must be one of"):
        plan_rank_memory(
            model, make_optimizer(model), ZeroConfig(stage=3), world_size=2, optimizer_kind="lion"
        )


def test_bad_pipeline_inputs_are_named():
    with torch.device("meta"):
        meta = make_tnlg(num_hidden_layers=3)
    optimizer, zero = tnlg_optimizer(meta), ZeroConfig(stage=1)
    options = {"world_size": 4, "device_type": "cpu", "pipeline_parallel": 2}
    with pytest.raises(ValueError, match=r"pipeline_rank must be None or an integer in \[0, 1\], got 2"):
        plan_rank_memory(meta, optimizer, zero, **options, pipeline_rank=2)
    with pytest.raises(ValueError, match=r"activations must be bytes .* one such per pipeline rank \(2\)"):
        plan_rank_memory(meta, optimizer, zero, **options, activations=[1, 2, 3])
    with pytest.raises(ValueError, match="pipeline 3 = 3 does not divide the world of 4 ranks"):
        plan_rank_memory(meta, optimizer, zero, **{**options, "pipeline_parallel": 3})
    with pytest.raises(ValueError, match="4 pipeline stages need at least one layer each"):
        plan_rank_memory(meta, optimizer, zero, **{**options, "pipeline_parallel": 4})


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_plan_of_a_tensor_rank_equals_what_the_engine_holds(stage):
    stats = run_distributed(measured_tensor_memory, 4, stage, timeout=300)
    with torch.device("meta"):
        meta = make_tnlg()
    shapes = {name: p.shape for name, p in meta.named_parameters()}
    zero = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    optimizer = tnlg_optimizer(meta)
    plan = plan_rank_memory(meta, optimizer, zero, world_size=4, device_type="cpu", tensor_parallel=2)
    assert {name: p.shape for name, p in meta.named_parameters()} == shapes  # the meta model is whole again
    for rank in stats:  # every tensor rank holds slices of the same sizes
        assert (plan.params, plan.grads, plan.master) == (rank["params"], rank["grads"], rank["master"])
        assert plan.optimizer_state == rank["optimizer_state"] - _step_counters(optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_plan_of_a_pipeline_rank_equals_what_the_engine_holds(stage):
    layers = 3  # stages of 2 and 1 layers: the first holds the embeddings, the last the tied one again
    measured = run_distributed(measured_pipeline_memory, 4, stage, layers, timeout=300)
    with torch.device("meta"):
        meta = make_tnlg(num_hidden_layers=layers)
    shapes = {name: p.shape for name, p in meta.named_parameters()}
    zero = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    optimizer = tnlg_optimizer(meta)
    plans = [
        plan_rank_memory(
            meta, optimizer, zero, world_size=4, device_type="cpu", pipeline_parallel=2, pipeline_rank=rank
        )
        for rank in (0, 1)
    ]
    assert {name: p.shape for name, p in meta.named_parameters()} == shapes  # the meta model is whole
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(shapes)
    for rank in measured:
        plan, stats = plans[rank["pipeline_rank"]], rank["stats"]
        assert (plan.pipeline_rank, plan.pipeline_parallel) == (rank["pipeline_rank"], 2)
        assert (plan.params, plan.grads, plan.master) == (stats["params"], stats["grads"], stats["master"])
        assert plan.optimizer_state == stats["optimizer_state"] - _step_counters(optimizer)
    assert plans[0].params != plans[1].params  # the stages differ, so the comparison says something
    # By default every pipeline rank is planned and the one needing the most device memory returned.
    worst = plan_rank_memory(meta, optimizer, zero, world_size=4, device_type="cpu", pipeline_parallel=2)
    assert worst == max(plans, key=lambda plan: plan.device)
