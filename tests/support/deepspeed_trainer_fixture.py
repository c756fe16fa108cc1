"""A Transformers Trainer run under DeepSpeed (`TrainingArguments(deepspeed=...)`), as its users have them,
in tests/assets/deepspeed/trainer_stage2_world2, and the script that wrote it:

    pip install deepspeed            # 0.19.8 wrote the committed one, on torch 2.13 (CPU)
    DS_ACCELERATOR=cpu python -m tests.support.deepspeed_trainer_fixture

Two gloo processes on the CPU train the fixtures' tiny TNLG model (tests/support/deepspeed_fixtures.py)
with the Trainer's own AdamW and linear warmup-decay schedule, DeepSpeed's ZeRO stage 2 and the JSON's
"auto" values filled by the Trainer, for STEPS steps, saving `checkpoint-SAVE_AT` (the Trainer's files:
trainer_state.json, each process's rng_state_R.pth, model.safetensors, the schedule's scheduler.pt;
DeepSpeed's: `latest`, global_stepN/). A second Trainer under DeepSpeed resumes
that checkpoint: its logged losses after the save are what a ZeroTrainer resuming the same checkpoint
must reproduce (and the learning rates it logged), in `record.json` beside it with those of the
uninterrupted run. Only checkpoint-SAVE_AT
is kept, without DeepSpeed's copies of its consolidation scripts and training_args.bin (a pickle nothing
here reads).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from tests.support.deepspeed_fixtures import ASSETS, GLOBAL_BATCH, global_batch, initial_model
from tests.support.trainer_cases import CPU_TRAINER_ARGUMENTS

DIRECTORY = ASSETS / "trainer_stage2_world2"
WORLD, SAVE_AT, STEPS = 2, 3, 8
CHECKPOINT = DIRECTORY / f"checkpoint-{SAVE_AT}"
# The run's DeepSpeed JSON as Trainer users write it: every value the Trainer knows is "auto".
DEEPSPEED_JSON = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,  # the Trainer's torch AdamW
}


class StepBatches(torch.utils.data.Dataset):
    """STEPS global batches of `global_batch(step)`'s rows: the same data whatever the world size."""

    def __len__(self) -> int:
        return STEPS * GLOBAL_BATCH

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = global_batch(index // GLOBAL_BATCH)[index % GLOBAL_BATCH]
        return {"input_ids": ids, "labels": ids}


def training_arguments(output_dir: str, world: int, **extra):
    """The run's TrainingArguments at `world` processes (the same global batch of GLOBAL_BATCH)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=STEPS,
        save_steps=SAVE_AT,
        learning_rate=1e-2,
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        **CPU_TRAINER_ARGUMENTS,
        **extra,
    )


def logged(trainer) -> dict[str, dict[int, float]]:
    """The loss (averaged over the processes), gradient norm and learning rate the Trainer logged at each
    step."""
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    names = {"losses": "loss", "norms": "grad_norm", "lrs": "learning_rate"}
    return {key: {entry["step"]: entry[name] for entry in entries} for key, name in names.items()}


def write(rank: int, phase: str) -> None:
    """`phase` "whole": the uninterrupted run, saving checkpoint-SAVE_AT; "resumed": a fresh Trainer resuming
    it (a process of its own: Accelerate takes one DeepSpeed plugin per process)."""
    from transformers import Trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    output = DIRECTORY / "run"
    args = training_arguments(str(output), WORLD, deepspeed=DEEPSPEED_JSON)
    trainer = Trainer(model=initial_model(), args=args, train_dataset=StepBatches())
    trainer.train(resume_from_checkpoint=str(output / CHECKPOINT.name) if phase == "resumed" else None)
    if rank == 0:
        (DIRECTORY / f"{phase}.json").write_text(json.dumps(logged(trainer)))
    torch.distributed.barrier()


def resume_in_zero_trainer(
    rank: int, world: int, stage: int, output_dir: str, checkpoint: str, best: bool = False
) -> dict:
    """A ZeroTrainer with the run's DeepSpeed JSON (at `stage`) resuming `checkpoint` at `world` processes:
    what it logged at each step (`logged`) and the steps it reached. `best`: after training, the best
    model is loaded from `checkpoint` (a resumed run whose best checkpoint is still the DeepSpeed run's)
    and the parameters it gives come back too."""
    from tnlg.trainer import ZeroTrainer

    config = {**DEEPSPEED_JSON, "zero_optimization": {"stage": stage}}
    trainer = ZeroTrainer(
        model=initial_model(),
        args=training_arguments(output_dir, world, save_strategy="no"),
        train_dataset=StepBatches(),
        zero_config=config,
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    result = {**logged(trainer), "global_step": trainer.state.global_step}
    if best:
        trainer.state.best_model_checkpoint = checkpoint
        trainer._load_best_model()
        result["best"] = trainer.engine.full_state_dict()
    return result


def keep_the_checkpoint() -> None:
    """checkpoint-SAVE_AT moved out of the run, the record beside it, the rest removed."""
    import deepspeed
    import transformers

    record = {
        "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "world": WORLD, "deepspeed_json": DEEPSPEED_JSON,
        **{phase: json.loads((DIRECTORY / f"{phase}.json").read_text()) for phase in ("whole", "resumed")},
    }  # fmt: skip
    shutil.move(str(DIRECTORY / "run" / CHECKPOINT.name), CHECKPOINT)
    shutil.rmtree(DIRECTORY / "run")
    phases = [DIRECTORY / "whole.json", DIRECTORY / "resumed.json"]
    for leftover in [*CHECKPOINT.glob("zero_to_*.py"), CHECKPOINT / "training_args.bin", *phases]:
        leftover.unlink(missing_ok=True)
    (DIRECTORY / "record.json").write_text(json.dumps(record, indent=2) + "\n")


def main() -> int:
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        print("set DS_ACCELERATOR=cpu (the fixture is written on the CPU, over gloo)", file=sys.stderr)
        return 2
    shutil.rmtree(DIRECTORY, ignore_errors=True)
    Path(DIRECTORY).mkdir(parents=True)
    for port, phase in enumerate(("whole", "resumed"), start=29790):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.multiprocessing.spawn(write, args=(phase,), nprocs=WORLD, join=True)
    keep_the_checkpoint()
    print(f"wrote {DIRECTORY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
