"""What each rank runs in the ZeRO tests (module-level so that spawned processes can import it)."""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize

STEPS = 10
# Small buckets and a low persistence threshold, so that even this tiny model is cut into several
# units per group and stage 3 has both gathered and persistent parameters.
SMALL = {"reduce_bucket_size": 64, "param_persistence_threshold": 20, "prefetch_bucket_size": 600}


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_engine(
    rank: int,
    world_size: int,
    accumulation: int = 1,
    use_no_sync: bool = True,
    eval_between: bool = False,
    blocks: str = "no_split",
    optimizer: str = "adamw",
    **config,
) -> dict:
    """`eval_between`: a no-grad forward between each forward and its backward; `blocks="children"`:
    the model has no `_no_split_modules`, so stage 3 gathers its children (the tied embedding and
    head become root parameters)."""
    model = make_model()
    if blocks == "children":
        model._no_split_modules = []
    engine = initialize(model, make_optimizer(model, optimizer), ZeroConfig(**{**SMALL, **config}))
    losses, norms, skipped, scales = [], [], [], []
    for batch in batches(STEPS):
        input_ids, labels = local(batch, rank, world_size)
        total = torch.zeros(())
        assert len(input_ids) % accumulation == 0, "the local batch must split into equal micro-batches"
        for micro, (ids, lab) in enumerate(
            zip(input_ids.chunk(accumulation), labels.chunk(accumulation), strict=True)
        ):
            last = micro == accumulation - 1
            with contextlib.nullcontext() if last or not use_no_sync else engine.no_sync():
                loss = engine(ids, lab) / accumulation
                if eval_between:
                    with torch.no_grad():
                        engine(ids, lab)
                engine.backward(loss)
            total += loss.detach()
        engine.step()
        losses.append(_mean_over_ranks(total))
        norms.append(engine.get_global_grad_norm())
        skipped.append(engine.step_was_skipped)
        scales.append(engine.loss_scale)
    state = engine.full_state_dict()
    return {
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "scales": scales,
        "state": state,
        "memory": engine.memory_stats(),
    }


def train_ddp(rank: int, world_size: int) -> dict:
    model = make_model()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = make_optimizer(model)
    losses = []
    for batch in batches(STEPS):
        loss = ddp(*local(batch, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def equivalence_matrix(rank: int, world_size: int) -> dict:
    """Every engine configuration the equivalence tests compare, run once per world size."""
    results = {}
    for stage in (0, 1, 2, 3):
        results[("fp32", stage)] = train_engine(rank, world_size, stage=stage)
        results[("clip", stage)] = train_engine(rank, world_size, stage=stage, gradient_clipping=0.05)
        results[("accumulate", stage)] = train_engine(rank, world_size, stage=stage, accumulation=4)
        results[("bf16", stage)] = train_engine(rank, world_size, stage=stage, mixed_precision="bf16")
        results[("no-overlap", stage)] = train_engine(rank, world_size, stage=stage, overlap_comm=False)
        results[("accumulate-synced", stage)] = train_engine(
            rank, world_size, stage=stage, accumulation=2, use_no_sync=False
        )
    results[("children", 3)] = train_engine(rank, world_size, stage=3, blocks="children")
    results[("eval-between", 3)] = train_engine(rank, world_size, stage=3, eval_between=True)
    results[("eval-between-kept", 3)] = train_engine(
        rank, world_size, stage=3, eval_between=True, reshard_after_forward=False
    )
    results[("keep-gathered", 3)] = train_engine(rank, world_size, stage=3, reshard_after_forward=False)
    results[("fp16-overflow", 2)] = train_engine(
        rank, world_size, stage=2, mixed_precision="fp16", initial_loss_scale=2.0**16, hysteresis=1
    )
    if world_size > 1:
        results[("ddp", None)] = train_ddp(rank, world_size)
    return results


def gather_group_use(rank: int, world_size: int) -> dict:
    """Which process group each all-gather and reduce-scatter of two stage 3 steps ran on (the torch
    functions `Collectives` calls, wrapped to record it), what `comm_stats` counted meanwhile, and
    how many process groups are alive before engines, after three closed ones and after one dropped."""
    from tnlg.sharding import collectives as module

    live_groups = len(dist.distributed_c10d._world.pg_map)  # private, but the one registry of groups
    calls: list[tuple[str, object, int]] = []

    def recording(kind: str, original):
        def call(output, tensor, *args, group=None, **kwargs):
            payload = output if kind == "all_gather" else tensor  # what `CommStats` counts
            calls.append((kind, group, payload.numel() * payload.element_size()))
            return original(output, tensor, *args, group=group, **kwargs)

        return call

    originals = module._all_gather, module._reduce_scatter
    module._all_gather = recording("all_gather", originals[0])
    module._reduce_scatter = recording("reduce_scatter", originals[1])
    try:
        model = make_model()
        engine = initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": 3}))
        engine.reset_comm_stats()
        for batch in batches(2):
            engine.backward(engine(*local(batch, rank, world_size)))
            engine.step()
    finally:
        module._all_gather, module._reduce_scatter = originals
    collectives = engine.collectives
    gather_group = collectives.gather_group
    result = {
        "stats": engine.comm_stats(),
        "recorded": {
            kind: {
                "calls": sum(1 for k, _, _ in calls if k == kind),
                "bytes": sum(n for k, _, n in calls if k == kind),
            }
            for kind in ("all_gather", "reduce_scatter")
        },
        "gathers_on_gather_group": all(g is gather_group for k, g, _ in calls if k == "all_gather"),
        "reductions_on_engine_group": all(
            g is collectives.group for k, g, _ in calls if k == "reduce_scatter"
        ),
        "gather_group_is_world": gather_group is None or gather_group == dist.group.WORLD,
        "gather_group_ranks": dist.get_process_group_ranks(gather_group),
        "groups_with_engine": len(dist.distributed_c10d._world.pg_map),
    }
    engine.close()
    result["gather_group_after_close_is_engine_group"] = collectives.gather_group is collectives.group
    for _ in range(3):
        model = make_model()
        initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": 3})).close()
    result["groups_after_closed_engines"] = len(dist.distributed_c10d._world.pg_map)
    model = make_model()
    dropped = initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": 3}))
    del dropped  # the finalizer, not close(), destroys its group
    gc.collect()
    result["groups_after_dropped_engine"] = len(dist.distributed_c10d._world.pg_map)
    result["groups_before"] = live_groups
    return result


def reduce_buckets_in_flight(rank: int, world_size: int, reduce_bucket_size: int) -> dict:
    """One stage 3 step with small units: the bucket elements in flight after every reduction launch,
    the units' sizes, and the losses (to compare with an uncut run)."""
    model = make_model()
    config = ZeroConfig(**{**SMALL, "stage": 3, "reduce_bucket_size": reduce_bucket_size})
    engine = initialize(model, make_optimizer(model), config)
    in_flight: list[int] = []
    original = engine.reducer._reduce

    def recording(g, unit):
        original(g, unit)
        in_flight.append(engine.reducer.in_flight_numel())

    engine.reducer._reduce = recording
    losses = []
    for batch in batches(2):
        loss = engine(*local(batch, rank, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(loss.detach()))
    units = [unit.numel for group in engine.groups for unit in group.layout.units]
    engine.close()
    return {"in_flight": in_flight, "units": units, "losses": losses}


# What each module load case loads after two steps (see test_zero_module_loads.py): the whole model from
# another seed's weights, through the module or through the engine, or only the first block.
MODULE_LOAD_CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage2_offload": {"stage": 2, "offload_optimizer": "cpu"},
    "stage1_through_engine": {"stage": 1},
    "stage2_first_block": {"stage": 2},
}
MODULE_LOAD_STEPS = 4  # the load comes after half of them


def load_midway(case: str, model: torch.nn.Module, engine: torch.nn.Module | None = None) -> None:
    """The case's load of another seed's weights into `model` (the engine's module, or the reference's
    model): whole, through `engine` (keys `module.`-prefixed) where one is given, or its first block only."""
    replacement = make_model(seed=5).state_dict()
    if case.endswith("first_block"):
        block = {k.removeprefix("blocks.0."): v for k, v in replacement.items() if k.startswith("blocks.0.")}
        model.blocks[0].load_state_dict(block)
    elif case.endswith("through_engine") and engine is not None:
        engine.load_state_dict({f"module.{k}": v for k, v in replacement.items()})
    else:
        model.load_state_dict(replacement)


def module_load_matrix(rank: int, world_size: int) -> dict:
    """Each MODULE_LOAD_CASES engine: losses and final parameters of MODULE_LOAD_STEPS steps with a
    `load_state_dict` into its module (or itself) after the first half."""
    results = {}
    for case, config in MODULE_LOAD_CASES.items():
        model = make_model()
        engine = initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, **config}))
        losses = []
        for step, batch in enumerate(batches(MODULE_LOAD_STEPS)):
            if step == MODULE_LOAD_STEPS // 2:
                load_midway(case, engine.module, engine)
            input_ids, labels = local(batch, rank, world_size)
            loss = engine(input_ids, labels)
            engine.backward(loss)
            engine.step()
            losses.append(_mean_over_ranks(loss))
        results[case] = {"losses": losses, "state": engine.full_state_dict()}
        engine.close()
    return results


def reduce_large_fp16_gradients(
    rank: int, world_size: int, stage: int, backwards: int, probe: bool = False
) -> dict:
    """A zero-initialized fp16 vector whose loss `(w * g).sum()` gives every rank the gradient g: the
    same 40000 on each rank (finite in fp16; their sum, 80000, is not) or, with `backwards` > 1, a
    rank's own value per backward, all before one SGD step (lr 1, static loss scale 1). `probe`: after
    each backward, `torch.autograd.grad` of another loss, which must change nothing. Returns whether
    the step was applied and the vector after it: minus the mean over ranks of the summed gradients."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(8))
    model.forward = lambda g: (model.w * g).sum()
    config = ZeroConfig(stage=stage, mixed_precision="fp16", static_loss_scale=1.0, reduce_bucket_size=4)
    engine = initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    for index in range(backwards):
        value = 40000.0 if backwards == 1 else 4096.0 * (2 * rank + 2 + index)  # sums and halves exact
        engine.backward(engine(torch.full((8,), value, dtype=torch.float16)))
        if probe:  # runs the parameters' tensor hooks, accumulates nothing
            torch.autograd.grad(engine(torch.full((8,), 3.0, dtype=torch.float16)), [model.w])
    applied = engine.step()
    return {"applied": applied, "w": engine.full_state_dict(rank0_only=False)["w"].float().tolist()}
