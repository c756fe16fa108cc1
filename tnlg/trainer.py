"""`ZeroTrainer`: a `transformers.Trainer` whose accelerator is a `ZeroAccelerator`.

    trainer = ZeroTrainer(
        model=model, args=TrainingArguments("out", bf16=True, max_grad_norm=1.0, ...),
        train_dataset=dataset, zero_config=ZeroConfig(stage=3),
    )
    trainer.train()                      # or train(resume_from_checkpoint=True)
    trainer.save_model("out/final")      # consolidated: loads with from_pretrained

Without `zero_config`, the launch's `TNLG_ZERO_*` environment decides (see tnlg.accelerate); with
neither, it is a plain `Trainer`. What the engine changes:

- `accelerator.prepare(model, optimizer)` shards them (the Trainer's own optimizer, with its weight
  decay groups, is rebuilt over the shards in place, so the Trainer's scheduler keeps driving it).
- `bf16=True` / `fp16=True` select the engine's mixed precision (16-bit parameters, fp32 master
  weights, the engine's loss scaling); `max_grad_norm` clips the true global norm over all shards.
  It is the run's one clipping value: the config's `gradient_clipping` must equal it (unset or "auto"
  takes it), as the HF Trainer requires of a DeepSpeed JSON.
- A DeepSpeed JSON's batch keys must be "auto" or what TrainingArguments say
  (gradient_accumulation_steps, per_device_train_batch_size, their product with the data-parallel size),
  and its `scheduler` section is refused: the Trainer's scheduler (TrainingArguments) is the one.
- Gradient accumulation stays the Trainer's: the engine's `no_sync` on the inner micro-batches.
- `save_model` consolidates the parameters on the main process (every rank takes part) and refuses to
  write an empty model, the ZeRO-3 failure DeepSpeed users meet under Trainer.
- A checkpoint holds every rank's engine shard (fp32 master weights and optimizer state, in
  `checkpoint-N/engine/`, as in run checkpoints and `save_state`) and the scheduler as JSON
  (`scheduler.json`, see tnlg.state_files) next to the Trainer's own files; resuming restores them
  exactly, and `load_best_model_at_end` restores the best checkpoint's shards. A checkpoint written
  with the old `zero/` directory is refused with the rename that makes it load. Checkpoints go to storage
  every node shares: `save_on_each_node=True` with processes on more than one node is refused when the
  trainer is built (see tnlg/shared_storage.py).
- `resume_from_checkpoint` also takes a checkpoint-N of a Trainer run under DeepSpeed (`deepspeed=` in
  TrainingArguments, ZeRO stage 1-3): the engine reads DeepSpeed's files at this run's world size and
  stage, the scheduler its scheduler.pt (or DeepSpeed's copy), and the Trainer its own state and RNG files.
- `save_only_model=True` checkpoints hold the consolidated weights alone: `load_best_model_at_end` loads
  them into the engine as the plain Trainer loads them into its model (exact: they are the fp32 master
  weights; stages 0-2 without tensor slicing or pipeline stages, whose engines take a full state dict;
  the others are refused when the trainer is built). Resuming from one is refused, naming
  `save_only_model`: with no optimizer or scheduler state it could not continue exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from tnlg.accelerate import ZeroAccelerator
from tnlg.launch_settings import launch_mixed_precision, refuse_environment_beside, settings_from_environment
from tnlg.sharding import DeepSpeedConfig, ZeroConfig, ZeroEngine
from tnlg.sharding.checkpoint import ENGINE_DIRECTORY, engine_directory
from tnlg.sharding.deepspeed import TrainingConfig, engine_settings
from tnlg.sharding.deepspeed.zero_checkpoint import is_deepspeed_checkpoint
from tnlg.shared_storage import refuse_node_local_saves
from tnlg.state_files import read_scheduler_states, write_scheduler_states

logger = logging.getLogger(__name__)

# What Trainer.save_model writes: one weights file or a sharded one's index (an adapter's for PEFT models).
_WEIGHT_FILES = (
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
)


def _config_name(settings: DeepSpeedConfig) -> str:
    return (
        settings.source
        if settings.zero_sources or settings.training != TrainingConfig()
        else "the ZeroConfig"
    )


def _with_max_grad_norm(settings: DeepSpeedConfig, max_grad_norm: float) -> DeepSpeedConfig:
    """One clipping value (see [Note: one clipping value] in tnlg/sharding/optimizer.py): the Trainer clips
    with max_grad_norm every step, so the config's clipping must be the same (as the HF Trainer requires
    of a DeepSpeed JSON); a config that leaves it unset (or "auto") takes max_grad_norm."""
    configured = settings.zero.gradient_clipping
    stated = "gradient_clipping" in settings.zero_sources or configured > 0
    if stated and configured != max_grad_norm:
        raise ValueError(
            f"TrainingArguments.max_grad_norm={max_grad_norm} conflicts with gradient_clipping {configured} in "
            f'{_config_name(settings)}: set them equal (or leave gradient_clipping unset / "auto", which takes '
            "max_grad_norm)"
        )
    return dataclasses.replace(settings, zero=settings.zero.replace(gradient_clipping=max_grad_norm))


def _refuse_a_scheduler_section(settings: DeepSpeedConfig) -> None:
    """The Trainer builds and steps its own scheduler (lr_scheduler_type): a JSON scheduler stepped by the
    engine as well would change the learning rate twice per step, one of them silently winning."""
    section = settings.training.scheduler
    if section is not None:
        raise ValueError(
            f"{settings.source} has a scheduler section ({section.type}), but ZeroTrainer schedules the learning "
            "rate from TrainingArguments: remove the section and set lr_scheduler_type, warmup_steps and "
            "lr_scheduler_kwargs there (or pass optimizers=(optimizer, scheduler))"
        )


# What TrainingArguments says each batch key must be, given the data-parallel size.
_BATCH_KEY_MEANINGS = {
    "gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x {replicas} data-parallel "
    "processes",
}


def _check_batch_keys(settings: DeepSpeedConfig, args: TrainingArguments, replicas: int) -> None:
    """The HF Trainer's rule for a DeepSpeed JSON: its batch keys are "auto" or what TrainingArguments
    say (the Trainer builds the loader and accumulates; the JSON cannot change either)."""
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    expected = {
        "gradient_accumulation_steps": steps,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": micro * steps * replicas,
    }
    for key, value in expected.items():
        written = getattr(settings.training, key)
        if written is not None and written != value:
            meaning = _BATCH_KEY_MEANINGS[key].format(replicas=replicas)
            raise ValueError(
                f"{settings.source} sets {key} {written} but the Trainer trains with {meaning} = {value}: set "
                'them equal (or write "auto" in the JSON, which takes the Trainer\'s value)'
            )


def _without_batch_keys(settings: DeepSpeedConfig, args: TrainingArguments) -> DeepSpeedConfig:
    """What the accelerator is given: the Trainer accumulates itself (its Accelerator steps every
    micro-batch), so the JSON's accumulation and global batch stay out of it once checked against
    TrainingArguments (`_check_batch_keys`); a micro batch key is the Trainer's, so the engine reports it."""
    training = settings.training
    micro = args.per_device_train_batch_size if training.train_micro_batch_size_per_gpu is not None else None
    return dataclasses.replace(
        settings,
        training=training.replace(
            gradient_accumulation_steps=None, train_batch_size=None, train_micro_batch_size_per_gpu=micro
        ),
    )


def _precision_setting(args: TrainingArguments) -> str:
    """How the user set the Trainer's mixed precision, for errors: its flag, else the launcher's variable."""
    flag = next((name for name in ("fp16", "bf16") if getattr(args, name)), None)
    return f"TrainingArguments.{flag}=True" if flag else launch_mixed_precision({})[1]


def _refuse_best_weights_it_cannot_load(accelerator: ZeroAccelerator, args: TrainingArguments) -> None:
    """save_only_model checkpoints hold the consolidated weights only, and load_best_model_at_end loads them
    back through the module's load_state_dict, which reaches the fp32 master at stages 0-2 of an unsliced
    engine only (see [Note: module loads] in sharding/module_loads.py): refused before training, not after."""
    if not (args.save_only_model and args.load_best_model_at_end):
        return
    dims = accelerator.parallel_dims
    layout = ["ZeRO stage 3"] if accelerator.zero_config.stage == 3 else []
    if dims is not None and dims.tensor > 1:
        layout.append(f"tensor slicing ({dims.tensor} slices)")
    if dims is not None and dims.pipeline > 1:
        layout.append(f"{dims.pipeline} pipeline stages")
    if layout:
        raise ValueError(
            f"save_only_model=True with load_best_model_at_end=True under {' and '.join(layout)}: those "
            "checkpoints hold only the consolidated weights, which this sharded engine cannot load back; set "
            "save_only_model=False (the best checkpoint's engine shards are then restored) or "
            "load_best_model_at_end=False"
        )


def _refuse_a_full_eval_cast(args: TrainingArguments) -> None:
    """bf16_full_eval / fp16_full_eval cast the whole model for an evaluation outside training: the engine
    holds its parameters, so after training the cast failed with an error about gradients (naming neither
    setting), and before it would cast the weights training then starts from."""
    for name in ("bf16_full_eval", "fp16_full_eval"):
        if getattr(args, name, False):
            precision = name.split("_")[0]
            raise ValueError(
                f"{name}=True casts the whole model for evaluation, and the ZeRO engine holds its parameters: "
                f"the engine evaluates in its training precision, so set {precision}=True to evaluate in "
                f"{precision} (or evaluate the saved model, e.g. scripts/evaluate.py --dtype), and leave {name} off"
            )


class ZeroTrainer(Trainer):
    """A `Trainer` that shards the model and optimizer with tnlg's ZeRO engine (see the module docs)."""

    def __init__(
        self, *args: Any, zero_config: ZeroConfig | Mapping | str | Path | None = None, **kwargs: Any
    ):
        # Set before Trainer.__init__, which builds the accelerator.
        self._zero_config_argument = zero_config
        self._accelerator_arguments: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ the accelerator
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        arguments = super()._build_accelerator_args(**kwargs)
        self._accelerator_arguments = dict(arguments)
        return arguments

    def create_accelerator_and_postprocess(self) -> None:
        # Trainer builds a plain Accelerator from arguments it computes (data loader config, gradient
        # accumulation plugin, mixed precision, ...): build the ZeroAccelerator from the same ones.
        super().create_accelerator_and_postprocess()
        if self._accelerator_arguments is None:
            raise RuntimeError("Trainer did not build its accelerator through _build_accelerator_args")
        settings = self._engine_settings(self._accelerator_arguments.get("mixed_precision"))
        if settings is None:
            return  # no ZeRO requested anywhere: the plain Trainer
        accelerator = ZeroAccelerator(
            zero_config=_without_batch_keys(settings, self.args), **self._accelerator_arguments
        )
        _check_batch_keys(settings, self.args, accelerator.data_parallel_size)
        _refuse_best_weights_it_cannot_load(accelerator, self.args)
        if self.args.save_on_each_node:  # the engine's checkpoint-N/engine needs storage every node shares
            refuse_node_local_saves("TrainingArguments(save_on_each_node=True)", accelerator.num_nodes)
        _refuse_a_full_eval_cast(self.args)
        if self.args.auto_find_batch_size:
            # Its retry frees the accelerator (closing the engine) and prepares the model and the old,
            # engine-bound optimizer again: the retried run would not start from what it should.
            raise ValueError(
                "auto_find_batch_size=True retries training under a new engine built from the closed one's "
                "model and optimizer: set per_device_train_batch_size (tnlg's scripts/estimate_memory.py "
                "sizes a layout) and leave auto_find_batch_size off"
            )
        asked = self.args.deepspeed or self.args.fsdp or self.args.fsdp_plugin_args is not None
        if asked or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "ZeroTrainer shards with tnlg's ZeRO engine: remove the DeepSpeed / FSDP settings from "
                "TrainingArguments (or use transformers.Trainer for them)"
            )
        self.accelerator = accelerator
        self.gather_function = accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )

    def _engine_settings(self, mixed_precision: str | None) -> DeepSpeedConfig | None:
        """The engine settings (the argument's, else the launch's `TNLG_ZERO_*`), with a DeepSpeed JSON's
        "auto" values filled from TrainingArguments as the HF Trainer fills them for DeepSpeed, its
        clipping settled against max_grad_norm, and a scheduler section refused; None without ZeRO."""
        max_grad_norm = float(self.args.max_grad_norm or 0.0)
        auto: dict[str, Any] = {
            "gradient_clipping": max_grad_norm,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "train_micro_batch_size_per_gpu": self.args.per_device_train_batch_size,
        }
        if mixed_precision:
            auto["mixed_precision"] = mixed_precision
        argument = self._zero_config_argument
        if argument is not None:
            refuse_environment_beside(
                "ZeroTrainer(zero_config=...)", "leave zero_config out to take the variable's"
            )
        settings = settings_from_environment(auto) if argument is None else engine_settings(argument, **auto)
        if settings is None:
            return None
        _refuse_a_scheduler_section(settings)
        # Settled here, where the precision can be named as the user set it (TrainingArguments.fp16, say).
        settings = settings.with_mixed_precision(mixed_precision, _precision_setting(self.args))
        return _with_max_grad_norm(settings, max_grad_norm)

    def train(self, *args: Any, **kwargs: Any):
        # The Trainer frees the accelerator at the start of each train(), closing the first run's engine,
        # then prepares the model and its engine-bound optimizer again: refused rather than half rebuilt.
        if self.engine is not None:
            raise RuntimeError(
                "ZeroTrainer.train() was called again: the first run's engine holds the model and optimizer; "
                "build a new ZeroTrainer (from the saved model, or resume_from_checkpoint) to train again"
            )
        return super().train(*args, **kwargs)

    @property
    def engine(self) -> ZeroEngine | None:
        engines = getattr(self.accelerator, "engines", None)
        return engines[0] if engines else None

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        if any(p.is_meta for p in model.parameters()):
            return  # a meta-device model (meta_from_pretrained): the engine builds each rank's shards
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ saving the model
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Transformers model directory; under ZeRO every rank must call it (the gather is collective)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.accelerator.get_state_dict(self.engine)  # full (never empty) on the main process
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(engine_directory(output_dir))  # collective: each rank its shard
        if self.args.should_save and self.lr_scheduler is not None:
            write_scheduler_states(Path(output_dir), [self.lr_scheduler])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if isinstance(self.accelerator, ZeroAccelerator) and is_deepspeed_checkpoint(resume_from_checkpoint):
            # A Trainer run under DeepSpeed: its fp32 masters come back with the engine's state, once the
            # engine exists (`_load_optimizer_and_scheduler`); at ZeRO-3 it saved no model weights at all.
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        directory = Path(checkpoint)
        if is_deepspeed_checkpoint(directory) and not (directory / ENGINE_DIRECTORY).exists():
            return self._load_deepspeed_trainer_checkpoint(directory)
        engine = engine_directory(directory)  # the old zero/ layout: an error saying to rename it
        if not engine.is_dir():
            raise FileNotFoundError(
                f"{directory} has no {engine.name}/ engine checkpoint to restore the optimizer state from: "
                f"{_why_no_engine(directory)}"
            )
        self.engine.load_checkpoint(engine)
        if self.lr_scheduler is not None:
            (state,) = read_scheduler_states(directory, 1)
            self.lr_scheduler.load_state_dict(state)

    def _load_deepspeed_trainer_checkpoint(self, directory: Path) -> None:
        """A checkpoint-N of a Trainer run under DeepSpeed (`deepspeed=` in TrainingArguments): the engine
        takes DeepSpeed's ZeRO files (fp32 masters, Adam's state, at any world size and stage: see
        docs/checkpoints.md). The Trainer's schedule comes from the scheduler.pt the Trainer wrote beside
        them (read with torch.load(weights_only=True), as the Trainer reads it), else from DeepSpeed's files,
        where it sits when the JSON had an optimizer section. The Trainer's own state and RNG files are the
        plain Trainer's, read as it reads them (RNG states at the same world size only)."""
        summary = self.engine.load_checkpoint(directory)
        if self.lr_scheduler is None:
            return
        path = directory / SCHEDULER_NAME
        saved = summary.get("lr_scheduler")
        if path.is_file():
            self.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        elif isinstance(saved, Mapping) and set(saved) == set(self.lr_scheduler.state_dict()):
            self.lr_scheduler.load_state_dict(dict(saved))
        else:
            raise FileNotFoundError(
                f"{directory} is a DeepSpeed checkpoint of a Trainer run, but holds no state of the Trainer's "
                f"learning-rate schedule (no {SCHEDULER_NAME}, and DeepSpeed's files hold "
                f"{'none' if saved is None else 'its own JSON scheduler'}): a ZeroTrainer cannot continue its "
                "schedule. Convert the weights (scripts/convert_checkpoint.py --from deepspeed) and start a new "
                "run from them, or resume with ZeroAccelerator / tnlg.sharding.initialize and the JSON's "
                "scheduler section, which restore DeepSpeed's schedule"
            )

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        best = Path(self.state.best_model_checkpoint)
        if is_deepspeed_checkpoint(best) and not (best / ENGINE_DIRECTORY).exists():
            # a run resumed from a Trainer run under DeepSpeed whose best checkpoint is still that run's
            logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
            self.engine.load_checkpoint(best)
            return None
        if self.args.save_only_model:
            # The checkpoints hold the consolidated fp32 master weights only: the Trainer loads them into
            # self.model, the engine's module, whose loads write the master too (stages 0-2 of an unsliced
            # engine, as checked when the trainer was built). The optimizer state stays, as with the plain Trainer.
            return super()._load_best_model()
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        self.engine.load_checkpoint(engine_directory(best))
        return None


def _why_no_engine(directory: Path) -> str:
    """What a checkpoint without engine shards (nor DeepSpeed's) is, and how to go on from it."""
    if (directory / OPTIMIZER_NAME).is_file():
        return f"it was written by a Trainer without the ZeRO engine (its {OPTIMIZER_NAME} is unsharded)"
    if any((directory / name).is_file() for name in _WEIGHT_FILES):
        return (
            "it was saved with save_only_model=True, which keeps the model's weights alone (no optimizer or "
            "scheduler state), so training cannot resume from it exactly: start a new run from its weights "
            "(from_pretrained on that directory), or save checkpoints without save_only_model to resume"
        )
    return "it was not written by a ZeroTrainer with the ZeRO engine on"
