"""Estimate per-rank memory for ZeRO training of TNLG presets (the logic is in tnlg/tools/memory.py).

python scripts/estimate_memory.py                               # tnlg-17b and mt-nlg-530b
python scripts/estimate_memory.py --preset tnlg-17b --offload --device-memory 80GB
"""

from __future__ import annotations

import argparse

from tnlg.modeling import TNLGConfig
from tnlg.run.cli import exit_on_input_error
from tnlg.sharding.config import MIXED_PRECISIONS
from tnlg.tools.memory import (
    OPTIMIZER_STATE_BYTES,
    estimate_memory,
    format_table,
    parse_bytes,
    smallest_world_size,
)

DEFAULT_PRESETS = ["tnlg-17b", "mt-nlg-530b"]


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def _memory_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        action="append",
        choices=sorted(TNLGConfig.presets()),
        help=f"a preset (repeatable; default: {' and '.join(DEFAULT_PRESETS)})",
    )
    parser.add_argument("--world-sizes", type=_int_list, default=[8, 64, 512], help="default: 8,64,512")
    parser.add_argument("--stages", type=_int_list, default=[0, 1, 2, 3], help="default: 0,1,2,3")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="offload the optimizer (stages 1-3) and the parameter shards (stage 3) to CPU",
    )
    parser.add_argument("--mixed-precision", choices=MIXED_PRECISIONS, default="bf16")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), default="adamw")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, help="default: the preset's max_position_embeddings")
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument(
        "--device-memory",
        type=_memory_size,
        help="e.g. 80GB or 80GiB: also print the smallest power-of-two world size per stage that fits",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for preset in args.preset or DEFAULT_PRESETS:
        config = TNLGConfig.from_preset(preset)
        options = {
            "mixed_precision": args.mixed_precision,
            "optimizer": args.optimizer,
            "micro_batch_size": args.micro_batch_size,
            "seq_len": args.seq_len,
            "activation_checkpointing": not args.no_activation_checkpointing,
        }

        def offload(stage: int) -> dict[str, str]:
            # Stage 0 partitions nothing, so there is nothing to offload; parameters only in stage 3.
            return {
                "offload_optimizer": "cpu" if args.offload and stage >= 1 else "none",
                "offload_param": "cpu" if args.offload and stage == 3 else "none",
            }

        rows = [
            estimate_memory(config, world_size=n, stage=stage, **offload(stage), **options)
            for stage in args.stages
            for n in args.world_sizes
        ]
        seq_len = args.seq_len or config.max_position_embeddings
        print(f"{preset}: {config.describe()}")
        print(
            f"{args.mixed_precision}, {args.optimizer}, micro batch {args.micro_batch_size} x {seq_len} tokens, "
            f"activation checkpointing {'off' if args.no_activation_checkpointing else 'on'}; GB per rank"
        )
        print(format_table(rows))
        if args.device_memory:
            fits = {
                stage: smallest_world_size(
                    config, device_memory_bytes=args.device_memory, stage=stage, **offload(stage), **options
                )
                for stage in args.stages
            }
            found = ", ".join(f"stage {s}: {n if n else 'none up to 4096'}" for s, n in fits.items())
            print(f"smallest world size fitting {args.device_memory / 1e9:.1f} GB per device: {found}")
        print()


if __name__ == "__main__":
    exit_on_input_error(main)()
