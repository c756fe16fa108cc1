"""What each rank runs in the ZeroTrainer tests: `Trainer.train()` on the debug model."""

from __future__ import annotations

import functools

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from tests.support.zero_tnlg_cases import debug_model
from tnlg import TNLGForCausalLM
from tnlg.sharding import ZeroConfig, meta_from_pretrained
from tnlg.trainer import ZeroTrainer

MICRO_BATCH, ACCUMULATION = 2, 2
# TrainingArguments for a test's gloo CPU processes: no reporting, no progress bar, loading in-process.
CPU_TRAINER_ARGUMENTS = {
    "report_to": [],
    "use_cpu": True,
    "ddp_backend": "gloo",
    "seed": 0,
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


def dataset(world_size: int, steps: int = 4) -> list[dict[str, torch.Tensor]]:
    """Counting sequences from random starts: learnable, so the loss visibly falls in a few steps."""
    generator = torch.Generator().manual_seed(7)
    starts = torch.randint(0, 512, (steps * ACCUMULATION * MICRO_BATCH * world_size, 1), generator=generator)
    rows = (starts + torch.arange(24)) % 512
    return [{"input_ids": row, "labels": row} for row in rows]


class StopAfter(TrainerCallback):
    """Ends training after `step` optimizer steps, as a crash or a preemption would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def train(
    rank: int,
    world_size: int,
    stage: int | None,
    output_dir: str,
    max_steps: int = 4,
    resume: bool = False,
    save_final: bool = True,
    stop_after: int | None = None,
    bf16: bool = False,
    pretrained: str | None = None,
    compile_backend: str | None = None,
    save_only_model: bool = False,
) -> dict:
    """Losses and gradient norms logged per step, and the final parameters; stage None is the plain
    `Trainer` (DDP). Checkpoints are written every 2 steps; `stop_after` interrupts the run there (the
    schedule still spans `max_steps`). `pretrained` starts from a saved model built on the meta device,
    each rank reading only its shards of it. `compile_backend` turns on the Trainer's `torch_compile`;
    `save_only_model` writes checkpoints of the weights alone."""
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=max_steps,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.1,  # the Trainer's decay groups (no decay on biases and LayerNorms)
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        **CPU_TRAINER_ARGUMENTS,
        bf16=bf16,
        torch_compile=compile_backend is not None,
        torch_compile_backend=compile_backend,
        save_only_model=save_only_model,
    )
    make = Trainer if stage is None else functools.partial(ZeroTrainer, zero_config=ZeroConfig(stage=stage))
    callbacks = [StopAfter(stop_after)] if stop_after else []
    model = debug_model() if pretrained is None else meta_from_pretrained(TNLGForCausalLM, pretrained)
    trainer = make(model=model, args=args, train_dataset=dataset(world_size), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume or None)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    engines = getattr(trainer.accelerator, "engines", [])  # the plain Trainer's Accelerator has none
    result = {
        "steps": [entry["step"] for entry in history],
        "losses": [entry["loss"] for entry in history],
        "norms": [entry["grad_norm"] for entry in history],
        "lrs": [entry["learning_rate"] for entry in history],
        "accelerator": type(trainer.accelerator).__name__,
        "parameter_dtype": str(next(trainer.model.parameters()).dtype),
        "compiled_blocks": [b for e in engines for b in e.compiled_blocks],
        "compiles": sum((e.compile_stats() or {"compiles": 0})["compiles"] for e in engines),
    }
    if save_final:
        trainer.save_model(f"{output_dir}/final")
    return result
