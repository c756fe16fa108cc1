"""What each rank runs in the CPU offload tests (module-level so that spawned processes can import it)."""

from __future__ import annotations

import functools

from tests.support.zero_cases import SMALL, train_engine
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize

OPTIMIZER = {"offload_optimizer": "cpu"}
BOTH = {"offload_optimizer": "cpu", "offload_param": "cpu"}


def offload_matrix(rank: int, world_size: int) -> dict:
    """Offloaded runs, and the non-offloaded runs they are compared with where no single-process
    reference exists (16-bit precision, other optimizers)."""
    results = {}
    for stage in (1, 2, 3):
        run = functools.partial(train_engine, rank, world_size, stage=stage)
        results[("fp32", stage)] = run(**OPTIMIZER)
        results[("clip", stage)] = run(gradient_clipping=0.05, **OPTIMIZER)
        results[("accumulate", stage)] = run(accumulation=4, **OPTIMIZER)
        results[("accumulate-synced", stage)] = run(accumulation=2, use_no_sync=False, **OPTIMIZER)
        for precision in ("bf16", "fp16"):
            results[(precision, stage)] = run(
                mixed_precision=precision, initial_loss_scale=2.0**8, **OPTIMIZER
            )
            results[(f"{precision}-device", stage)] = run(
                mixed_precision=precision, initial_loss_scale=2.0**8
            )
        results[("sgd", stage)] = run(optimizer="sgd", **OPTIMIZER)
        results[("sgd-device", stage)] = run(optimizer="sgd")
    results[("adam", 2)] = train_engine(rank, world_size, stage=2, optimizer="adam", **OPTIMIZER)
    results[("adam-device", 2)] = train_engine(rank, world_size, stage=2, optimizer="adam")
    results[("param", 3)] = train_engine(rank, world_size, stage=3, offload_param="cpu")
    results[("both", 3)] = train_engine(rank, world_size, stage=3, **BOTH)
    results[("both-accumulate", 3)] = train_engine(rank, world_size, stage=3, accumulation=4, **BOTH)
    results[("both-keep-gathered", 3)] = train_engine(
        rank, world_size, stage=3, reshard_after_forward=False, **BOTH
    )
    results[("both-bf16", 3)] = train_engine(rank, world_size, stage=3, mixed_precision="bf16", **BOTH)
    results[("param-bf16", 3)] = train_engine(
        rank, world_size, stage=3, mixed_precision="bf16", offload_param="cpu"
    )
    results[("fp16-overflow", 2)] = train_engine(
        rank,
        world_size,
        stage=2,
        mixed_precision="fp16",
        initial_loss_scale=2.0**16,
        hysteresis=1,
        **OPTIMIZER,
    )
    return results


def _engine(stage: int, offload: dict):
    model = make_model()
    return initialize(model, make_optimizer(model), ZeroConfig(stage=stage, **SMALL, **offload))


def _steps(engine, rank: int, world_size: int, steps: range) -> list[float]:
    losses = []
    for step, batch in enumerate(batches(steps.stop)):
        if step in steps:
            loss = engine(*local(batch, rank, world_size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def checkpoint_across_offload(rank: int, world_size: int, directory: str) -> dict:
    """Six offloaded steps in one go; three, saved, then resumed offloaded and not offloaded."""
    whole = _engine(2, OPTIMIZER)
    whole_losses = _steps(whole, rank, world_size, range(6))
    first = _engine(2, OPTIMIZER)
    _steps(first, rank, world_size, range(3))
    first.save_checkpoint(directory)
    results = {"whole": {"losses": whole_losses, "state": whole.full_state_dict()}}
    for name, stage, offload in (("offloaded", 2, OPTIMIZER), ("on-device", 3, {}), ("both", 3, BOTH)):
        engine = _engine(stage, offload)
        engine.load_checkpoint(directory)
        losses = _steps(engine, rank, world_size, range(3, 6))
        results[name] = {"losses": losses, "state": engine.full_state_dict()}
    return results


def fused_adam_matrix(rank: int, world_size: int) -> dict:
    """The engine's device step through a fused Adam kernel, against the same runs through torch's AdamW."""
    results = {}
    for stage in (0, 1, 2, 3):
        for precision in ("no", "bf16"):
            for backend in ("none", "reference"):
                results[(stage, precision, backend)] = train_engine(
                    rank, world_size, stage=stage, mixed_precision=precision, fused_adam=backend
                )
    for stage in (0, 3):
        results[(stage, "bf16", "triton")] = train_engine(
            rank, world_size, stage=stage, mixed_precision="bf16", fused_adam="triton"
        )
    results[(2, "no", "reference-clip")] = train_engine(
        rank, world_size, stage=2, fused_adam="reference", gradient_clipping=0.05, accumulation=2
    )
    results[(2, "no", "none-clip")] = train_engine(
        rank, world_size, stage=2, gradient_clipping=0.05, accumulation=2
    )
    return results
