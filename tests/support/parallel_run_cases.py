"""What each rank runs in the pretraining tests of parallel layouts (module-level for spawned processes)."""

from __future__ import annotations

from tests.support.run_cases import build_debug_run

STEPS = 3


def debug_run_losses(rank: int, world_size: int, cache: str, output: str, overrides: list[str]) -> dict:
    """configs/pretrain/debug.yaml for STEPS steps with `overrides` (fp32): the per-step losses the run
    logged, the validation perplexity after them and the consolidated model."""
    from tnlg.run.loop import train_step
    from tnlg.run.pretrain import evaluate

    run = build_debug_run(cache, ["--train.output_dir", output, *overrides])
    batches = iter(run.stream)
    steps = [train_step(run, batches, step) for step in range(STEPS)]
    evaluation = evaluate(run.config, run.engine, run.tokenizer, run.accelerator)
    state = run.engine.full_state_dict()
    run.engine.close()
    return {"losses": [s["loss"] for s in steps], "evaluation": evaluation, "state": state}


def accelerate_pipeline_data(rank: int, world_size: int, stage: int) -> dict:
    """The tiny TNLG model in 2 pipeline stages x 2 data replicas through ZeroAccelerator(parallel=...) and a
    data loader it prepared, one train_batch per loader batch (a micro-batch per sequence): the losses, the
    batches this rank read, its data rank and size, the final consolidated parameters."""
    import torch

    from tests.support.parallel_cases import tnlg_optimizer, tnlg_rows
    from tests.support.tensor_parallel_cases import make_model
    from tnlg.accelerate import ZeroAccelerator
    from tnlg.sharding import ParallelDims, ZeroConfig

    accelerator = ZeroAccelerator(zero_config=ZeroConfig(stage=stage), parallel=ParallelDims(pipeline=2))
    model = make_model()
    loader = torch.utils.data.DataLoader(tnlg_rows(), batch_size=2, shuffle=False)
    engine, _, loader = accelerator.prepare(model, tnlg_optimizer(model), loader)
    losses, seen = [], []
    for batch in loader:
        rows = zip(batch["input_ids"], batch["labels"], strict=True)
        losses.append(engine.train_batch([{"input_ids": i[None], "labels": t[None]} for i, t in rows]).item())
        seen.append(batch["input_ids"][:, 0].tolist())
    return {
        "losses": losses,
        "seen": seen,
        "state": engine.full_state_dict(),
        "data": (accelerator.data_parallel_rank, accelerator.data_parallel_size),
        "stages": engine.pipeline.split.stage_indices,
    }


def poisoned_pipeline_run(rank: int, world_size: int, cache: str, output: str, overrides: list[str]) -> dict:
    """The debug run in pipeline stages for STEPS steps, the last one's loss NaN on the last stage's first
    data replica: the losses (or the error) and whether the parameters changed in the poisoned step."""
    import math

    from tnlg.run.loop import NonFiniteLossError, train_step

    run = build_debug_run(cache, ["--train.output_dir", output, *overrides])
    split, calls = run.engine.pipeline.split, [0]
    loss, poisoned_call = split.loss, 2 * (STEPS - 1) + 1  # 2 micro-batches a step: the last step's first
    poison = run.engine.pipeline.holds_last and run.engine.parallel.rank("data") == 0

    def poisoned(hidden, labels):
        calls[0] += 1
        value = loss(hidden, labels)
        return value * math.nan if poison and calls[0] == poisoned_call else value

    split.loss = poisoned  # before the first step builds its schedule around it
    batches = iter(run.stream)
    steps = [train_step(run, batches, step) for step in range(STEPS - 1)]
    before = run.engine.full_state_dict()
    try:
        steps.append(train_step(run, batches, STEPS - 1))
    except NonFiniteLossError as error:
        return {"error": str(error)}
    after = run.engine.full_state_dict()
    run.engine.close()
    unchanged = before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)
    return {
        "losses": [s["loss"] for s in steps],
        "nonfinite_steps": steps[-1]["nonfinite_steps"],
        "unchanged": unchanged,
    }


def pipeline_train_with_final_evaluation(rank: int, world_size: int, cache: str, output: str) -> dict:
    """`tnlg.run.loop.train` in 2 pipeline stages for 2 steps, its job with a final evaluation (which runs
    the whole model): what train returned, and the warnings it logged."""
    import logging
    import os

    os.environ["TNLG_CACHE"] = cache
    from tests.support.run_cases import DEBUG
    from tnlg.run.config import load_run_config
    from tnlg.run.loop import TrainingJob, train
    from tnlg.run.pretrain import training_stream

    overrides = ["--parallel.pipeline", "2", "--train.max_steps", "2", "--train.eval_every", "0"]
    config = load_run_config(DEBUG, [*overrides, "--train.output_dir", output, "--logging.trackers", "[]"])
    job = TrainingJob(
        name="test",
        seq_len=config.data.seq_len,
        batches=lambda tokenizer, rank, world: training_stream(config, tokenizer, rank, world),
        final_evaluation=lambda model, tokenizer, accelerator: {"ran": True},
        evaluate_before=True,
    )
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("tnlg.run.loop").addHandler(handler)
    return {**train(config, job), "warnings": warnings}
