"""Generate text with a TNLG model: a checkpoint directory, or a preset with random weights.

python scripts/generate.py --model debug --prompt "The Turing-NLG model"
echo "one prompt per line" | python scripts/generate.py --model path/to/checkpoint
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from tnlg.generation import GenerationSettings, generate_texts, load_model_and_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--no-cache", action="store_true", help="recompute attention over the whole prefix")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="seeds random init (presets) and sampling")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise SystemExit("no prompt: pass --prompt or write prompts to stdin")
    model, tokenizer = load_model_and_tokenizer(args.model, DTYPES[args.dtype], args.device, args.tokenizer)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_beams=args.num_beams,
        use_cache=not args.no_cache,
    )
    for prompt, completion in zip(
        prompts, generate_texts(model, tokenizer, prompts, settings, args.batch_size), strict=True
    ):
        print(f"{prompt!r} -> {completion!r}")


if __name__ == "__main__":
    main()
