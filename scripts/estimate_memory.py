"""Estimate per-rank memory for ZeRO training of TNLG presets (the logic is in tnlg/tools/memory.py).

python scripts/estimate_memory.py                               # tnlg-17b and mt-nlg-530b
python scripts/estimate_memory.py --preset tnlg-17b --offload --device-memory 80GB
python scripts/estimate_memory.py --config configs/pretrain/tnlg-17b.yaml --world-sizes 32
python scripts/estimate_memory.py --config configs/pretrain/mt-nlg-530b.yaml --world-sizes 2240

With pipeline stages each row is the pipeline rank that needs the most device memory (its "pipe rank"
column says which), in the estimate and in the plan alike.

With --config it also prints the meta-device plan (tnlg/tools/memory_plan.py): the run's model built on
the meta device, cut and laid out by the engine's own planner at each world size, with stage 3's
gathered blocks, whole gradients and reduce buckets replayed from the engine's policies.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tnlg.modeling import TNLGConfig
from tnlg.run.build import architecture, check_init_from, meta_model
from tnlg.run.cli import exit_on_input_error
from tnlg.run.config import RunConfig, load_run_config
from tnlg.run.optim import build_optimizer
from tnlg.sharding.config import MIXED_PRECISIONS, ZeroConfig
from tnlg.tools.memory import (
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    estimate_memory,
    format_table,
    parse_bytes,
    smallest_world_size,
)
from tnlg.tools.memory_plan import format_plans, plan_rank_memory

DEFAULT_PRESETS = ["tnlg-17b", "mt-nlg-530b"]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not values:  # an empty table, exit 0, would read as "nothing fits"
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _memory_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


# The options a run config decides when --config is given (their defaults apply without it).
RUN_DECIDES = {
    "preset": None,
    "stages": [0, 1, 2, 3],
    "offload": False,
    "mixed_precision": "bf16",
    "micro_batch_size": 1,
    "seq_len": None,
    "no_activation_checkpointing": False,
    "offload_activations": False,
    "tensor_parallel": 1,
    "pipeline_parallel": 1,
    "virtual_stages": 1,
    "optimizer": "adamw",  # a run always builds AdamW (tnlg.run.optim): no other optimizer to estimate
}


@dataclass
class Study:
    """One table: a model, the stages to tabulate, and the settings every row shares."""

    name: str
    model: TNLGConfig
    stages: list[int]
    options: dict[str, Any]  # estimate_memory's keyword arguments other than world_size and stage
    offload_optimizer: bool
    offload_param: bool
    run: RunConfig | None = None  # --config: the run, whose engine layout is also planned
    zero: ZeroConfig | None = None

    def offload(self, stage: int) -> dict[str, str]:
        # Stage 0 partitions nothing, so there is nothing to offload; parameters only in stage 3.
        return {
            "offload_optimizer": "cpu" if self.offload_optimizer and stage >= 1 else "none",
            "offload_param": "cpu" if self.offload_param and stage == 3 else "none",
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        help="a run config (configs/pretrain/*.yaml): its model, ZeRO stage and offload, precision, micro "
        "batch, sequence length and activation checkpointing, in place of the options marked (run)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(TNLGConfig.presets()),
        help=f"(run) a preset (repeatable; default: {' and '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument("--world-sizes", type=_int_list, default=[8, 64, 512], help="default: 8,64,512")
    parser.add_argument("--stages", type=_int_list, help="(run) default: 0,1,2,3")
    parser.add_argument(
        "--offload",
        action="store_true",
        default=None,
        help="(run) offload the optimizer (stages 1-3) and the parameter shards (stage 3) to CPU",
    )
    parser.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, help="(run) default: bf16")
    parser.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), help="default adamw (with --config: a run's)"
    )
    parser.add_argument("--micro-batch-size", type=int, help="(run) sequences per rank per step; default 1")
    parser.add_argument("--seq-len", type=int, help="(run) default: the preset's max_position_embeddings")
    parser.add_argument("--no-activation-checkpointing", action="store_true", default=None, help="(run)")
    parser.add_argument(
        "--offload-activations",
        action="store_true",
        default=None,
        help="(run) keep the checkpointed blocks' inputs in host memory",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        help="(run) tensor slicing degree; ZeRO shards over world / (t x p); default 1",
    )
    parser.add_argument(
        "--pipeline-parallel",
        type=int,
        help="(run) pipeline stages p; each row is the pipeline rank needing the most memory; default 1",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int,
        help="(run) stages per pipeline rank (interleaved 1F1B); default 1",
    )
    parser.add_argument(
        "--device-memory",
        type=_memory_size,
        help="e.g. 80GB or 80GiB: also print the smallest power-of-two world size per stage that fits",
    )
    args = parser.parse_args(argv)
    given = [name for name in RUN_DECIDES if getattr(args, name) is not None]
    if args.config and given:
        parser.error(f"--config decides {', '.join('--' + n.replace('_', '-') for n in given)}: drop them")
    for name, default in RUN_DECIDES.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    # Named by their flags here: the layout's and the plan's own checks name their fields instead.
    if not args.config and args.virtual_stages > 1 and args.pipeline_parallel < 2:
        parser.error(f"--virtual-stages {args.virtual_stages} needs --pipeline-parallel 2 or more")
    if not args.config and args.offload_activations and args.no_activation_checkpointing:
        parser.error(
            "--offload-activations offloads the checkpointed block inputs: drop --no-activation-checkpointing"
        )
    return args


def studies_from_flags(args: argparse.Namespace) -> list[Study]:
    options = {
        "mixed_precision": args.mixed_precision,
        "optimizer": args.optimizer,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "activation_checkpointing": not args.no_activation_checkpointing,
        "offload_activations": args.offload_activations,
        "tensor_parallel": args.tensor_parallel,
        "pipeline_parallel": args.pipeline_parallel,
        "virtual_stages": args.virtual_stages,
    }
    return [
        Study(preset, TNLGConfig.from_preset(preset), args.stages, options, args.offload, args.offload)
        for preset in args.preset or DEFAULT_PRESETS
    ]


def study_from_run_config(path: str, optimizer: str) -> Study:
    """The run's model (its preset, or init_from's config.json, with its overrides) and its settings."""
    run = load_run_config(path)
    section = run.model
    check_init_from(section.init_from)  # a local TNLG checkpoint, as a run needs it
    model = architecture(section)
    zero = run.zero.to_zero_config(run.train.mixed_precision)
    options = {
        "mixed_precision": zero.mixed_precision,  # train's, or the zero.deepspeed JSON's when train says "no"
        "optimizer": optimizer,
        "micro_batch_size": run.train.micro_batch_size,
        "seq_len": run.data.seq_len,
        "activation_checkpointing": section.activation_checkpointing.enabled,
        "offload_activations": section.activation_checkpointing.cpu_offload,
        "param_persistence_threshold": zero.param_persistence_threshold,
        "tensor_parallel": run.parallel.tensor,
        "pipeline_parallel": run.parallel.pipeline,
        # the run config's parallel section may not name virtual stages: then one per pipeline rank
        "virtual_stages": getattr(run.parallel, "virtual_stages", 1),
    }
    return Study(
        f"{path} ({section.init_from or section.preset})",
        model,
        [zero.stage],
        options,
        offload_optimizer=zero.offload_optimizer != "none",
        offload_param=zero.offload_param != "none",
        run=run,
        zero=zero,
    )


def print_study(study: Study, world_sizes: list[int], device_memory: int | None) -> None:
    config, options = study.model, study.options
    rows = [
        estimate_memory(config, world_size=n, stage=stage, **study.offload(stage), **options)
        for stage in study.stages
        for n in world_sizes
    ]
    seq_len = options["seq_len"] or config.max_position_embeddings
    checkpointing = "on" if options["activation_checkpointing"] else "off"
    checkpointing += ", its block inputs offloaded" if options["offload_activations"] else ""
    print(f"{study.name}: {config.describe()}")
    print(
        f"{options['mixed_precision']}, {options['optimizer']}, micro batch {options['micro_batch_size']} x "
        f"{seq_len} tokens, activation checkpointing {checkpointing}"
        + (f", tensor slicing {options['tensor_parallel']}" if options["tensor_parallel"] > 1 else "")
        + _pipeline_words(options)
        + "; GB per rank"
    )
    print(format_table(rows))
    if device_memory:
        fits = {
            stage: smallest_world_size(
                config, device_memory_bytes=device_memory, stage=stage, **study.offload(stage), **options
            )
            for stage in study.stages
        }
        found = ", ".join(f"stage {s}: {n if n else 'none up to 4096'}" for s, n in fits.items())
        print(f"smallest world size fitting {device_memory / 1e9:.1f} GB per device: {found}")
    print()
    if study.run is not None:
        print_plan(study, rows, device_memory)


def _pipeline_words(options: dict[str, Any]) -> str:
    degree, virtual = options["pipeline_parallel"], options["virtual_stages"]
    if degree == 1:
        return ""
    return f", {degree} pipeline stages" + (
        f" x {virtual} virtual (interleaved)" if virtual > 1 else " (1F1B)"
    )


def print_plan(study: Study, estimates: list[MemoryEstimate], device_memory: int | None) -> None:
    """The meta-device plan of the run at each world size (activations from the estimate's formula,
    each pipeline rank's own)."""
    model = meta_model(study.model)
    optimizer = build_optimizer(model, study.run.optimizer)
    options = study.options
    plans = []
    for estimate in estimates:
        ranks = [
            estimate_memory(
                study.model,
                world_size=estimate.world_size,
                stage=estimate.stage,
                **study.offload(estimate.stage),
                **options,
                pipeline_rank=rank,
            )
            for rank in range(options["pipeline_parallel"])
        ]
        plans.append(
            plan_rank_memory(
                model,
                optimizer,
                study.zero,
                world_size=estimate.world_size,
                optimizer_kind=options["optimizer"],
                activations=[rank.activations for rank in ranks],
                offloaded_activations=[rank.offloaded_activations for rank in ranks],
                tensor_parallel=options["tensor_parallel"],
                pipeline_parallel=options["pipeline_parallel"],
                virtual_stages=options["virtual_stages"],
            )
        )
    plan = plans[0]
    print(
        f"meta-device plan (the engine's layout of this run's model): largest unit {plan.largest_unit:,} "
        f"elements; GB per rank"
    )
    if study.zero.stage == 3:
        print(
            f"stage 3 prefetch: max_live_parameters {study.zero.max_live_parameters:,}, every block "
            f"prefetched from {plan.prefetch_floor:,}"
        )
    print(format_plans(plans, device_memory))
    print()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.config:
        studies = [study_from_run_config(args.config, args.optimizer)]
    else:
        studies = studies_from_flags(args)
    for study in studies:
        print_study(study, args.world_sizes, args.device_memory)


if __name__ == "__main__":
    exit_on_input_error(main)()
