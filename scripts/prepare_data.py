"""Pre-tokenize a corpus into the memory-mapped format (`PREFIX.bin`, `.idx`, `.json`) for pretraining.

    python scripts/prepare_data.py --input "pile/*.jsonl.zst" --tokenizer out/tokenizer --output data/pile
    python scripts/prepare_data.py --embedded --tokenizer out/tokenizer --output data/embedded

One output per `--pile-set-name` when given (`PREFIX.<name>`), so that a mixture can weight the
Pile's subsets; otherwise one output for everything. A truncated or corrupt compressed input ends the
run naming the file, whatever `--on-bad-record` says (it is about single records), and writes nothing.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tqdm.auto import tqdm

from tnlg.data.corpus import embedded_corpus
from tnlg.data.pretokenized import write_pretokenized
from tnlg.data.sources import DocumentReader, SourceConfig
from tnlg.data.tokenizer import load_tokenizer
from tnlg.run.cli import exit_on_input_error

logger = logging.getLogger("prepare_data")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="corpus files or globs")
    source.add_argument("--embedded", action="store_true", help="the embedded Python corpus (train split)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--pile-set-name", action="append", help="write this Pile subset to its own output")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or 'byte-level'")
    parser.add_argument("--output", type=Path, required=True, help="output prefix")
    parser.add_argument("--on-bad-record", choices=["skip", "fatal"], default="skip")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tokenizer = load_tokenizer(args.tokenizer)
    paths = tuple(str(p) for p in embedded_corpus().files()) if args.embedded else tuple(args.input)
    subsets = args.pile_set_name or [None]
    for subset in subsets:
        source = SourceConfig(
            name=subset or "corpus", paths=paths, text_field=args.text_field, pile_set_name=subset
        )
        reader = DocumentReader(source, on_bad_record=args.on_bad_record)
        prefix = args.output.with_name(f"{args.output.name}.{subset}") if subset else args.output
        with tqdm(desc=f"tokenizing {source.name}", unit="doc") as progress:
            meta = write_pretokenized(reader.first_epoch_texts(), tokenizer, prefix, progress)
        logger.info(
            "%s: %d documents, %d tokens -> %s.bin (skipped: %s)",
            source.name,
            meta["documents"],
            meta["tokens"],
            prefix,
            dict(reader.stats.skipped) or "none",
        )


if __name__ == "__main__":
    exit_on_input_error(main)()
