"""What each rank runs in the tensor-sliced pretraining test (module-level for spawned processes)."""

from __future__ import annotations

from tests.support.run_cases import build_debug_run


def debug_run_losses(rank: int, world_size: int, cache: str, output: str, overrides: list[str]) -> dict:
    """configs/pretrain/debug.yaml for a few steps with `overrides` (fp32, 2 data ranks): the per-step
    losses and tokens/s metric the run logged, and the checkpoint it saved."""
    from tnlg.run.loop import train_step

    run = build_debug_run(cache, ["--train.output_dir", output, *overrides])
    batches = iter(run.stream)
    steps = [train_step(run, batches, step) for step in range(3)]
    state = run.engine.full_state_dict()
    run.engine.close()
    return {"losses": [s["loss"] for s in steps], "state": state}
