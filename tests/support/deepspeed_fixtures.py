"""The DeepSpeed ZeRO checkpoints in tests/assets/deepspeed, written by DeepSpeed itself, and the script
that wrote them.

    pip install deepspeed            # 0.19.8 wrote the committed ones, on torch 2.13 (CPU)
    DS_ACCELERATOR=cpu python -m tests.support.deepspeed_fixtures [CASE ...]   # all cases, or those named

For each case, `world` gloo processes on the CPU train the tiny TNLG model below under DeepSpeed
(fp32, torch's AdamW as the client optimizer, ZeRO stage `stage`) for SAVE_AT steps and call
`engine.save_checkpoint(DIR/checkpoint-3)`, which writes the Transformers Trainer's layout
(`checkpoint-3/latest` naming `global_step3/`), and the model's config.json beside it as the Trainer
does. One case trains a Transformers `GPT2LMHeadModel` of the same shape instead (`--from deepspeed` of
a GPT-2 run). A fresh DeepSpeed engine then loads that checkpoint
and trains RESUMED_STEPS more steps: its losses, DeepSpeed's own resumed run, are what tnlg's resumed
run must reproduce, in `resumed_losses.json` beside the checkpoint. The batches are `global_batch(step)`:
every rank takes its contiguous share of the same global batch, so any world size sees the same data.

The fp16 cases train under DeepSpeed's dynamic loss scaler, from a scale at which the first steps
overflow, and save where its position matters: after one overflow the hysteresis absorbed (step 1),
and two clean steps into a growth window (step 4). Their record adds the loss scale each resumed step
ran at and whether its update was applied. DeepSpeed's CPU accelerator reports fp16 only where oneDNN
has fp16 kernels (AVX512-FP16 or AMX-FP16), which CPUs without them lack although torch runs every op
of this model in fp16 there, so for these cases its check is answered yes.

One case takes 2 micro-batches a step (`gradient_accumulation_steps` 2): forward, backward and step for
each, as a DeepSpeed training loop calls them; its record counts optimizer steps.

The bf16 cases train with the module in bf16 (DeepSpeed's bf16_zero_pp_rank_* files) at ZeRO 1-3; at
stage 1 with fp32 gradient accumulation (`data_types.grad_accum_dtype`), for which DeepSpeed takes its
BF16_Optimizer instead of ZeRO's and saves no `zero_stage`.

DeepSpeed's copy of its consolidation script (zero_to_torch.py in 0.19) is dropped from the committed tree (it is DeepSpeed's code, and
nothing here runs it); the rest is as DeepSpeed wrote it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from tnlg import TNLGConfig, TNLGForCausalLM

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "deepspeed"
SAVE_AT = 3
RESUMED_STEPS = 3
GLOBAL_BATCH = 4
SEQUENCE = 16
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CHECKPOINT = f"checkpoint-{SAVE_AT}"


@dataclass(frozen=True)
class Case:
    stage: int
    world: int
    warmup: bool = False  # DeepSpeed's WarmupLR, still warming up when saved and after
    model: str = "tnlg"  # or "gpt2": a Transformers GPT2LMHeadModel of the same shape
    precision: str = "fp32"  # or "fp16" (under DeepSpeed's dynamic loss scaler, FP16_SCALING) or "bf16"
    # bf16 at stage 1 with fp32 gradient accumulation (data_types.grad_accum_dtype): DeepSpeed's BF16_Optimizer
    fp32_gradients: bool = False
    accumulation: int = 1  # micro-batches per optimizer step (gradient_accumulation_steps)
    save_at: int = SAVE_AT

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"

    @property
    def name(self) -> str:
        name = f"stage{self.stage}_world{self.world}" + ("_gpt2" if self.model == "gpt2" else "")
        name += f"_accumulation{self.accumulation}" if self.accumulation > 1 else ""
        if self.precision == "bf16":
            return name + "_bf16" + ("_fp32_gradients" if self.fp32_gradients else "")
        return name + (f"_fp16_step{self.save_at}" if self.fp16 else "")

    @property
    def checkpoint(self) -> Path:
        return self.directory / f"checkpoint-{self.save_at}"

    @property
    def directory(self) -> Path:
        return ASSETS / self.name


CASES = (
    Case(stage=1, world=2),
    Case(stage=2, world=2, warmup=True),
    Case(stage=3, world=4),
    Case(stage=3, world=2, model="gpt2"),
    Case(stage=2, world=2, precision="fp16", save_at=1),
    Case(stage=2, world=2, precision="fp16", save_at=4),
    Case(stage=1, world=2, precision="bf16", fp32_gradients=True),
    Case(stage=2, world=2, precision="bf16"),
    Case(stage=3, world=2, precision="bf16"),
    Case(stage=2, world=2, warmup=True, accumulation=2),
)
# From 2**18 this model's gradients overflow fp16 at the first two steps, then not at 2**17.
FP16_SCALING = {"initial_scale_power": 18, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 1}


def tiny_config() -> TNLGConfig:
    """Two layers, hidden 32, a 96-token vocabulary, tied embeddings, no dropout (so that the losses
    compare exactly)."""
    return TNLGConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SEQUENCE, embedding_dropout=0.0, attention_dropout=0.0,
        hidden_dropout=0.0, fused_kernels="none",
    )  # fmt: skip


def initial_model(kind: str = "tnlg") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2LMHeadModel

        from tnlg.tools.convert import gpt2_config

        config = gpt2_config(tiny_config())
        config.use_cache = False
        return GPT2LMHeadModel(config)
    return TNLGForCausalLM(tiny_config())


def global_batch(step: int) -> torch.Tensor:
    """Step `step`'s (GLOBAL_BATCH, SEQUENCE) token ids; the labels are the ids (the model shifts)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, tiny_config().vocab_size, (GLOBAL_BATCH, SEQUENCE), generator=generator)


def rank_share(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    share = batch.shape[0] // world
    return batch[rank * share : (rank + 1) * share]


def deepspeed_config(case: Case) -> dict:
    stage, world = case.stage, case.world
    schedule = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": ADAMW["lr"], "warmup_num_steps": 8},
    }
    return {
        **({"scheduler": schedule} if case.warmup else {}),
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world * case.accumulation),
        "gradient_accumulation_steps": case.accumulation,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW: no DeepSpeed op to build
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        **({"fp16": {"enabled": True, **FP16_SCALING}} if case.fp16 else {}),
        **({"bf16": {"enabled": True}} if case.precision == "bf16" else {}),
        **({"data_types": {"grad_accum_dtype": "fp32"}} if case.fp32_gradients else {}),
    }


class Trace(NamedTuple):
    losses: list[float]  # each step's loss averaged over its micro-batches and the ranks (the global batch's)
    lrs: list[float]  # with `lr`: the lr each step used
    loss_scales: list[float]  # with `loss_scale`: the scale each step's backward ran at
    applied: list[bool]  # with `applied`: whether each step's update was applied (not an fp16 overflow)


def train_steps(
    engine,
    steps: range,
    rank: int,
    world: int,
    lr: Callable[[], float] | None = None,
    loss_scale: Callable[[], float] | None = None,
    applied: Callable[[], bool] | None = None,
    accumulation: int = 1,
) -> Trace:
    """Optimizer steps of a DeepSpeed or a tnlg engine (the same calls: forward, backward and step for each
    of a step's `accumulation` micro-batches, the rank's share of the global batch cut in that many); the
    callables read the engine's lr and loss scale before each step and whether its update was applied
    after it."""
    trace = Trace([], [], [], [])
    for step in steps:
        if lr is not None:
            trace.lrs.append(lr())
        if loss_scale is not None:
            trace.loss_scales.append(float(loss_scale()))
        mean = torch.zeros(())
        for ids in rank_share(global_batch(step), rank, world).chunk(accumulation):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            mean += loss.detach().float()
        if applied is not None:
            trace.applied.append(bool(applied()))
        torch.distributed.all_reduce(mean)
        trace.losses.append(mean.item() / (world * accumulation))
    return trace


def write_case(rank: int, case: Case) -> None:
    import deepspeed

    world = case.world
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    if case.fp16:  # see the module's docstring
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    config = deepspeed_config(case)

    model = initial_model(case.model)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    first = train_steps(engine, range(case.save_at), rank, world, accumulation=case.accumulation)
    engine.save_checkpoint(str(case.checkpoint))
    if rank == 0:  # as the Transformers Trainer saves it beside DeepSpeed's files
        model.config.save_pretrained(case.checkpoint)
    torch.distributed.barrier()

    model = initial_model(case.model)  # a fresh engine, as a resumed job builds it; load_checkpoint fills it
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.load_checkpoint(str(case.checkpoint))
    resumed = train_steps(
        engine,
        range(case.save_at, case.save_at + RESUMED_STEPS),
        rank,
        world,
        lr=lambda: engine.optimizer.param_groups[0]["lr"],
        loss_scale=(lambda: engine.optimizer.loss_scale) if case.fp16 else None,
        applied=engine.was_step_applied if case.fp16 else None,
        accumulation=case.accumulation,
    )
    if rank == 0:
        record = {
            "deepspeed": deepspeed.__version__, "torch": torch.__version__, "stage": case.stage,
            "world": world, "config": config, "adamw": {**ADAMW, "betas": list(ADAMW["betas"])},
            "losses_before_save": first.losses, "resumed_losses": resumed.losses, "resumed_lrs": resumed.lrs,
            **({"resumed_loss_scales": resumed.loss_scales, "resumed_applied": resumed.applied} if case.fp16 else {}),
        }  # fmt: skip
        (case.directory / "resumed_losses.json").write_text(json.dumps(record, indent=2) + "\n")
        for script in case.checkpoint.glob("zero_to_*.py"):
            script.unlink()
    torch.distributed.destroy_process_group()


def main(names: list[str]) -> int:
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        print("set DS_ACCELERATOR=cpu (the fixtures are written on the CPU, over gloo)", file=sys.stderr)
        return 2
    unknown = sorted(set(names) - {case.name for case in CASES})
    if unknown:
        print(f"no such case: {unknown}; the cases are {[case.name for case in CASES]}", file=sys.stderr)
        return 2
    for index, case in enumerate(CASES):
        if names and case.name not in names:
            continue
        shutil.rmtree(case.directory, ignore_errors=True)
        case.directory.mkdir(parents=True)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + index))
        torch.multiprocessing.spawn(write_case, args=(case,), nprocs=case.world, join=True)
        print(f"wrote {case.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
