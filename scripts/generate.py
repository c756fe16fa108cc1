"""Generate text with a TNLG model: a checkpoint directory, or a preset with random weights.

python scripts/generate.py --model debug --prompt "The Turing-NLG model"
echo "one prompt per line" | python scripts/generate.py --model path/to/checkpoint

Several processes share the prompts, with the model sharded by the ZeRO engine (each rank reads
only its slices of the checkpoint; stage 3 for a model too large for one device):

torchrun --nproc_per_node 2 scripts/generate.py --model path/to/checkpoint --zero-stage 3 --prompt ...
accelerate launch --multi_gpu --num_processes 2 scripts/generate.py --model path/to/checkpoint --zero-stage 3 ...
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
import torch.distributed as dist

from tnlg.inference.distributed import (
    DTYPES,
    generate_on_ranks,
    init_process_group_from_environment,
    load_sharded_model,
    sharding_from_flags,
)
from tnlg.inference.generation import generate_texts, load_model_and_tokenizer
from tnlg.inference.settings import GenerationSettings, setting_problems
from tnlg.run.cli import exit_on_input_error
from tnlg.sharding import ZeroConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="debug", help="checkpoint directory or preset name (default: debug)"
    )
    parser.add_argument(
        "--prompt", action="append", help="a prompt (repeatable); default: one per stdin line"
    )
    parser.add_argument(
        "--tokenizer", help="tokenizer directory or 'byte-level' (default: the checkpoint's own)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, help="with --do-sample (default: Transformers' 1.0)")
    parser.add_argument("--top-k", type=int, help="with --do-sample (default: Transformers' 50)")
    parser.add_argument("--top-p", type=float, help="with --do-sample (default: Transformers' 1.0)")
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--no-cache", action="store_true", help="recompute attention over the whole prefix")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="compute dtype (default: float32, or the --zero-config's bf16/fp16 when it enables one)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds random init (presets) and sampling (rank r: seed + r; a tensor-sliced replica "
        "samples as its first rank)",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=range(4),
        help="shard a checkpoint with the ZeRO engine at this stage (default under a multi-process launch: 0)",
    )
    parser.add_argument(
        "--zero-config",
        help="ZeroConfig or DeepSpeed JSON for the sharded model; --zero-stage overrides its stage",
    )
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 on a setting that would be ignored or fail only after the model loaded."""
    sampling = [flag for flag in ("temperature", "top_k", "top_p") if getattr(args, flag) is not None]
    if sampling and not args.do_sample:
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag in sampling)
        parser.error(f"{flags} shape sampling only: add --do-sample (greedy and beam search ignore them)")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: must be at least 1 (prompts per generate call)")
    for name, value, wanted in setting_problems(generation_settings(args)):  # Transformers' refusals, mid-run
        parser.error(f"--{name.replace('_', '-')} {value}: must be {wanted}")


def generation_settings(args: argparse.Namespace) -> GenerationSettings:
    return GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_beams=args.num_beams,
        use_cache=not args.no_cache,
    )


def sharded_settings(args: argparse.Namespace) -> tuple[ZeroConfig, torch.dtype | None]:
    """The ZeroConfig for a sharded model, settled once by `sharding_from_flags` before any process
    group (a conflict is named by its flags; its precision is the compute dtype), and the --dtype for a
    whole one (None: float32)."""
    config = sharding_from_flags(args.zero_config, args.zero_stage, args.dtype, default_stage=0)
    return config, None if args.dtype is None else DTYPES[args.dtype]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config, dtype = sharded_settings(args)  # read before any process group or model: errors come first
    own_group = not (dist.is_available() and dist.is_initialized())  # a caller's group is left alone
    distributed = init_process_group_from_environment()
    rank = dist.get_rank() if distributed else 0
    # Data-parallel replicas sampling the same prompt must not draw the same tokens; the ranks of one
    # tensor-sliced replica all draw its first rank's stream (generate_on_ranks).
    torch.manual_seed(args.seed + rank)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt or write prompts to stdin")
    settings = generation_settings(args)
    if distributed or args.zero_stage is not None or args.zero_config:
        engine, tokenizer = load_sharded_model(
            args.model, config, tokenizer=args.tokenizer, device=args.device
        )
        completions = generate_on_ranks(engine, tokenizer, prompts, settings, args.batch_size)
    else:
        model, tokenizer = load_model_and_tokenizer(
            args.model, dtype or torch.float32, args.device, args.tokenizer
        )
        completions = generate_texts(model, tokenizer, prompts, settings, args.batch_size)
    if rank == 0:  # every rank holds every completion: one prints them
        for prompt, completion in zip(prompts, completions, strict=True):
            print(f"{prompt!r} -> {completion!r}")
    if distributed and own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_input_error(main)()
