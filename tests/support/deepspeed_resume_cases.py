"""What each rank runs when tnlg resumes a run from a DeepSpeed-written checkpoint (module-level so that
spawned processes can import it; DeepSpeed itself is not needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.deepspeed_fixtures import (
    ADAMW,
    CASES,
    RESUMED_STEPS,
    Trace,
    initial_model,
    tiny_config,
    train_steps,
)
from tnlg import TNLGForCausalLM
from tnlg.sharding import initialize

CASE = {case.name: case for case in CASES}


def resumed_config(case_name: str, stage: int) -> dict:
    """The run's DeepSpeed JSON, at tnlg's world size and ZeRO stage: the micro batch is left to be
    derived from the global batch and the world size, as a user changing either would."""
    case = CASE[case_name]
    config = json.loads((case.directory / "resumed_losses.json").read_text())["config"]
    config.pop("train_micro_batch_size_per_gpu", None)
    # fp32 gradient accumulation (DeepSpeed's BF16_Optimizer) is refused by tnlg, which accumulates in bf16;
    # the checkpoint it saved loads all the same
    config.pop("data_types", None)
    return {**config, "zero_optimization": {"stage": stage}}


def resume_in_tnlg(rank: int, world: int, case_name: str, checkpoint: str, stage: int) -> dict:
    torch.manual_seed(123)  # weights unlike DeepSpeed's start: everything must come from the checkpoint
    model = TNLGForCausalLM(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine = initialize(model, optimizer, resumed_config(case_name, stage))
    summary = engine.load_checkpoint(Path(checkpoint))
    save_at = CASE[case_name].save_at
    trace = traced_steps(engine, range(save_at, save_at + RESUMED_STEPS), rank, world, case_name)
    kept = ("stage", "world_size", "global_steps", "adam_step")
    return {
        "losses": trace.losses,
        "lrs": trace.lrs,
        "loss_scales": trace.loss_scales,
        "applied": trace.applied,
        "global_steps": engine.global_steps,
        "summary": {key: value for key, value in summary.items() if key in kept},
    }


def train_in_tnlg_from_start(rank: int, world: int, case_name: str, stage: int) -> dict:
    """The case's whole DeepSpeed run (its steps before the save and the resumed ones) trained by tnlg's
    engine from DeepSpeed's initial weights with DeepSpeed's JSON (at tnlg's world size and stage)."""
    case = CASE[case_name]
    model = initial_model(case.model)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine = initialize(model, optimizer, resumed_config(case_name, stage))
    return traced_steps(engine, range(case.save_at + RESUMED_STEPS), rank, world, case_name)._asdict()


def traced_steps(engine, steps: range, rank: int, world: int, case_name: str) -> Trace:
    """The case's `steps` on tnlg's `engine`, with its lr, loss scale and skipped steps traced."""
    return train_steps(
        engine,
        steps,
        rank,
        world,
        lr=lambda: engine.base_optimizer.param_groups[0]["lr"],
        loss_scale=lambda: engine.loss_scale,
        applied=lambda: not engine.step_was_skipped,
        accumulation=CASE[case_name].accumulation,
    )


def loss_scale_after_resume(rank: int, world: int, case_name: str, checkpoint: str) -> float:
    """An fp16 engine (initial loss scale 2**12) resumed from the case's DeepSpeed checkpoint: its scale."""
    torch.manual_seed(123)
    model = TNLGForCausalLM(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    config = resumed_config(case_name, 2)
    engine = initialize(model, optimizer, {**config, "fp16": {"enabled": True, "initial_scale_power": 12}})
    engine.load_checkpoint(Path(checkpoint))
    return engine.loss_scale
