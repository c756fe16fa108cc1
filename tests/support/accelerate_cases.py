"""What each rank runs in the ZeroAccelerator tests: the standard Accelerate loop."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from accelerate import Accelerator

from tests.support.zero_tnlg_cases import debug_model
from tnlg.accelerate import ZeroAccelerator
from tnlg.sharding import ZeroConfig
from tnlg.sharding.checkpoint import CheckpointError

STEPS, ACCUMULATION, MICRO_BATCH = 4, 2, 2


def _loader(world_size: int):
    generator = torch.Generator().manual_seed(5)
    data = torch.randint(0, 512, (STEPS * ACCUMULATION * MICRO_BATCH * world_size, 24), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in data]
    return torch.utils.data.DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False)


def accelerate_loop(rank: int, world_size: int, stage: int | None, save_to: str | None = None) -> dict:
    """Losses of the documented loop; stage None runs plain `Accelerator` (DDP)."""
    if stage is None:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    else:
        accelerator = ZeroAccelerator(
            zero_config=ZeroConfig(stage=stage), gradient_accumulation_steps=ACCUMULATION
        )
    model = debug_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _loader(world_size), scheduler
    )
    losses, norms, lrs = [], [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        lrs.append(optimizer.param_groups[0]["lr"])
    result = {"losses": losses, "norms": norms, "lrs": lrs}
    if save_to is not None and stage is None:  # plain Accelerate's recipe for a from_pretrained directory
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(save_to, max_shard_size="100KB")
        accelerator.wait_for_everyone()
    elif save_to is not None:
        accelerator.save_model(model, save_to, max_shard_size="100KB")
        result["unwrapped"] = type(accelerator.unwrap_model(model)).__name__
    return result


def prepared(stage: int, **accelerator_options):
    """A ZeroAccelerator (given `accelerator_options` besides) with the debug model, AdamW, the loader
    and a scheduler prepared."""
    accelerator = ZeroAccelerator(
        zero_config=ZeroConfig(stage=stage), gradient_accumulation_steps=ACCUMULATION, **accelerator_options
    )
    model = debug_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return accelerator, *accelerator.prepare(model, optimizer, _loader(2), scheduler)


def train_loop(accelerator, model, optimizer, batches, scheduler, augment=None) -> list[float]:
    """The documented loop's losses; `augment(batch)` changes each batch before the forward."""
    losses = []
    for batch in batches:
        batch = augment(batch) if augment is not None else batch
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def save_and_load_state(rank: int, world_size: int, stage: int, directory: str) -> dict:
    """Uninterrupted losses, the losses after save_state halfway and load_state into fresh objects, the
    files save_state wrote, and what load_state says on each rank once rank 1's state file is gone."""
    whole = train_loop(*prepared(stage))
    # Train the first half, save, then continue in fresh objects from the saved state.
    accelerator, model, optimizer, loader, scheduler = prepared(stage)
    half = len(loader) // 2
    train_loop(accelerator, model, optimizer, itertools.islice(loader, half), scheduler)
    accelerator.save_state(directory)
    accelerator, model, optimizer, loader, scheduler = prepared(stage)
    accelerator.load_state(directory)
    rest = train_loop(accelerator, model, optimizer, accelerator.skip_first_batches(loader, half), scheduler)
    files = sorted(path.name for path in Path(directory).iterdir())
    accelerator.wait_for_everyone()
    if rank == 1:
        (Path(directory) / "rank-00001.json").unlink()
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(directory)
        missing = None
    except CheckpointError as error:
        missing = str(error)
    return {"whole": whole, "rest": rest, "half": half, "files": files, "missing": missing}


class WarningRecords(logging.Handler):
    """The messages of the warnings logged while it is attached (to the "tnlg" logger, say)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def refusal(call) -> str | None:
    """The message of the ValueError or RuntimeError (CheckpointError among them) `call()` raises, or None."""
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


class Unsaveable:
    """An object registered for checkpointing whose state_dict neither JSON nor safetensors can hold."""

    def state_dict(self):
        return {"opened": object()}

    def load_state_dict(self, state):
        pass
