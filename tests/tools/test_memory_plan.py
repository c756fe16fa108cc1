"""The meta-device memory plan: equal to what a real engine holds, and the big configs fit 80 GB."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support import REPO
from tests.support.memory_plan_cases import measured_memory, measured_tensor_memory
from tests.support.parallel_cases import tnlg_optimizer
from tests.support.tensor_parallel_cases import make_model as make_tnlg
from tests.support.zero_cases import SMALL
from tests.support.zero_models import make_model, make_optimizer
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.run.config import load_run_config
from tnlg.run.optim import build_optimizer
from tnlg.sharding import ZeroConfig
from tnlg.tools.memory import GB, activation_bytes
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
        assert (
            compute * measured["peaks"]["buckets"]
            <= plan.buckets
            <= compute * (measured["peaks"]["buckets"] + plan.largest_unit)
        )


def _step_counters(optimizer: torch.optim.Optimizer) -> int:
    """torch's Adam keeps a one-element fp32 `step` per tensor it steps (the engine's one flat shard per
    param group), which the plan leaves out."""
    return 4 * len(optimizer.param_groups)


def _plan_config(path: str, world_size: int, **zero_overrides):
    run = load_run_config(REPO / path)
    architecture = TNLGConfig.from_preset(run.model.preset)
    with torch.device("meta"):
        model = TNLGForCausalLM(architecture)
    zero = run.zero.to_zero_config(run.train.mixed_precision)
    zero = dataclasses.replace(zero, **zero_overrides)
    activations = activation_bytes(
        architecture,
        micro_batch_size=run.train.micro_batch_size,
        seq_len=run.data.seq_len,
        activation_checkpointing=run.model.activation_checkpointing.enabled,
        tensor_parallel=run.parallel.tensor,
    )
    optimizer = build_optimizer(model, run.optimizer)
    return plan_rank_memory(
        model,
        optimizer,
        zero,
        world_size=world_size,
        activations=activations,
        tensor_parallel=run.parallel.tensor,
    )


@pytest.mark.parametrize(
    ("path", "world_size"),
    [("configs/pretrain/tnlg-17b.yaml", 32), ("configs/pretrain/mt-nlg-530b.yaml", 512)],
)
def test_the_big_configs_fit_an_80gb_gpu_at_their_layout(path, world_size):
    plan = _plan_config(path, world_size)
    print(format_plans([plan], 80 * GB))
    assert plan.prefetches or plan.stage < 3  # 17B: stage 1 at T-NLG's tensor 4; 530B: stage 3
    assert plan.device <= 80 * GB


def test_the_530b_layer_is_cut_into_bucket_sized_units():
    plan = _plan_config("configs/pretrain/mt-nlg-530b.yaml", 512)
    assert plan.largest_unit == 4 * 20480 * 20480  # an MLP weight, alone: no unit spans a whole layer
    # Below the root block and two layers, nothing is prefetched.
    assert not _plan_config(
        "configs/pretrain/mt-nlg-530b.yaml", 512, max_live_parameters=2 * 10**9
    ).prefetches


def test_bad_inputs_are_named():
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        plan_rank_memory(model, make_optimizer(model), ZeroConfig(stage=3), world_size=0)
    with pytest.raises(ValueError, match="optimizer_kind must be one of"):
        plan_rank_memory(
            model, make_optimizer(model), ZeroConfig(stage=3), world_size=2, optimizer_kind="lion"
        )


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
