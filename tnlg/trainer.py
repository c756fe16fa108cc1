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
- Gradient accumulation stays the Trainer's: the engine's `no_sync` on the inner micro-batches.
- `save_model` consolidates the parameters on the main process (every rank takes part) and refuses to
  write an empty model, the ZeRO-3 failure DeepSpeed users meet under Trainer.
- A checkpoint holds every rank's engine shard (fp32 master weights and optimizer state, in
  `checkpoint-N/engine/`, as in run checkpoints and `save_state`) and the scheduler as JSON
  (`scheduler.json`, see tnlg.state_files) next to the Trainer's own files; resuming restores them
  exactly, and `load_best_model_at_end` restores the best checkpoint's shards. A checkpoint written
  with the old `zero/` directory is refused with the rename that makes it load.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import Trainer

from tnlg.accelerate import ZeroAccelerator
from tnlg.sharding import ZeroConfig, ZeroEngine
from tnlg.sharding.checkpoint import engine_directory
from tnlg.sharding.deepspeed.zero_checkpoint import is_deepspeed_checkpoint
from tnlg.state_files import read_scheduler_states, write_scheduler_states

logger = logging.getLogger(__name__)


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
        accelerator = ZeroAccelerator(zero_config=self._zero_config_argument, **self._accelerator_arguments)
        if accelerator.zero_config is None:
            return  # no ZeRO requested anywhere: the plain Trainer
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

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        directory = Path(checkpoint)
        engine = engine_directory(directory)  # the old zero/ layout: an error saying to rename it
        if not engine.is_dir():
            written = (
                "it is a DeepSpeed checkpoint (a Trainer run with deepspeed=), which a ZeroTrainer does not "
                "resume: start from its weights (scripts/convert_checkpoint.py --from deepspeed, then "
                "from_pretrained), or load all of it into trainer.engine with engine.load_checkpoint"
                if is_deepspeed_checkpoint(directory)
                else "it was not written by a ZeroTrainer with the ZeRO engine on"
            )
            raise FileNotFoundError(
                f"{directory} has no {engine.name}/ engine checkpoint: {written}, so its optimizer state "
                "cannot be restored"
            )
        self.engine.load_checkpoint(engine)
        if self.lr_scheduler is not None:
            (state,) = read_scheduler_states(directory, 1)
            self.lr_scheduler.load_state_dict(state)

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        best = Path(self.state.best_model_checkpoint)
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        self.engine.load_checkpoint(engine_directory(best))
