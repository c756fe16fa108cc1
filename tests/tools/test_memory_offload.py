"""The memory estimate and the meta-device plan under CPU offload, against what a real engine holds.

Each case trains a tiny TNLG model one step on 2 gloo ranks and compares both tools with the engine's
`memory_stats()`: where each kind of bytes is (`host`) as well as how many. The cases are the ones the
tools got wrong: stage 1's host gradient buffer (compute dtype for CPUAdam, fp32 for an optimizer that
steps itself), and no 16-bit host copy where the step writes none (fp32 training, SGD).
"""

from __future__ import annotations

import pytest
import torch

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.memory import model_state_estimate
from tnlg.tools.memory_plan import plan_rank_memory
from tnlg.tools.spawn import run_distributed

# 30,080 parameters: every tensor splits evenly over 2 ranks, so the estimate (parameter counts) and
# the plan (the engine's layout) must both agree with the engine to the byte.
CONFIG = {
    "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip
WORLD = 2


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)  # the tools' "sgd-momentum"


def measured_states(rank: int, world_size: int, zero: dict, kind: str) -> dict:
    """The engine's `memory_stats()` after one step (the host gradient buffer is made by the first)."""
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig(**CONFIG))
    engine = initialize(model, _optimizer(model, kind), ZeroConfig(**zero))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["max_position_embeddings"]))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    stats = engine.memory_stats()
    engine.close()
    return stats


def _step_counters(kind: str) -> int:
    """torch's Adam keeps a one-element fp32 `step` per tensor it steps (the engine's one flat shard),
    which neither tool counts; SGD keeps none."""
    return 4 if kind == "adamw" else 0


CASES = [
    # stage 1 keeps a host buffer the gradient shard is copied into for the step
    pytest.param(1, "bf16", "adamw", id="stage1-bf16-adamw"),  # bf16: CPUAdam reads it as it is
    pytest.param(1, "bf16", "sgd", id="stage1-bf16-sgd"),  # fp32: SGD steps the fp32 master; no 16-bit copy
    pytest.param(1, "no", "adamw", id="stage1-fp32-adamw"),  # fp32; no 16-bit copy: the master goes back
    # fp32 training: no 16-bit host copy at stages 2-3 either
    pytest.param(2, "no", "adamw", id="stage2-fp32-adamw"),
    pytest.param(3, "no", "adamw", id="stage3-fp32-adamw"),
    pytest.param(2, "bf16", "adamw", id="stage2-bf16-adamw"),  # the 16-bit copy, fp32 gradient shard
]


def _tool_row(tool, host: int) -> dict[str, int]:
    """A memory plan's or estimate's figures, by the names the engine's are compared under."""
    return {
        "params (with the host copy)": tool.params + tool.offload_copy,
        "grads": tool.grads,
        "master": tool.master,
        "optimizer state": tool.optimizer_state,
        "host": host,
    }


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "precision", "kind"), CASES)
def test_estimate_and_plan_equal_what_an_offloaded_engine_holds(stage, precision, kind):
    zero = {
        "stage": stage, "mixed_precision": precision, "offload_optimizer": "cpu", "param_persistence_threshold": 0,
    }  # fmt: skip
    stats = run_distributed(measured_states, WORLD, zero, kind, timeout=300)[0]
    counters = _step_counters(kind)
    engine = {
        "params (with the host copy)": stats["params"],
        "grads": stats["grads"],
        "master": stats["master"],
        "optimizer state": stats["optimizer_state"] - counters,
        "host": stats["host"] - counters,
    }
    tool_kind = "adamw" if kind == "adamw" else "sgd-momentum"

    with torch.device("meta"):
        meta = TNLGForCausalLM(TNLGConfig(**CONFIG))
    plan = plan_rank_memory(
        meta, _optimizer(meta, kind), ZeroConfig(**zero), world_size=WORLD, optimizer_kind=tool_kind,
        device_type="cpu",
    )  # fmt: skip
    planned = _tool_row(plan, host=plan.host)
    assert planned == engine, f"plan {planned}\nengine {engine}"

    psi = sum(p.numel() for p in meta.parameters())
    estimate = model_state_estimate(
        psi, world_size=WORLD, stage=stage, mixed_precision=precision, offload_optimizer="cpu",
        optimizer=tool_kind,
    )  # fmt: skip
    estimated = _tool_row(estimate, host=estimate.cpu_bytes)
    assert estimated == engine, f"estimate {estimated}\nengine {engine}"
    assert estimate.model_states == stats["total"] - counters


# and stage 3 with the parameters offloaded too, whose host shard the step writes (no copy)
WITH_PARAMS = [
    pytest.param(3, "bf16", "adamw", id="stage3-bf16-adamw"),
    pytest.param(3, "bf16", "sgd", id="stage3-bf16-sgd"),
]


@pytest.mark.parametrize(
    ("stage", "precision", "kind", "offload_param"),
    [pytest.param(*case.values, "none", id=case.id) for case in CASES]
    + [pytest.param(*case.values, "cpu", id=f"{case.id}-offload_param") for case in WITH_PARAMS],
)
def test_plan_and_estimate_agree_under_offload(stage, precision, kind, offload_param):
    """The two tools' offload terms come from the same functions (`writes_16bit_copy`,
    `host_step_grad_bytes`): on a model that splits evenly they agree to the byte, at every setting
    (no engine run: the slow test above ties them to the engine)."""
    zero = ZeroConfig(
        stage=stage, mixed_precision=precision, offload_optimizer="cpu", offload_param=offload_param,
        param_persistence_threshold=0,
    )  # fmt: skip
    tool_kind = "adamw" if kind == "adamw" else "sgd-momentum"
    with torch.device("meta"):
        meta = TNLGForCausalLM(TNLGConfig(**CONFIG))
    plan = plan_rank_memory(
        meta, _optimizer(meta, kind), zero, world_size=WORLD, optimizer_kind=tool_kind, device_type="cpu"
    )
    estimate = model_state_estimate(
        sum(p.numel() for p in meta.parameters()), world_size=WORLD, stage=stage, mixed_precision=precision,
        offload_optimizer="cpu", offload_param=offload_param, optimizer=tool_kind,
    )  # fmt: skip
    fields = ("params", "grads", "master", "optimizer_state", "offload_copy")
    assert {f: getattr(plan, f) for f in fields} == {f: getattr(estimate, f) for f in fields}
    assert plan.host == estimate.cpu_bytes
