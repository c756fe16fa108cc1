"""Train a byte-level BPE tokenizer on a corpus and save it as a Transformers tokenizer directory.

    python scripts/train_tokenizer.py --input "data/*.jsonl.zst" --vocab-size 32000 --output out/tokenizer
    python scripts/train_tokenizer.py --embedded --vocab-size 4096 --output out/tokenizer

`--input` takes files or globs of Pile-style JSON lines (.jsonl, .jsonl.zst, .jsonl.gz) or parquet;
`--embedded` uses the embedded Python corpus. The result loads with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path

from tnlg.data.corpus import embedded_corpus
from tnlg.data.sources import DocumentReader, SourceConfig
from tnlg.data.tokenizer import train_byte_level_bpe
from tnlg.run.cli import exit_on_input_error

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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = [str(p) for p in embedded_corpus().files()] if args.embedded else args.input
    reader = DocumentReader(
        SourceConfig(name="tokenizer-corpus", paths=tuple(paths), text_field=args.text_field)
    )
    texts = reader.first_epoch_texts()
    if args.max_documents:
        texts = itertools.islice(texts, args.max_documents)
    tokenizer = train_byte_level_bpe(texts, args.vocab_size)
    tokenizer.save_pretrained(args.output)
    logger.info(
        "trained a %d-token byte-level BPE on %d documents; saved to %s",
        len(tokenizer),
        reader.stats.documents,
        args.output,
    )


if __name__ == "__main__":
    exit_on_input_error(main)()
