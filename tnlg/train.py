"""The training run shared by the scripts: build everything from a config, train, evaluate, checkpoint,
resume, and save a model that `from_pretrained` loads. `pretrain` is the pretraining job; fine-tuning
(tnlg.finetune) runs the same loop with its own data, evaluation and (LoRA) model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType, ProjectConfiguration
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from tnlg.accelerate import ZeroAccelerator
from tnlg.checkpoint import RunCheckpointer
from tnlg.config import DataSection, RunConfig
from tnlg.data.corpus import cache_root, embedded_corpus
from tnlg.data.pretokenized import PretokenizedCorpus, PretokenizedStream, read_texts
from tnlg.data.sources import SourceConfig
from tnlg.data.stream import StreamConfig, TokenStream
from tnlg.data.tokenizer import load_tokenizer, train_byte_level_bpe
from tnlg.launch_checks import check_ranks_run_the_same_job
from tnlg.metrics import LossCurve, peak_flops_per_device
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import set_pretrained_source

logger = logging.getLogger(__name__)


def default_tokenizer(vocab_size: int) -> PreTrainedTokenizerBase:
    """A byte-level BPE of `vocab_size` tokens trained on the embedded corpus, cached after the first run."""
    directory = cache_root() / f"tokenizer-embedded-{vocab_size}"
    if not (directory / "tokenizer.json").is_file():
        tokenizer = train_byte_level_bpe(read_texts(embedded_corpus().files()), vocab_size)
        staging = directory.with_name(directory.name + f".{time.time_ns()}")
        tokenizer.save_pretrained(staging)
        with contextlib.suppress(OSError):  # another process finished first: keep its copy
            staging.rename(directory)
    return load_tokenizer(directory)


def run_tokenizer(config: Any) -> PreTrainedTokenizerBase:
    """`data.tokenizer`; "default" is the checkpoint's own tokenizer when the run starts from one that
    has it, else the byte-level BPE of the embedded corpus at the model's vocabulary size."""
    init_from = config.model.init_from
    if config.data.tokenizer != "default":
        return load_tokenizer(config.data.tokenizer)
    if init_from and (Path(init_from) / "tokenizer.json").is_file():
        return load_tokenizer(init_from)
    if init_from:
        return default_tokenizer(TNLGConfig.from_pretrained(init_from).vocab_size)
    return default_tokenizer(TNLGConfig.from_preset(config.model.preset, **config.model.overrides).vocab_size)


def model_config(config: Any, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> TNLGConfig:
    """The architecture: `model.init_from`'s config, else the preset; both with `model.overrides`."""
    overrides = dict(config.model.overrides)
    if config.model.init_from:  # the checkpoint's architecture and special tokens
        model = TNLGConfig.from_pretrained(config.model.init_from, **overrides)
    else:
        overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
        overrides.setdefault("bos_token_id", tokenizer.eos_token_id)
        model = TNLGConfig.from_preset(config.model.preset, **overrides)
    if len(tokenizer) > model.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {model.vocab_size}"
        )
    if seq_len > model.max_position_embeddings:
        raise ValueError(
            f"the sequence length {seq_len} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}"
        )
    return model


def stream_config(data: DataSection, seed: int, split: str) -> StreamConfig | None:
    sections = data.sources if split == "train" else data.validation_sources
    if sections:
        # The config section has SourceConfig's fields (lists where SourceConfig keeps tuples).
        sources = tuple(SourceConfig(**{**dataclasses.asdict(s), "paths": tuple(s.paths)}) for s in sections)
    elif split == "validation" and (data.sources or data.pretokenized):
        return None  # a configured corpus without validation sources: no evaluation on unrelated text
    else:
        sources = tuple(
            SourceConfig(name=p.name.split(".")[0], paths=(str(p),)) for p in embedded_corpus().files(split)
        )
    buffer = data.shuffle_buffer if split == "train" else 1
    return StreamConfig(
        sources=sources,
        seq_len=data.seq_len,
        seed=seed,
        shuffle_buffer=buffer,
        on_bad_record=data.on_bad_record,
    )


def training_stream(config: RunConfig, tokenizer, rank: int, world: int):
    """Pre-tokenized corpora when configured, else the streaming pipeline."""
    data, train = config.data, config.train
    if data.pretokenized:
        corpora = [PretokenizedCorpus(p.prefix, data.seq_len) for p in data.pretokenized]
        for corpus in corpora:
            if corpus.meta["vocab_size"] > len(tokenizer):
                raise ValueError(
                    f"{corpus.prefix} was tokenized with {corpus.meta['vocab_size']} tokens, the tokenizer has "
                    f"{len(tokenizer)}"
                )
        weights = [p.weight for p in data.pretokenized]
        return PretokenizedStream(corpora, weights, train.micro_batch_size, train.seed, rank, world)
    return TokenStream(
        stream_config(data, train.seed, "train"), tokenizer, train.micro_batch_size, rank, world
    )


def tracker_names(requested: list[str]) -> list[str]:
    """Accelerate tracker names for `logging.trackers`; "auto" is TensorBoard when installed."""
    available = {str(t.value) if hasattr(t, "value") else str(t) for t in get_available_trackers()}
    known = sorted(str(t.value) for t in LoggerType if t is not LoggerType.ALL)
    names = []
    for name in requested:
        if name == "auto":
            names.extend(["tensorboard"] if "tensorboard" in available else [])
        elif name not in known:
            raise ValueError(
                f"logging.trackers: unknown tracker {name!r}; Accelerate knows {known} (or auto)"
            )
        elif name not in available:
            raise ValueError(f"logging.trackers: {name!r} is not installed (pip install {name})")
        else:
            names.append(name)
    return sorted(set(names))


def flat_hyperparameters(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The run config as `section.key` scalars (trackers such as TensorBoard take no nesting)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_hyperparameters(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


class NonFiniteLossError(FloatingPointError):
    pass


def handle_nonfinite_loss(policy: str, step: int, loss: float, stream, rank: int) -> None:
    """`train.on_nonfinite_loss`: "skip" drops the step (counted in `nonfinite_steps`), "stop" raises
    with the step and this rank's data position, so the batch can be found and inspected."""
    if policy == "skip":
        logger.warning("step %d: the mean loss is %s; the step is skipped", step, loss)
        return
    raise NonFiniteLossError(
        f"step {step}: the mean loss over the ranks is {loss} (train.on_nonfinite_loss=stop). Rank {rank}'s data "
        f"position after this step's batches: {json.dumps(stream.state_dict())}. Resume from the last "
        "checkpoint with --train.on_nonfinite_loss skip to step over it, or inspect that data."
    )


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainingJob:
    """What a run trains on, around the loop that pretraining and fine-tuning share.

    `batches(tokenizer, rank, world)` is this rank's endless, resumable batch iterable (it has
    `state_dict` / `load_state_dict`); `evaluate(model, tokenizer, accelerator)` gives metrics
    every `train.eval_every` steps; `build_model(architecture)` returns the module to shard (by
    default the model on the meta device, read from `model.init_from` shard by shard when set);
    `save_model(accelerator, model, tokenizer, directory)` writes the final model (by default a
    Transformers checkpoint); `final_evaluation(model, tokenizer, accelerator)` runs after the last
    step (with `evaluate_after`) and before the first (with `evaluate_before`), its metrics returned
    under "evaluation".
    """

    name: str
    seq_len: int
    batches: Callable[[PreTrainedTokenizerBase, int, int], Any]
    evaluate: Callable[[nn.Module, PreTrainedTokenizerBase, Any], dict[str, float]] | None = None
    build_model: Callable[[TNLGConfig, RunConfig], nn.Module] | None = None
    save_model: Callable[[Any, nn.Module, PreTrainedTokenizerBase, Path], None] | None = None
    final_evaluation: Callable[[nn.Module, PreTrainedTokenizerBase, Any], dict[str, Any]] | None = None
    evaluate_before: bool = False
    evaluate_after: bool = True


def pretrain(config: RunConfig, resume: str | None = None) -> dict[str, Any]:
    """Train per `config`; returns the losses logged (main process) and where the model was saved."""

    def evaluate(model, tokenizer, accelerator) -> dict[str, float]:
        perplexity = evaluate_perplexity(model, config, tokenizer, accelerator)
        return {} if perplexity is None else {"eval_perplexity": perplexity}

    job = TrainingJob(
        name="pretraining",
        seq_len=config.data.seq_len,
        batches=lambda tokenizer, rank, world: training_stream(config, tokenizer, rank, world),
        evaluate=evaluate,
    )
    return run_training(config, job, resume)


# What a run writes into train.output_dir (trackers write logs/): a directory holding any of these
# holds a run that a new one would overwrite.
RUN_FILES = (
    "checkpoints",
    "model",
    "logs",
    "loss_curve.json",
    "loss_curve.png",
    "run_config.json",
    "evaluation.json",
)


def check_output_directory(output: Path, resume: str | None, overwrite: bool) -> list[str]:
    """The previous run's files in `output` that this run replaces (train.overwrite), or [] when there is
    none or the run resumes it; a new run into a used directory without train.overwrite is refused."""
    if resume is not None:
        return []
    found = sorted(name for name in RUN_FILES if (output / name).exists())
    if found and not overwrite:
        raise FileExistsError(
            f"train.output_dir {output} already holds a run ({', '.join(found)}): continue it with "
            f"--resume latest, pass --train.overwrite true to replace it, or choose another "
            f"--train.output_dir"
        )
    return found


def remove_run_files(output: Path, names: list[str]) -> None:
    logger.warning("train.overwrite: removing the previous run's %s from %s", ", ".join(names), output)
    for name in names:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_init_from(init_from: str | None) -> None:
    """`model.init_from` must be a local Transformers checkpoint directory: a run downloads nothing, and
    a missing path must not turn into minutes of hub retries or a misleading vocabulary error."""
    if init_from is None:
        return
    path = Path(init_from)
    if not path.exists():
        raise FileNotFoundError(
            f"model.init_from {init_from} does not exist: it must be a local checkpoint directory (the "
            "main job, accelerate launch scripts/pretrain.py, writes runs/pretrain-debug/model)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.init_from {init_from} holds no config.json, so it is no TNLG checkpoint: point it at a "
            "directory written by save_pretrained (a run's model/), or convert one with "
            "scripts/convert_checkpoint.py"
        )


def meta_model(architecture: TNLGConfig, config: Any) -> nn.Module:
    """The model on the meta device: the engine builds each rank's shards, from `model.init_from`'s
    slices when set, else from the seeded initialization."""
    with torch.device("meta"):
        model = TNLGForCausalLM(architecture)
    if config.model.init_from:  # each rank reads only its shards of the checkpoint
        set_pretrained_source(model, config.model.init_from)
    return model


def run_training(config: Any, job: TrainingJob, resume: str | None = None) -> dict[str, Any]:
    """The shared loop: `config` has the model / zero / optimizer / train / logging sections of a
    `RunConfig` (and `data.tokenizer`); `job` says what is trained on and how it is evaluated."""
    train = config.train
    check_init_from(config.model.init_from)
    zero = config.zero.engine_settings(train.mixed_precision)
    output = Path(train.output_dir)
    previous_run = check_output_directory(output, resume, train.overwrite)
    accelerator = ZeroAccelerator(
        zero_config=zero,
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        log_with=tracker_names(config.logging.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(output), logging_dir=str(output / "logs")),
    )
    check_ranks_run_the_same_job(config.to_dict())
    if (
        previous_run and accelerator.is_main_process
    ):  # train.overwrite: the old run goes before anything is written
        remove_run_files(output, previous_run)
    accelerator.wait_for_everyone()
    accelerator.init_trackers(config.logging.project, config=flat_hyperparameters(config.to_dict()))
    tokenizer = run_tokenizer(config)
    architecture = model_config(config, tokenizer, job.seq_len)
    model = (job.build_model or meta_model)(architecture, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.optimizer.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        eps=config.optimizer.eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: warmup_cosine(
            step, config.optimizer.warmup_steps, train.max_steps, config.optimizer.min_lr_ratio
        ),
    )
    accelerator.init_seed = train.seed
    # The scheduler is stepped here once per optimizer step (Accelerate's wrapper would step it once
    # per process, for loops whose step counts assume one process).
    model, optimizer = accelerator.prepare(model, optimizer)
    engine = accelerator.engines[0]
    rank, world = accelerator.process_index, accelerator.num_processes
    stream = job.batches(tokenizer, rank, world)
    checkpointer = RunCheckpointer(output / "checkpoints", keep_last=train.keep_last, accelerator=accelerator)
    start_step, curve = 0, LossCurve()
    if resume is not None:
        restored = checkpointer.load(resume, engine, scheduler, fallback=train.resume_fallback)
        start_step = restored["step"]
        stream.load_state_dict(restored["data"])
        curve = restored["curve"]
        logger.info("resumed from %s at step %d", restored["path"], start_step)
    evaluation: dict[str, Any] = {}
    if job.final_evaluation is not None and job.evaluate_before and start_step == 0:
        evaluation["before"] = job.final_evaluation(model, tokenizer, accelerator)
    batches = iter(stream)
    flops_per_token = architecture.flops_per_token(job.seq_len)
    peak = train.peak_flops or peak_flops_per_device(accelerator.device, train.mixed_precision)
    progress = tqdm(
        total=train.max_steps,
        initial=start_step,
        disable=not accelerator.is_main_process,
        desc=job.name,
        dynamic_ncols=True,
    )
    model.train()
    nonfinite_steps = 0
    for step in range(start_step, train.max_steps):
        started = time.perf_counter()
        # [mean loss, tokens]: reduced together, one collective per step
        totals = torch.zeros(2, device=accelerator.device)
        for _ in range(train.gradient_accumulation_steps):
            batch = {k: v.to(accelerator.device) for k, v in next(batches).items()}
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                totals[0] += loss.detach() / train.gradient_accumulation_steps
                totals[1] += batch["input_ids"].numel()
                if accelerator.sync_gradients:
                    # Every rank gets the same mean, so all of them take the same decision below.
                    reduced = accelerator.reduce(totals, "sum")
                    mean_loss, step_tokens = reduced[0].item() / world, reduced[1].item()
                    finite = math.isfinite(mean_loss)
                    if finite:
                        optimizer.step()
                    else:
                        nonfinite_steps += 1
                        handle_nonfinite_loss(train.on_nonfinite_loss, step + 1, mean_loss, stream, rank)
                optimizer.zero_grad()  # a skipped step's gradients are dropped here
        if finite:
            scheduler.step()
        seconds = time.perf_counter() - started
        tokens_per_second = step_tokens / seconds
        curve.add(step + 1, mean_loss)
        metrics = {
            "loss": mean_loss,
            "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": tokens_per_second,
            "grad_norm": engine.get_global_grad_norm(),
            "loss_scale": engine.loss_scale,
            "memory_mb": engine.memory_stats()["total"] / 2**20,
            "nonfinite_steps": nonfinite_steps,
        }
        if peak:
            metrics["mfu"] = flops_per_token * tokens_per_second / (peak * world)
        accelerator.log({k: v for k, v in metrics.items() if v is not None}, step=step + 1)
        progress.update(1)
        if (step + 1) % config.logging.log_every == 0 or step == start_step:
            progress.set_postfix({k: f"{v:.3g}" for k, v in metrics.items() if v is not None}, refresh=False)
        if job.evaluate is not None and train.eval_every and (step + 1) % train.eval_every == 0:
            results = job.evaluate(model, tokenizer, accelerator)
            if results:
                curve.add_eval(step + 1, next(iter(results.values())))
                accelerator.log(results, step=step + 1)
                if accelerator.is_main_process:
                    shown = ", ".join(f"{k} {v:.4g}" for k, v in results.items())
                    progress.write(f"step {step + 1}: {shown}")
        if train.save_every and (step + 1) % train.save_every == 0:
            checkpointer.save(step + 1, engine, scheduler, stream.state_dict(), config.to_dict(), curve)
    progress.close()
    if job.final_evaluation is not None and job.evaluate_after:
        evaluation["after"] = job.final_evaluation(model, tokenizer, accelerator)
    final = output / "model"
    if job.save_model is not None:
        job.save_model(accelerator, model, tokenizer, final)
    else:
        accelerator.save_model(model, final, max_shard_size="2GB")
        if accelerator.is_main_process:
            tokenizer.save_pretrained(final)
    if accelerator.is_main_process:
        curve.save(output)
        (output / "run_config.json").write_text(json.dumps(config.to_dict(), indent=2))
        if evaluation:
            (output / "evaluation.json").write_text(json.dumps(evaluation, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # closes the trackers (and the process group: nothing collective after it)
    return {"losses": curve.losses, "model": str(final), "evaluation": evaluation}


@torch.no_grad()
def evaluate_perplexity(model, config: RunConfig, tokenizer, accelerator) -> float | None:
    """exp(mean token loss) over `eval_batches` validation batches per rank (the same ones every time)."""
    stream_settings = stream_config(config.data, config.train.seed, "validation")
    if stream_settings is None:
        return None
    stream = TokenStream(
        stream_settings,
        tokenizer,
        config.train.micro_batch_size,
        accelerator.process_index,
        accelerator.num_processes,
    )
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), 0
    for batch, _ in zip(stream, range(config.train.eval_batches), strict=False):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        total += model(**batch).loss
        count += 1
    model.train()
    if count == 0:  # every rank reads the same validation sources, so all of them stop here together
        raise ValueError("the validation sources yielded no batch to evaluate (train.eval_batches > 0)")
    return math.exp(accelerator.reduce(total / count, "mean").item())
