"""What each rank runs in the DeepSpeed JSON tests (module-level so that spawned processes can import it)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import GradientAccumulationPlugin

from tests.support.zero_models import GLOBAL_BATCH, batches, local, make_model
from tests.support.zero_tnlg_cases import debug_model
from tnlg.accelerate import ZeroAccelerator
from tnlg.sharding import WarmupDecayLR, ZeroConfig, initialize

STEPS, ACCUMULATION, LR, CLIP = 6, 4, 1e-2, 0.5
WARMUP = {"warmup_min_lr": LR / 10, "warmup_max_lr": LR, "warmup_num_steps": 2, "warmup_type": "linear"}
SCHEDULE = {**WARMUP, "total_num_steps": STEPS}
ADAM = {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
# Small buckets, as in zero_cases.SMALL, so that the tiny model is cut into several units per group.
SMALL = {
    "reduce_bucket_size": 64,
    "stage3_param_persistence_threshold": 20,
    "stage3_prefetch_bucket_size": 600,
}
REDUCTIONS = ("all_reduce", "reduce_scatter")


def zero(**section) -> dict:
    return {"zero_optimization": section}


def adamw(**params) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


def deepspeed_json(stage: int) -> dict:
    """Accumulation over 4 micro-batches, the micro batch derived from the global one and the world size;
    DeepSpeed's "Adam" (decoupled weight decay), WarmupDecayLR and clipping, all from the JSON."""
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "Adam", "params": ADAM},
        "scheduler": {"type": "WarmupDecayLR", "params": SCHEDULE},
        "zero_optimization": {"stage": stage, **SMALL},
        "steps_per_print": 10,
    }


def train_reference() -> dict:
    """One process, one step per global batch: torch's AdamW, clip_grad_norm_, the same schedule."""
    model = make_model()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    scheduler = WarmupDecayLR(optimizer, **SCHEDULE)
    losses, norms, lrs = [], [], []
    for input_ids, labels in batches(STEPS):
        loss = model(input_ids, labels)
        loss.backward()
        for param in parameters:  # the engine updates an unused parameter as if its gradient were zero
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        norms.append(float(torch.nn.utils.clip_grad_norm_(parameters, CLIP)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append(scheduler.get_last_lr()[0])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "lrs": lrs, "state": state}


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        return value.item() / dist.get_world_size()
    return value.item()


def train_with_deepspeed_json(rank: int, world_size: int, stage: int) -> dict:
    """DeepSpeed's loop: backward and step on every micro-batch; the engine decides the boundaries."""
    engine = initialize(make_model(), None, deepspeed_json(stage))
    micro = engine.train_micro_batch_size_per_gpu()
    losses, norms, lrs, boundaries, stepped, reductions = [], [], [], [], [], []
    for batch in batches(STEPS):
        input_ids, labels = local(batch, rank, world_size)
        total = torch.zeros(())
        for ids, lab in zip(input_ids.split(micro), labels.split(micro), strict=True):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.reset_comm_stats()
            loss = engine(ids, lab)
            engine.backward(loss)
            reductions.append(sum(c["calls"] for k, c in engine.comm_stats().items() if k in REDUCTIONS))
            stepped.append(engine.step())
            total += loss.detach() / ACCUMULATION
        losses.append(_mean_over_ranks(total))
        norms.append(engine.get_global_grad_norm())
        lrs.append(engine.lr_scheduler.get_last_lr()[0])
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "boundaries": boundaries,
        "stepped": stepped,
        "reductions": reductions,
        "micro": micro,
        "accumulation": engine.gradient_accumulation_steps(),
        "global_steps": engine.global_steps,
        "optimizer": type(engine.optimizer.optimizer).__name__,
        "state": engine.full_state_dict(),
    }


def every_stage(rank: int, world_size: int) -> dict:
    return {stage: train_with_deepspeed_json(rank, world_size, stage) for stage in (0, 1, 2, 3)}


# ----------------------------------------------------------------------------------------- Accelerate
ACCELERATE_STEPS, ACCELERATE_ACCUMULATION, ACCELERATE_MICRO = 3, 2, 2


def _loader(world_size: int):
    generator = torch.Generator().manual_seed(5)
    rows = ACCELERATE_STEPS * ACCELERATE_ACCUMULATION * ACCELERATE_MICRO * world_size
    data = torch.randint(0, 512, (rows, 24), generator=generator)
    dataset = [{"input_ids": row, "labels": row} for row in data]
    return torch.utils.data.DataLoader(dataset, batch_size=ACCELERATE_MICRO, shuffle=False)


def _accelerate_loop(accelerator: ZeroAccelerator, world_size: int) -> dict:
    model = debug_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(world_size))
    losses, steps = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        steps.append(model.global_steps)
    return {
        "losses": losses,
        "global_steps": steps,
        "accelerator_accumulation": accelerator.gradient_accumulation_steps,
        "engine_accumulation": model.gradient_accumulation_steps(),
        "micro": model.train_micro_batch_size_per_gpu(),
    }


def accelerate_json_accumulation(rank: int, world_size: int, path: str, stage: int) -> dict:
    """The JSON at `path` sets the accumulation; the same loop with it given to the Accelerator instead."""
    from_json = _accelerate_loop(ZeroAccelerator(zero_config=path), world_size)
    given = _accelerate_loop(
        ZeroAccelerator(
            zero_config=ZeroConfig(stage=stage), gradient_accumulation_steps=ACCELERATE_ACCUMULATION
        ),
        world_size,
    )
    return {"json": from_json, "given": given}


# ------------------------------------------------------------------------- schedule and checkpoints
def engine_with_schedule(stage: int = 1, **extra):
    ds = {
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_type": "linear"}},
        **zero(stage=stage),
        **extra,
    }
    return initialize(make_model(), None, ds)


def micro_steps(engine, first: int, last: int) -> list[float]:
    """Backward and step on micro-batches first..last-1 (the same data for every engine)."""
    losses = []
    for input_ids, labels in batches(8, seed=7)[first:last]:
        loss = engine(input_ids, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_and_resume(rank: int, world_size: int, directory: str) -> dict:
    """Micro-steps 0-7 uninterrupted, and 4-7 again after a save at the boundary and a load into a new
    engine; the refused save inside the window and the refused load without the schedule."""
    whole = engine_with_schedule()
    uninterrupted = micro_steps(whole, 0, 8)
    first = engine_with_schedule()
    micro_steps(first, 0, 3)
    try:
        first.save_checkpoint(directory)
        mid_window = None
    except RuntimeError as error:
        mid_window = str(error)
    micro_steps(first, 3, 4)
    first.save_checkpoint(directory)
    second = engine_with_schedule()
    second.load_checkpoint(directory)
    iteration = second.lr_scheduler.last_batch_iteration
    rest = micro_steps(second, 4, 8)
    (Path(directory) / "lr_scheduler.json").unlink()
    schedule_missing = None
    try:
        engine_with_schedule().load_checkpoint(directory)
    except ValueError as error:
        schedule_missing = str(error)
    return {
        "uninterrupted": uninterrupted,
        "rest": rest,
        "iteration": iteration,
        "lr": whole.lr_scheduler.get_last_lr(),
        "resumed_lr": second.lr_scheduler.get_last_lr(),
        "mid_window": mid_window,
        "schedule_missing": schedule_missing,
    }


# ----------------------------------------------------------------------------------- refusals
def accelerator_refusals(rank: int, world_size: int) -> dict:
    """The error (or "accepted") of each ZeroAccelerator set up against its DeepSpeed config."""

    def refused(make) -> str:
        try:
            make()
        except ValueError as error:
            return str(error)
        return "accepted"

    def prepared(ds: dict, *objects):
        def make():
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            ZeroAccelerator(zero_config=ds).prepare(model, optimizer, *(o(optimizer) for o in objects))

        return make

    schedule = {"scheduler": {"type": "WarmupLR", "params": {}}, **zero(stage=1)}
    # Read at once: every Accelerator of a process shares one GradientState.
    auto = ZeroAccelerator(
        zero_config={"gradient_accumulation_steps": "auto", **zero(stage=1)}, gradient_accumulation_steps=4
    ).gradient_accumulation_steps
    return {
        "steps": refused(
            lambda: ZeroAccelerator(
                zero_config={"gradient_accumulation_steps": 2, **zero(stage=1)}, gradient_accumulation_steps=4
            )
        ),
        "plugin": refused(
            lambda: ZeroAccelerator(
                zero_config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, **zero(stage=1)},
                gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
            )
        ),
        "batch": refused(
            lambda: ZeroAccelerator(
                zero_config={
                    "train_batch_size": 8,
                    "gradient_accumulation_steps": 3,
                    "train_micro_batch_size_per_gpu": 2,
                }
            )
        ),
        "auto": auto,
        "optimizer": refused(prepared({**adamw(), **zero(stage=1)})),
        "scheduler": refused(prepared(schedule, lambda o: torch.optim.lr_scheduler.StepLR(o, 1))),
        "scheduler_alone": refused(prepared(schedule)),
        "precision": refused(
            lambda: ZeroAccelerator(zero_config={"bf16": {"enabled": True}}, mixed_precision="fp16")
        ),
    }
