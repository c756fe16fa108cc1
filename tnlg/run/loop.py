"""The training loop that pretraining (tnlg.run.pretrain) and fine-tuning (tnlg.run.finetune) share.

    run = build_run(config, job, resume)     # accelerator, tokenizer, sharded model, optimizer, data
    metrics = train_step(run, batches, step)  # one optimizer step over the accumulation micro-batches
    result = train(config, job, resume)      # build, every step with its logging / evaluation /
                                             # checkpoint, then the final model

A `TrainingJob` says what is trained on and how it is evaluated; the config (a `TrainingConfig`) says
how. Nothing here knows whether the batches are packed corpus rows or task examples.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from tnlg.accelerate import ZeroAccelerator
from tnlg.launch_settings import refuse_environment_beside, refuse_launch_accumulation_beside
from tnlg.modeling import TNLGConfig
from tnlg.run.activations import (
    check_activation_offload,
    enable_activation_checkpointing,
    offloaded_activations,
)
from tnlg.run.build import check_init_from, meta_model, model_config, run_tokenizer
from tnlg.run.checkpoint import (
    LATEST,
    RunCheckpointer,
    check_resume_candidates,
    resolve_checkpoint,
    resume_candidates,
)
from tnlg.run.config import TrainingConfig, pipeline_parts
from tnlg.run.launch_checks import check_ranks_run_the_same_job
from tnlg.run.metrics import LossCurve, flat_hyperparameters, peak_flops_per_device, tracker_names
from tnlg.run.optim import build_optimizer, build_schedule
from tnlg.run.output import check_output_directory, remove_run_files
from tnlg.sharding import DeepSpeedConfig, ZeroEngine
from tnlg.sharding.checkpoint import CheckpointError
from tnlg.sharding.json_files import read_json, write_json_atomic
from tnlg.sharding.timeouts import world_timeout
from tnlg.tools.convert.outputs import staged_output
from tnlg.tools.convert.to_gpt2 import export_gpt2

logger = logging.getLogger(__name__)


@dataclass
class TrainingJob:
    """What a run trains on, around the loop that pretraining and fine-tuning share.

    `tokenizer` is the run's `data.tokenizer` (see tnlg.run.build.run_tokenizer). `batches(tokenizer,
    rank, world)` is this rank's endless, resumable batch iterable (it has `state_dict` /
    `load_state_dict`); `evaluate(model, tokenizer, accelerator)` gives metrics every `train.eval_every`
    steps; `build_model(architecture)` returns the module to shard (by default the model on the meta
    device, which the engine reads from `model.init_from` shard by shard when set);
    `save_model(accelerator, model, tokenizer, directory)` writes the final model (by default a
    Transformers checkpoint); `final_evaluation(model, tokenizer, accelerator)` runs after the last
    step (with `evaluate_after`) and before the first (with `evaluate_before`), its metrics returned
    under "evaluation".
    """

    name: str
    seq_len: int
    batches: Callable[[PreTrainedTokenizerBase, int, int], Any]
    tokenizer: str = "default"
    evaluate: Callable[[nn.Module, PreTrainedTokenizerBase, Any], dict[str, float]] | None = None
    build_model: Callable[[TNLGConfig], nn.Module] | None = None
    save_model: Callable[[Any, nn.Module, PreTrainedTokenizerBase, Path], None] | None = None
    final_evaluation: Callable[[nn.Module, PreTrainedTokenizerBase, Any], dict[str, Any]] | None = None
    evaluate_before: bool = False
    evaluate_after: bool = True


@dataclass
class Run:
    """A built run: everything `train_step` and `train` work with."""

    config: TrainingConfig
    job: TrainingJob
    accelerator: ZeroAccelerator
    engine: ZeroEngine  # the prepared model
    optimizer: Any  # the accelerator's wrapper around the engine's step
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: PreTrainedTokenizerBase
    architecture: TNLGConfig
    stream: Any  # the job's batches for this rank
    checkpointer: RunCheckpointer
    output: Path
    start_step: int = 0
    curve: LossCurve | None = None
    peak_flops: float | None = None  # per device, for MFU (None: not reported)
    nonfinite_steps: int = 0


class NonFiniteLossError(FloatingPointError):
    pass


def build_run(config: TrainingConfig, job: TrainingJob, resume: str | None = None) -> Run:
    """The accelerator, the tokenizer, the sharded model with its optimizer and schedule, this rank's
    batches, and (with `resume`) everything restored from a checkpoint."""
    train_section = config.train
    output = Path(train_section.output_dir)
    previous_run = _check_before_building(config, resume)
    engine_settings = config.zero.engine_settings(train_section.mixed_precision)
    check_deepspeed_micro_batch(engine_settings, train_section.micro_batch_size)
    accelerator = ZeroAccelerator(
        zero_config=engine_settings,
        mixed_precision=train_section.mixed_precision,
        gradient_accumulation_steps=train_section.gradient_accumulation_steps,
        parallel=config.parallel.dims(),
        compile_config=config.model.compile.settings(output),
        log_with=tracker_names(config.logging.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(output), logging_dir=str(output / "logs")),
        kwargs_handlers=_process_group_settings(train_section.collective_timeout_minutes),
    )
    check_ranks_run_the_same_job(config.to_dict())  # first: the checks after it then agree on every rank
    _check_collective_timeout(train_section.collective_timeout_minutes)
    tokenizer = run_tokenizer(job.tokenizer, config.model)
    architecture = model_config(config.model, tokenizer, job.seq_len)
    engine, optimizer, scheduler = _build_engine(config, job, accelerator, architecture)
    # train.overwrite: the old run goes only now, when nothing left can refuse this config (a bad
    # setting must lose nothing), and before the trackers write the new run's logs/.
    if previous_run and accelerator.is_main_process:
        remove_run_files(output, previous_run)
    accelerator.wait_for_everyone()
    accelerator.init_trackers(config.logging.project, config=flat_hyperparameters(config.to_dict()))
    run = Run(
        config,
        job,
        accelerator,
        engine,
        optimizer,
        scheduler,
        tokenizer,
        architecture,
        # Ranks of one tensor group (or pipeline) read the same data: the stream is cut by data rank.
        stream=job.batches(tokenizer, accelerator.data_parallel_rank, accelerator.data_parallel_size),
        checkpointer=RunCheckpointer(
            output / "checkpoints", keep_last=train_section.keep_last, accelerator=accelerator
        ),
        output=output,
        curve=LossCurve(),
        peak_flops=train_section.peak_flops
        # the engine's precision: a zero.deepspeed JSON enables bf16 or fp16 under train.mixed_precision "no"
        or peak_flops_per_device(accelerator.device, accelerator.zero_settings.zero.mixed_precision),
    )
    if resume is not None:
        restored = run.checkpointer.load(resume, engine, scheduler, fallback=train_section.resume_fallback)
        run.start_step, run.curve = restored["step"], restored["curve"]
        run.stream.load_state_dict(restored["data"])
        logger.info("resumed from %s at step %d", restored["path"], run.start_step)
    return run


def _process_group_settings(timeout_minutes: float | None) -> list[InitProcessGroupKwargs]:
    """Accelerate's handler giving the world process group train.collective_timeout_minutes (none: the
    backend's default)."""
    if timeout_minutes is None:
        return []
    return [InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=timeout_minutes))]


def _check_collective_timeout(timeout_minutes: float | None) -> None:
    """That the world waits train.collective_timeout_minutes: Accelerate applies its handler only when it
    creates the process group, and one created before the run (by the caller) keeps its own timeout."""
    if timeout_minutes is None:
        return
    found = world_timeout()
    if found is None:  # no process group (one process), or a torch hiding its timeout (world_timeout warns)
        return
    if abs(found.total_seconds() - timeout_minutes * 60) > 1e-3:
        raise ValueError(
            f"train.collective_timeout_minutes {timeout_minutes:g}: the process group was created before the "
            f"run, with a timeout of {found.total_seconds() / 60:g} minutes, which the run cannot change; "
            "give the timeout where the process group is created, or leave the setting out"
        )
    logger.info("a collective waits up to %g minutes on every process group", found.total_seconds() / 60)


def check_deepspeed_micro_batch(settings: DeepSpeedConfig, micro_batch_size: int) -> None:
    """A zero.deepspeed JSON's train_micro_batch_size_per_gpu must be the run's train.micro_batch_size:
    the run's loader makes the batches, so another value in the JSON would be silently not applied (and
    its train_batch_size checked against a batch the run does not train with)."""
    written = settings.training.train_micro_batch_size_per_gpu
    if written is not None and written != micro_batch_size:
        raise ValueError(
            f"{settings.source} sets train_micro_batch_size_per_gpu {written} but train.micro_batch_size is "
            f'{micro_batch_size}: set them equal (or write "auto" in the JSON)'
        )


def _build_engine(
    config: TrainingConfig, job: TrainingJob, accelerator: ZeroAccelerator, architecture: TNLGConfig
) -> tuple[ZeroEngine, Any, torch.optim.lr_scheduler.LRScheduler]:
    """The model sharded by the engine, the accelerator's optimizer wrapper and the schedule."""
    model = (job.build_model or meta_model)(architecture)
    if config.model.activation_checkpointing.enabled:  # before the engine hooks the blocks
        enable_activation_checkpointing(model)
    optimizer = build_optimizer(model, config.optimizer)
    # The scheduler is stepped by the loop once per optimizer step (Accelerate's wrapper would step it
    # once per process, for loops whose step counts assume one process), so it is not prepared.
    scheduler = build_schedule(optimizer, config.optimizer, config.train.max_steps)
    engine, optimizer = accelerator.prepare_engine(
        model,
        optimizer,
        init_seed=config.train.seed,
        # the default model is built on the meta device: each rank reads its shards of init_from (of its
        # pipeline stages' layers and its tensor slices only, under those)
        pretrained=config.model.init_from if job.build_model is None else None,
    )
    return engine, optimizer, scheduler


def _check_before_building(config: TrainingConfig, resume: str | None) -> list[str]:
    """Everything a run refuses before anything is built, so a refusal costs nothing: launch settings
    the run config would contradict, `model.init_from`, the output directory, and the checkpoint
    `resume` names with its settings. Returns the previous run's files that train.overwrite replaces."""
    train_section = config.train
    refuse_environment_beside(
        "the run config's zero section", "give a DeepSpeed JSON as --zero.deepspeed PATH"
    )
    refuse_launch_accumulation_beside(
        train_section.gradient_accumulation_steps, "train.gradient_accumulation_steps"
    )
    check_init_from(config.model.init_from)
    check_activation_offload(config.model.activation_checkpointing, config.parallel.pipeline)
    output = Path(train_section.output_dir)
    checkpoints = output / "checkpoints"
    resumed = resolve_checkpoint(checkpoints, resume) if resume is not None else None
    inputs = {"model.init_from": config.model.init_from, "--resume": resumed}
    previous_run = check_output_directory(output, resumed, train_section.overwrite, inputs)
    if resumed is not None:
        fallback = resume == LATEST and train_section.resume_fallback
        if not resumed.is_dir() and not fallback:  # with the fallback, the load takes an older one
            raise CheckpointError(
                f"--resume {resume}: {checkpoints / LATEST} names {resumed.name}, which is not there: set "
                "train.resume_fallback true to continue from the newest older checkpoint, or resume one by path"
            )
        check_resume_candidates(resume_candidates(checkpoints, resumed, fallback), config.to_dict())
    return previous_run


def train_step(run: Run, batches: Iterator[dict[str, torch.Tensor]], step: int) -> dict[str, float]:
    """Optimizer step `step + 1`: `train.gradient_accumulation_steps` micro-batches from `batches`, one
    reduction of the loss and token count, the step (or, with a non-finite mean loss, the
    `train.on_nonfinite_loss` policy), the schedule; returns the step's metrics."""
    if run.engine.pipeline is not None:
        return _pipeline_train_step(run, batches, step)
    accelerator, train_section = run.accelerator, run.config.train
    accumulation = train_section.gradient_accumulation_steps
    offload = run.config.model.activation_checkpointing.cpu_offload
    started = time.perf_counter()
    totals = torch.zeros(2, device=accelerator.device)  # [mean loss, tokens]: one collective per step
    for _ in range(accumulation):
        batch = {k: v.to(accelerator.device) for k, v in next(batches).items()}
        with accelerator.accumulate(run.engine):
            with offloaded_activations(offload):  # what forward saves for backward goes to the host
                loss = run.engine(**batch).loss
            accelerator.backward(loss)
            totals[0] += loss.detach() / accumulation
            totals[1] += batch["input_ids"].numel()
            if accelerator.sync_gradients:
                # Every rank gets the same mean, so all of them take the same decision below.
                reduced = accelerator.reduce(totals, "sum")
                mean_loss = reduced[0].item() / accelerator.num_processes
                # every data replica's tokens once (the ranks of a tensor group read the same ones)
                step_tokens = reduced[1].item() * accelerator.data_parallel_size / accelerator.num_processes
                finite = math.isfinite(mean_loss)
                if finite:
                    run.optimizer.step()
                else:
                    run.nonfinite_steps += 1
                    _handle_nonfinite_loss(run, step + 1, mean_loss)
            run.optimizer.zero_grad()  # a skipped step's gradients are dropped here
    # An fp16 overflow (or a NaN gradient under a finite loss) makes the engine skip the update: the
    # schedule holds back with it, as DeepSpeed's does, so the learning rate follows the updates applied.
    if finite and not run.engine.step_was_skipped:
        run.scheduler.step()
    return _step_metrics(run, mean_loss, step_tokens, started)


def _pipeline_train_step(run: Run, batches: Iterator[dict[str, torch.Tensor]], step: int) -> dict[str, float]:
    """`train_step` under pipeline stages: a forward and backward cannot run on one rank's stages alone,
    so the step's micro-batches go to `engine.train_batch`, which runs them through the 1F1B schedule and
    steps once (see [Note: pipeline schedule under ZeRO] in sharding/pipeline.py)."""
    accelerator = run.accelerator
    started = time.perf_counter()
    loaded = [next(batches) for _ in range(run.config.train.gradient_accumulation_steps)]
    micro_batches = pipeline_micro_batches(loaded, run.engine.parallel.dims.pipeline)
    # The mean over micro-batches and data replicas, the same on every rank: all take the same decision.
    mean_loss = run.engine.train_batch(micro_batches).item()
    # Every data replica's tokens once: train_batch has agreed the micro-batches' count and shape over
    # the world ([Note: micro-batches agreed before the schedule]), so each replica read as many as this
    # rank; a reduction would only repeat that agreement, a collective and a host wait per step.
    step_tokens = (
        float(sum(batch["input_ids"].numel() for batch in micro_batches)) * accelerator.data_parallel_size
    )
    if math.isfinite(mean_loss):
        if not run.engine.step_was_skipped:  # an overflow skipped the update: the schedule holds back
            run.scheduler.step()
    else:
        run.nonfinite_steps += 1
        _handle_nonfinite_loss(run, step + 1, mean_loss)  # "stop" raises
        if not run.engine.step_was_skipped:
            # train_batch stepped before the loss was known here: "skip" relies on the gradient norm, which a
            # non-finite loss makes non-finite, to have held the update back.
            raise NonFiniteLossError(
                f"step {step + 1}: the mean loss is {mean_loss} but the engine applied the update (its gradient "
                "norm was finite): train.on_nonfinite_loss=skip cannot undo it under pipeline stages"
            )
    return _step_metrics(run, mean_loss, step_tokens, started)


def pipeline_micro_batches(
    batches: list[dict[str, torch.Tensor]], pipeline: int
) -> list[dict[str, torch.Tensor]]:
    """`batches` as the micro-batches of one pipeline schedule (`pipeline_inputs`). The 1F1B schedule needs
    at least as many micro-batches as pipeline ranks: fewer batches are cut along their rows into equal
    parts until there are (more accumulation steps, not cuts, are what shrink the pipeline's idle time)."""
    parts = pipeline_parts(len(batches), pipeline)
    rows = len(batches[0]["input_ids"])
    if rows % parts:
        raise ValueError(
            f"pipeline {pipeline} needs {pipeline} micro-batches per step; {len(batches)} batch(es) of {rows} rows "
            f"cannot be cut into {parts} equal parts each: make train.micro_batch_size a multiple of {parts}, or "
            f"train.gradient_accumulation_steps at least {pipeline}"
        )
    inputs = [pipeline_inputs(batch) for batch in batches]
    # Row by row; position ids given once for every row (batch dimension 1) go to every part as they are.
    return [
        {key: value.chunk(parts)[part] if len(value) == rows else value for key, value in batch.items()}
        for batch in inputs
        for part in range(parts)
    ]


def pipeline_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` as pipeline stages take it: input_ids, labels and position_ids pass hidden states only, so an
    attention mask is dropped when it masks nothing and is an error otherwise (other keys are left for the
    engine to name)."""
    batch = dict(batch)
    mask = batch.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "under pipeline stages a batch cannot carry padding through an attention_mask (the stages pass "
            f"hidden states only; this one masks {int((mask == 0).sum())} of {mask.numel()} positions): pack the "
            "sequences, or train without parallel.pipeline"
        )
    return batch


def _step_metrics(run: Run, mean_loss: float, step_tokens: float, started: float) -> dict[str, float]:
    """The step's loss, learning rate, throughput (and MFU with a known peak), gradient norm and memory."""
    accelerator = run.accelerator
    tokens_per_second = step_tokens / (time.perf_counter() - started)
    metrics = {
        "loss": mean_loss,
        "lr": run.scheduler.get_last_lr()[0],
        "tokens_per_s": tokens_per_second,
        "grad_norm": run.engine.get_global_grad_norm(),
        "loss_scale": run.engine.loss_scale,
        "memory_mb": run.engine.memory_stats()["total"] / 2**20,
        "nonfinite_steps": run.nonfinite_steps,
    }
    compiled = run.engine.compile_stats()
    if compiled is not None:  # compiled blocks: what compiling has cost so far (the first steps pay it)
        metrics["compiles"] = compiled["compiles"]
        metrics["compile_s"] = compiled["compile_seconds"]
    if run.peak_flops:
        flops_per_token = run.architecture.flops_per_token(run.job.seq_len)
        metrics["mfu"] = flops_per_token * tokens_per_second / (run.peak_flops * accelerator.num_processes)
    return {k: v for k, v in metrics.items() if v is not None}


def _handle_nonfinite_loss(run: Run, step: int, loss: float) -> None:
    """`train.on_nonfinite_loss`: "skip" drops the step (counted in `nonfinite_steps`), "stop" raises
    with the step and this rank's data position, so the batch can be found and inspected."""
    if run.config.train.on_nonfinite_loss == "skip":
        logger.warning("step %d: the mean loss is %s; the step is skipped", step, loss)
        return
    raise NonFiniteLossError(
        f"step {step}: the mean loss over the ranks is {loss} (train.on_nonfinite_loss=stop). Rank "
        f"{run.accelerator.process_index}'s data position after this step's batches: "
        f"{json.dumps(position_counters(run.stream.state_dict()))}. Resume from the last checkpoint with "
        "--train.on_nonfinite_loss skip to step over it, or inspect that data."
    )


# A list of at most this many numbers is a counter (a mixture's per-source counts); a longer one, or a
# list of lists, is a buffer of token ids (megabytes in a shuffle buffer), no position to report.
COUNTER_LIST_LENGTH = 16


def position_counters(state: dict[str, Any]) -> dict[str, Any]:
    """A data position (`state_dict()` of a batch stream) with its buffers left out: the counters and
    other scalars, nested as in `state`, enough to find the batch again."""
    kept: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            nested = position_counters(value)
            if nested:
                kept[key] = nested
        elif isinstance(value, list):
            if len(value) <= COUNTER_LIST_LENGTH and all(isinstance(item, (int, float)) for item in value):
                kept[key] = value
        else:
            kept[key] = value
    return kept


def train(config: TrainingConfig, job: TrainingJob, resume: str | None = None) -> dict[str, Any]:
    """Build the run, train to `train.max_steps` (logging, evaluating and checkpointing at their
    cadences), then save the model; returns the losses, the model's directory and the evaluation."""
    run = build_run(config, job, resume)
    evaluation = _evaluation_before(run)
    if job.evaluate_before and run.start_step == 0 and _runs_final_evaluation(run, "before"):
        evaluation["before"] = _final_evaluation(run, job)
        _write_evaluation(run, evaluation)  # now: a run stopped before its end keeps it for its resume
    progress = tqdm(
        total=config.train.max_steps,
        initial=run.start_step,
        disable=not run.accelerator.is_main_process,
        desc=job.name,
        dynamic_ncols=True,
    )
    run.engine.train()
    batches = iter(run.stream)
    compiles = 0
    for step in range(run.start_step, config.train.max_steps):
        metrics = train_step(run, batches, step)
        if metrics.get("compiles", 0) > compiles:
            compiles = metrics["compiles"]
            logger.info(
                "step %d: torch.compile has run %d compilations in %.1f s so far",
                step + 1,
                compiles,
                metrics["compile_s"],
            )
        run.curve.add(step + 1, metrics["loss"])
        run.accelerator.log(metrics, step=step + 1)
        progress.update(1)
        if (step + 1) % config.logging.log_every == 0 or step == run.start_step:
            progress.set_postfix({k: f"{v:.3g}" for k, v in metrics.items()}, refresh=False)
        _after_step(run, step + 1, progress)
    progress.close()
    # The model is written before the final evaluation, so that an evaluation that fails (a bad
    # generation setting, a metric's missing package) loses nothing of the training.
    final = _save_final_model(run)
    if job.evaluate_after and _runs_final_evaluation(run, "after"):
        evaluation["after"] = _final_evaluation(run, job)
    return _finish(run, final, evaluation)


def _final_evaluation(run: Run, job: TrainingJob) -> dict[str, Any]:
    """The job's evaluation of the model as it is, with the dtype its forward passes computed in: a resume
    may change train.mixed_precision, and a bf16 "before" beside an fp32 "after" is not like with like."""
    result = job.final_evaluation(run.engine, run.tokenizer, run.accelerator)
    return {**result, "dtype": dtype_name(run.engine.compute_dtype)}


def _evaluation_before(run: Run) -> dict[str, Any]:
    """The evaluation before training that the first run measured, when this run resumes one: its
    `evaluation.json` is rewritten at the end, and a resume does not measure it again (the starting
    model is gone). Only "before": an earlier "after" is of another final model."""
    path = run.output / "evaluation.json"
    if run.start_step == 0 or not path.is_file():
        return {}
    earlier = read_json(path, ValueError, "the run's evaluations, whose 'before' a resume keeps")
    if not isinstance(earlier, dict):
        raise ValueError(
            f"{path} holds a JSON {type(earlier).__name__}, not the run's evaluations: move it away"
        )
    if "before" not in earlier:
        return {}
    before, now = earlier["before"], dtype_name(run.engine.compute_dtype)
    if run.accelerator.is_main_process and isinstance(before, dict) and before.get("dtype", now) != now:
        logger.warning(
            "%s: the evaluation before training was computed in %s and this resumed run computes in %s: its "
            "'after' is of another precision (each records its dtype)",
            path,
            before["dtype"],
            now,
        )
    return {"before": before}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as results record it: "float32", "bfloat16", "float16"."""
    return str(dtype).removeprefix("torch.")


def _write_evaluation(run: Run, evaluation: dict[str, Any]) -> None:
    if run.accelerator.is_main_process:
        run.output.mkdir(parents=True, exist_ok=True)  # before training, nothing may have made it yet
        write_json_atomic(run.output / "evaluation.json", evaluation, indent=2)


def _runs_final_evaluation(run: Run, when: str) -> bool:
    """Whether the job's final evaluation runs: it generates with the whole model, which no rank holds
    under pipeline stages, so there it is skipped with a log line (the saved model can be evaluated)."""
    if run.job.final_evaluation is None:
        return False
    if run.engine.pipeline is None:
        return True
    logger.warning(
        "the evaluation %s training runs the whole model, which pipeline stages split across ranks: skipped "
        "(evaluate the saved model, %s, with scripts/evaluate.py)",
        when,
        run.output / "model",
    )
    return False


def _after_step(run: Run, step: int, progress: tqdm) -> None:
    """The periodic evaluation (`train.eval_every`) and checkpoint (`train.save_every`) after `step`."""
    train_section, accelerator = run.config.train, run.accelerator
    if run.job.evaluate is not None and train_section.eval_every and step % train_section.eval_every == 0:
        results = run.job.evaluate(run.engine, run.tokenizer, accelerator)
        if results:
            run.curve.add_eval(step, next(iter(results.values())))
            accelerator.log(results, step=step)
            if accelerator.is_main_process:
                progress.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))
    if train_section.save_every and step % train_section.save_every == 0:
        run.checkpointer.save(
            step, run.engine, run.scheduler, run.stream.state_dict(), run.config.to_dict(), run.curve
        )


def _export_gpt2(model: Path, target: Path) -> None:
    """train.export_gpt2: the final model again as a GPT2LMHeadModel directory. It is this run's own
    output (a resumed run that finishes again writes it anew, as it does model/), written beside it and
    renamed into place whole: a failed export keeps the previous one ([Note: conversion outputs])."""
    with staged_output(target, replace=True) as staging:
        export_gpt2(model, staging, max_shard_size="2GB")


def _save_final_model(run: Run) -> Path:
    """The trained model (and its tokenizer) written to the output directory's model/."""
    accelerator, final = run.accelerator, run.output / "model"
    if run.job.save_model is not None:
        run.job.save_model(accelerator, run.engine, run.tokenizer, final)
    else:
        accelerator.save_model(run.engine, final, max_shard_size="2GB")
        if accelerator.is_main_process:
            run.tokenizer.save_pretrained(final)
    return final


def _finish(run: Run, final: Path, evaluation: dict[str, Any]) -> dict[str, Any]:
    """The GPT-2 export of the final model, the loss curve, the run config and the evaluation, written
    into the output directory; then the trackers (and the process group) are closed."""
    accelerator = run.accelerator
    if accelerator.is_main_process:
        if run.config.train.export_gpt2:
            _export_gpt2(final, run.output / "model-gpt2")
        run.curve.save(run.output)
        (run.output / "run_config.json").write_text(json.dumps(run.config.to_dict(), indent=2))
        if evaluation:
            _write_evaluation(run, evaluation)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # closes the trackers (and the process group: nothing collective after it)
    return {"losses": run.curve.losses, "model": str(final), "evaluation": evaluation}
