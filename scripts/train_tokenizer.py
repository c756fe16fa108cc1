"""Train a byte-level BPE tokenizer on a corpus and save it as a Transformers tokenizer directory.

    python scripts/train_tokenizer.py --input "data/*.jsonl.zst" --vocab-size 32000 --output out/tokenizer
    python scripts/train_tokenizer.py --embedded --vocab-size 4096 --output out/tokenizer

`--input` takes files or globs of Pile-style JSON lines (.jsonl, .jsonl.zst, .jsonl.gz) or parquet;
`--embedded` uses the embedded Python corpus. The result loads with `AutoTokenizer.from_pretrained`.

A non-empty `--output` directory is refused unless `--overwrite`; a directory holding a model
(`config.json`, weights) is refused even then: a model's tokenizer replaced by a new one (other merges,
another end-of-text id) would silently turn its ids into the wrong text.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

from tnlg.data.corpus import embedded_corpus
from tnlg.data.sources import DocumentReader, SourceConfig
from tnlg.data.tokenizer import train_byte_level_bpe
from tnlg.run.cli import exit_on_input_error

# Files that mark a model's directory (Transformers' config, weights in any of its formats).
MODEL_FILE_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")

logger = logging.getLogger("train_tokenizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="corpus files or globs")
    source.add_argument("--embedded", action="store_true", help="the embedded Python corpus")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--max-documents", type=int, help="train on at most this many documents")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the tokenizer in a non-empty --output (never a model's)",
    )
    args = parser.parse_args(argv)
    if args.max_documents is not None and args.max_documents < 1:
        raise ValueError(
            f"--max-documents must be at least 1, got {args.max_documents}; leave it out to use every document"
        )
    return args


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an output that is a file, a model's directory, or (without `overwrite`) not empty."""
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(f"--output {output} is a file; a tokenizer is saved as a directory")
    if not output.is_dir() or not any(output.iterdir()):
        return
    model_files = sorted({p.name for pattern in MODEL_FILE_PATTERNS for p in output.glob(pattern)})
    if model_files:
        raise FileExistsError(
            f"--output {output} holds a model ({', '.join(model_files)}): replacing its tokenizer would change "
            "what its token ids mean; save the tokenizer to another directory"
        )
    if not overwrite:
        raise FileExistsError(
            f"--output {output} is not empty; choose another directory, or pass --overwrite to replace its files"
        )


def counted(texts: Iterator[str], counter: list[int]) -> Iterator[str]:
    """`texts`, counting in `counter[0]` how many the trainer actually took."""
    for text in texts:
        counter[0] += 1
        yield text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = [str(p) for p in embedded_corpus().files()] if args.embedded else args.input
    reader = DocumentReader(
        SourceConfig(name="tokenizer-corpus", paths=tuple(paths), text_field=args.text_field)
    )
    check_output(args.output, args.overwrite)
    texts = reader.first_epoch_texts()
    if args.max_documents is not None:
        texts = itertools.islice(texts, args.max_documents)
    used = [0]
    tokenizer = train_byte_level_bpe(counted(texts, used), args.vocab_size)
    if len(tokenizer) < args.vocab_size:
        # BPE stops when no pair is frequent enough to merge: a model sized to --vocab-size would carry
        # embedding rows no token reaches, so nothing is saved and the user chooses.
        raise ValueError(
            f"--vocab-size {args.vocab_size}: the {used[0]} documents support only {len(tokenizer)} tokens "
            f"(no pair left that occurs twice); give more text, or ask for --vocab-size {len(tokenizer)}"
        )
    tokenizer.save_pretrained(args.output)
    logger.info(
        "trained a %d-token byte-level BPE on %d documents; saved to %s", len(tokenizer), used[0], args.output
    )


if __name__ == "__main__":
    exit_on_input_error(main)()
