"""Convert a GPT-2 (Transformers), Megatron-LM GPT or tnlg ZeRO checkpoint into a TNLG model directory.

    python scripts/convert_checkpoint.py --from gpt2 --input path/to/gpt2 --output out/tnlg-gpt2
    python scripts/convert_checkpoint.py --from megatron --input path/to/megatron/save --output out/tnlg \\
        --vocab-size 50257
    python scripts/convert_checkpoint.py --from zero --input runs/pretrain/checkpoints --output out/model

`--from zero` consolidates an engine checkpoint saved at any world size and stage (a run's
checkpoint root, one `step-N` checkpoint, a `save_state` directory or a ZeroTrainer `checkpoint-N`),
streaming tensor by tensor: peak memory is about one output shard.

The output is sharded safetensors with an index (`TNLGForCausalLM.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` load it after `import tnlg`), plus the tokenizer files found
next to the input.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from tnlg.run.checkpoint import find_engine_checkpoint
from tnlg.run.cli import exit_on_input_error
from tnlg.sharding.consolidate import consolidate
from tnlg.tools.convert import copy_tokenizer_files, from_gpt2, from_megatron

logger = logging.getLogger("convert_checkpoint")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--from", dest="source_format", choices=["gpt2", "megatron", "zero"], required=True)
    parser.add_argument("--input", required=True, type=Path, help="checkpoint directory or file")
    parser.add_argument(
        "--output", required=True, type=Path, help="directory to write the TNLG checkpoint to"
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 2GB or 500MB"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep)")
    parser.add_argument(
        "--no-verify", action="store_true", help="zero: skip the sha256 check of the rank files"
    )
    megatron = parser.add_argument_group("megatron")
    megatron.add_argument("--num-attention-heads", type=int, help="needed when the checkpoint has no args")
    megatron.add_argument("--vocab-size", type=int, help="trim the padded vocabulary to this many rows")
    megatron.add_argument(
        "--checkpoint-version", type=float, help="legacy QKV layout version (default: saved)"
    )
    megatron.add_argument("--hidden-act", default="gelu_new", help="gelu_new (fused bias-GeLU) or gelu")
    tokenizer = parser.add_argument_group("tokenizer")
    tokenizer.add_argument(
        "--tokenizer-dir", type=Path, help="copy tokenizer files from here (default: input)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.source_format == "zero":
        return consolidate_zero(args, dtype)
    if args.source_format == "gpt2":
        model = from_gpt2(args.input, dtype=dtype)
    else:
        model = from_megatron(
            args.input,
            num_attention_heads=args.num_attention_heads,
            vocab_size=args.vocab_size,
            checkpoint_version=args.checkpoint_version,
            hidden_act=args.hidden_act,
            dtype=dtype,
        )
    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output, max_shard_size=args.max_shard_size)
    tokenizer_dir = args.tokenizer_dir or (args.input if args.input.is_dir() else args.input.parent)
    copied = copy_tokenizer_files(tokenizer_dir, args.output)
    logger.info("wrote %s (%s) to %s", type(model).__name__, model.config.describe(), args.output)
    logger.info("tokenizer files: %s", ", ".join(copied) if copied else "none found")


def consolidate_zero(args: argparse.Namespace, dtype: torch.dtype | None) -> None:
    checkpoint = find_engine_checkpoint(args.input)
    written = consolidate(checkpoint, args.output, args.max_shard_size, dtype, verify=not args.no_verify)
    if not (args.output / "config.json").is_file():
        raise SystemExit(
            f"{checkpoint} has no config.json (the model had no Transformers config): the tensors are in "
            f"{args.output}, add the model's config.json there to load it with from_pretrained"
        )
    tokenizer_dir = args.tokenizer_dir or args.input
    copied = copy_tokenizer_files(tokenizer_dir, args.output) if tokenizer_dir.is_dir() else []
    logger.info("consolidated %s into %d files in %s", checkpoint, len(written), args.output)
    logger.info("tokenizer files: %s", ", ".join(copied) if copied else "none found")


if __name__ == "__main__":
    exit_on_input_error(main)()
