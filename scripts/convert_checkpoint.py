"""Convert checkpoints into a TNLG model directory, or a TNLG model out to a plain GPT-2 directory.

    python scripts/convert_checkpoint.py --from gpt2 --input path/to/gpt2 --output out/tnlg-gpt2
    python scripts/convert_checkpoint.py --from megatron --input path/to/megatron/save --output out/tnlg \\
        --vocab-size 50257
    python scripts/convert_checkpoint.py --from zero --input runs/pretrain/checkpoints --output out/model
    python scripts/convert_checkpoint.py --from deepspeed --input trainer_out/checkpoint-500 --output out/model
    python scripts/convert_checkpoint.py --to gpt2 --input runs/pretrain-debug --output out/gpt2

`--from zero` consolidates an engine checkpoint saved at any world size and stage (a run's
checkpoint root, one `step-N` checkpoint, a `save_state` directory or a ZeroTrainer `checkpoint-N`),
streaming tensor by tensor: peak memory is about one output shard.

`--from deepspeed` reads a DeepSpeed ZeRO stage 1-3 checkpoint at any world size, as DeepSpeed's
`save_checkpoint` writes it (its save directory with `latest`, the Transformers Trainer's
`checkpoint-N/`, or the tag directory), of a TNLG or a Transformers GPT-2 model: the fp32 master
weights, read with `torch.load(weights_only=True)`. The model's config.json comes from `--config`, else
from beside DeepSpeed's files (the Trainer saves it there).

The output is sharded safetensors with an index (`TNLGForCausalLM.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` load it after `import tnlg`), plus the tokenizer files found
next to the input.

`--to gpt2` writes a `GPT2LMHeadModel` directory instead (model_type gpt2: Transformers,
lm-evaluation-harness, vLLM, TGI and llama.cpp's converter load it with no tnlg installed). Its input
is a saved TNLG model (a run's `model/`), an engine checkpoint at any layout, a run's checkpoint root or
a run directory (its final `model/`, else its latest checkpoint), or with `--from gpt2` / `--from
megatron` a checkpoint converted on the way.

The output directory must be new or empty and apart from the input; `--overwrite` replaces an existing
one whole. Everything is written into a staging directory beside it and renamed into place at the end,
so a failed conversion leaves the previous directory (or nothing) there ([Note: conversion outputs] in
tnlg/tools/convert/outputs.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from tnlg.modeling import TNLGForCausalLM
from tnlg.run.checkpoint import find_engine_checkpoint
from tnlg.run.cli import exit_on_input_error
from tnlg.sharding.consolidate import consolidate, parse_size
from tnlg.tools.convert import copy_tokenizer_files, export_gpt2, from_deepspeed, from_gpt2, from_megatron
from tnlg.tools.convert.outputs import (
    refuse_a_file_in_the_way,
    refuse_a_linked_output,
    refuse_a_used_directory,
    refuse_output_overlapping_input,
    staged_output,
)

logger = logging.getLogger("convert_checkpoint")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


MEGATRON_FLAGS = {
    "num_attention_heads": "--num-attention-heads",
    "vocab_size": "--vocab-size",
    "checkpoint_version": "--checkpoint-version",
    "hidden_act": "--hidden-act",
    "layer_norm_epsilon": "--layer-norm-epsilon",
}
# The legacy fused-QKV layouts the Megatron converter knows (see _merge_qkv in tnlg/tools/convert/megatron.py).
MEGATRON_CHECKPOINT_VERSIONS = (0.0, 1.0, 2.0, 3.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.source_format is None and args.target_format == "tnlg":
        parser.error("--from is required (gpt2, megatron, zero or deepspeed) unless --to gpt2")
    if args.config is not None and args.source_format != "deepspeed":
        parser.error("--config is for --from deepspeed (DeepSpeed saves no config.json)")
    if args.source_format == "tnlg" and args.target_format == "tnlg":
        parser.error("--from tnlg is a TNLG model already: use --to gpt2 to export it")
    given = [flag for name, flag in MEGATRON_FLAGS.items() if getattr(args, name) is not None]
    if given and args.source_format != "megatron":
        parser.error(f"{', '.join(given)} apply to --from megatron only (the other formats record them)")
    if args.no_verify and not _verifies_checksums(args):
        parser.error(
            "--no-verify skips the sha256 check of an engine checkpoint or a saved TNLG model (--from zero, "
            "--to gpt2 from a TNLG model): nothing is verified in this conversion"
        )
    if args.checkpoint_version is not None and args.checkpoint_version not in MEGATRON_CHECKPOINT_VERSIONS:
        parser.error(
            f"--checkpoint-version {args.checkpoint_version:g} is not a Megatron checkpoint version: use 0, 1, "
            "2 or 3"
        )
    if args.tokenizer_dir is not None and not args.tokenizer_dir.is_dir():
        parser.error(
            f"--tokenizer-dir {args.tokenizer_dir} is not a directory: name the tokenizer's directory"
        )
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--from",
        dest="source_format",
        choices=["gpt2", "megatron", "zero", "deepspeed", "tnlg"],
        help="the input's format (required unless --to gpt2, which finds a TNLG model or checkpoint itself)",
    )
    parser.add_argument(
        "--to", dest="target_format", choices=["tnlg", "gpt2"], default="tnlg", help="the output's format"
    )
    parser.add_argument("--input", required=True, type=Path, help="checkpoint directory or file")
    parser.add_argument(
        "--output",
        required=True,
        type=Path,
        help="directory to write the model to: new or empty, apart from the input (see --overwrite)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output directory whole (its weights, config and every other file)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=parse_size("5GB"),
        type=_shard_size,
        help="largest safetensors shard, e.g. 2GB, 500MB or 2GiB",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep)")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="zero, --to gpt2: skip the sha256 check of the rank files or the model's weights",
    )
    _megatron_arguments(parser.add_argument_group("megatron"))
    deepspeed = parser.add_argument_group("deepspeed")
    deepspeed.add_argument(
        "--config",
        type=Path,
        help="the model's config.json or its directory (default: beside the checkpoint)",
    )
    tokenizer = parser.add_argument_group("tokenizer")
    tokenizer.add_argument(
        "--tokenizer-dir", type=Path, help="copy tokenizer files from here (default: input)"
    )
    return parser


def _megatron_arguments(megatron: argparse._ArgumentGroup) -> None:
    megatron.add_argument(
        "--num-attention-heads",
        type=_positive_int,
        help="for checkpoints whose saved args record none (one that differs from the record is refused)",
    )
    megatron.add_argument(
        "--vocab-size", type=_positive_int, help="trim the padded vocabulary to this many rows"
    )
    megatron.add_argument(
        "--checkpoint-version",
        type=float,
        help="legacy QKV layout 0, 1, 2 or 3 of a checkpoint that records none (default: 0, as Megatron reads it)",
    )
    megatron.add_argument(
        "--hidden-act",
        help="gelu_new (fused bias-GeLU) or gelu (default: from the saved args; gelu_new without args)",
    )
    megatron.add_argument(
        "--layer-norm-epsilon", type=float, help="default: from the saved args (1e-5 without args)"
    )


def _shard_size(text: str) -> int:
    """--max-shard-size in bytes, parsed once here so every format reads the same number."""
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size such as 5GB, 500MB or 2GiB")
    return size


def _positive_int(text: str) -> int:
    """A count (rows, heads), checked here so that 0 or -1 never reaches the conversion."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _verifies_checksums(args: argparse.Namespace) -> bool:
    """Whether this conversion reads sha256 records that --no-verify could skip."""
    if args.target_format == "gpt2":
        return args.source_format in (None, "tnlg", "zero")
    return args.source_format == "zero"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Absolute, links kept: "." has no name to stage beside and rename (it failed after the conversion).
    args.output = Path(os.path.abspath(args.output))
    inputs = {"--input": args.input, "--tokenizer-dir": args.tokenizer_dir, "--config": args.config}
    refuse_output_overlapping_input(inputs, args.output)
    refuse_a_linked_output(args.output)
    refuse_a_file_in_the_way(args.output)
    if not args.overwrite:
        refuse_a_used_directory(args.output, "pass --overwrite to replace it, or write into a new directory")
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.target_format == "gpt2" and args.source_format in (None, "tnlg", "zero"):
        source = find_tnlg_source(args.input, args.source_format)
        with staged_output(args.output, replace=args.overwrite) as staging:
            export_to_gpt2(args, source, staging, dtype)
        return None
    if args.source_format == "zero":
        return consolidate_zero(args, dtype)
    model = read_model(args, dtype)
    tokenizer_dir = args.tokenizer_dir or (args.input if args.input.is_dir() else args.input.parent)
    with staged_output(args.output, replace=args.overwrite) as staging:
        if args.target_format == "gpt2":
            written = export_gpt2(
                model, staging, max_shard_size=args.max_shard_size, tokenizer_dir=tokenizer_dir
            )
        else:
            model.save_pretrained(staging, max_shard_size=args.max_shard_size)
            written = copy_tokenizer_files(tokenizer_dir, staging)
    if args.target_format == "gpt2":
        logger.info(
            "exported %s as a GPT2LMHeadModel to %s (%d files)", args.input, args.output, len(written)
        )
        return None
    logger.info("wrote %s (%s) to %s", type(model).__name__, model.config.describe(), args.output)
    logger.info("tokenizer files: %s", ", ".join(written) if written else "none found")
    return None


def read_model(args: argparse.Namespace, dtype: torch.dtype | None) -> TNLGForCausalLM:
    """The input, of a foreign format (gpt2, deepspeed, megatron), as a TNLG model in memory."""
    if args.source_format == "gpt2":
        return from_gpt2(args.input, dtype=dtype)
    if args.source_format == "deepspeed":
        return from_deepspeed(args.input, config=args.config, dtype=dtype)
    return from_megatron(
        args.input,
        num_attention_heads=args.num_attention_heads,
        vocab_size=args.vocab_size,
        checkpoint_version=args.checkpoint_version,
        hidden_act=args.hidden_act,
        layer_norm_epsilon=args.layer_norm_epsilon,
        dtype=dtype,
    )


def consolidate_zero(args: argparse.Namespace, dtype: torch.dtype | None) -> None:
    checkpoint = find_engine_checkpoint(args.input)
    tokenizer_dir = args.tokenizer_dir or args.input
    with staged_output(args.output, replace=args.overwrite) as staging:
        written = consolidate(checkpoint, staging, args.max_shard_size, dtype, verify=not args.no_verify)
        copied = copy_tokenizer_files(tokenizer_dir, staging) if tokenizer_dir.is_dir() else []
    if not (args.output / "config.json").is_file():
        raise SystemExit(
            f"{checkpoint} has no config.json (the model had no Transformers config): the tensors are in "
            f"{args.output}, add the model's config.json there to load it with from_pretrained"
        )
    logger.info("consolidated %s into %d files in %s", checkpoint, len(written), args.output)
    logger.info("tokenizer files: %s", ", ".join(copied) if copied else "none found")


def find_tnlg_source(path: Path, source_format: str | None) -> Path:
    """What `--to gpt2` exports from `path`: a saved TNLG model (its config.json), an engine checkpoint
    (what `--from zero` reads), or a run directory's final `model/`, else its latest checkpoint."""
    if source_format != "zero" and (path / "config.json").is_file():
        return path
    if source_format is None and (path / "model" / "config.json").is_file():
        return path / "model"  # a run directory's final model
    if source_format is None and (path / "checkpoints").is_dir() and not (path / "engine").exists():
        return find_engine_checkpoint(path / "checkpoints")
    if source_format == "tnlg":
        raise FileNotFoundError(f"{path} has no config.json: it is not a saved TNLG model directory")
    return find_engine_checkpoint(path)


def export_to_gpt2(args: argparse.Namespace, source: Path, output: Path, dtype: torch.dtype | None) -> None:
    written = export_gpt2(
        source,
        output,
        max_shard_size=args.max_shard_size,
        dtype=dtype,
        verify=not args.no_verify,
        tokenizer_dir=args.tokenizer_dir or _tokenizer_next_to(source, args.input),
    )
    logger.info("exported %s as a GPT2LMHeadModel to %s (%d files)", source, args.output, len(written))


def _tokenizer_next_to(source: Path, given: Path) -> Path:
    """Where the tokenizer files are: beside the model, or for an engine checkpoint in the run's `model/`
    or the directory the user named."""
    for candidate in (source, given / "model", given):
        if (candidate / "tokenizer_config.json").is_file() or (candidate / "tokenizer.json").is_file():
            return candidate
    return source


if __name__ == "__main__":
    exit_on_input_error(main)()
