"""Pre-tokenize a corpus into the memory-mapped format (`PREFIX.bin`, `.idx`, `.json`) for pretraining.

    python scripts/prepare_data.py --input "pile/*.jsonl.zst" --tokenizer out/tokenizer --output data/pile
    python scripts/prepare_data.py --embedded --tokenizer out/tokenizer --output data/embedded

One output per `--pile-set-name` when given (`PREFIX.<name>`), so that a mixture can weight the
Pile's subsets; otherwise one output for everything. A truncated or corrupt compressed input ends the
run naming the file, whatever `--on-bad-record` says (it is about single records), and writes nothing.

Nothing is replaced by accident: an output file that already exists is refused unless `--overwrite`
is given, and an output that is one of the inputs is refused always. Every output is written to a
staging directory beside it and moved into place only when all of them succeeded (an empty subset,
a damaged input), so a failed run leaves no partial set.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from tnlg.data.corpus import embedded_corpus
from tnlg.data.pretokenized import NoDocumentsError, write_pretokenized
from tnlg.data.sources import DocumentReader, EmptyEpochError, SourceConfig
from tnlg.data.tokenizer import load_tokenizer
from tnlg.run.cli import exit_on_input_error

logger = logging.getLogger("prepare_data")

SUFFIXES = (".bin", ".idx", ".json")  # the files of one pre-tokenized corpus (see pretokenized.py)


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
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing outputs (never an input file)"
    )
    return parser.parse_args(argv)


def output_prefixes(output: Path, subsets: list[str | None]) -> dict[str | None, Path]:
    """The output prefix of each subset (`PREFIX.<name>`, or `PREFIX` for everything)."""
    if len(set(subsets)) != len(subsets):
        raise ValueError(f"--pile-set-name repeats a subset ({subsets}): each one is written once")
    return {s: output.with_name(f"{output.name}.{s}") if s else output for s in subsets}


def check_outputs(prefixes: list[Path], inputs: list[Path], overwrite: bool) -> None:
    """Refuse outputs that are inputs (always) or that exist (unless `overwrite`), before reading anything."""
    inputs_resolved = {path.resolve() for path in inputs}
    outputs = [prefix.with_name(prefix.name + suffix) for prefix in prefixes for suffix in SUFFIXES]
    for path in outputs:
        if path.resolve() in inputs_resolved:
            raise ValueError(
                f"output {path} is one of the inputs: writing it would destroy the corpus; choose another --output"
            )
    existing = [str(path) for path in outputs if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"outputs already exist: {', '.join(existing)}; choose another --output, or pass --overwrite to "
            "replace them"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = tuple(str(p) for p in embedded_corpus().files()) if args.embedded else tuple(args.input)
    prefixes = output_prefixes(args.output, args.pile_set_name or [None])
    sources = {
        subset: SourceConfig(
            name=subset or "corpus", paths=paths, text_field=args.text_field, pile_set_name=subset
        )
        for subset in prefixes
    }
    check_outputs(list(prefixes.values()), next(iter(sources.values())).files(), args.overwrite)
    tokenizer = load_tokenizer(args.tokenizer)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.output.name}.staging-", dir=args.output.parent))
    try:
        for subset, source in sources.items():
            write_subset(source, tokenizer, staging / prefixes[subset].name, args.on_bad_record)
        # Every subset is written: only now do the outputs replace anything.
        for prefix in prefixes.values():
            for suffix in SUFFIXES:
                os.replace(staging / (prefix.name + suffix), prefix.with_name(prefix.name + suffix))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for prefix in prefixes.values():
        logger.info("wrote %s.bin / .idx / .json", prefix)


def write_subset(source: SourceConfig, tokenizer, staged_prefix: Path, on_bad_record: str) -> None:
    reader = DocumentReader(source, on_bad_record=on_bad_record)
    with tqdm(desc=f"tokenizing {source.name}", unit="doc") as progress:
        try:
            meta = write_pretokenized(reader.first_epoch_texts(), tokenizer, staged_prefix, progress)
        except (NoDocumentsError, EmptyEpochError) as error:
            # A damaged file or a fatal bad record is the reader's own error, and passes through as it is.
            # The staging path in write_pretokenized's message means nothing to the user: name the subset.
            raise ValueError(
                f"{source.name}: no documents in {list(source.paths)} (skipped: {dict(reader.stats.skipped)}, "
                f"other Pile subsets: {reader.stats.filtered}); nothing was written"
            ) from error
    logger.info(
        "%s: %d documents, %d tokens (skipped: %s)",
        source.name,
        meta["documents"],
        meta["tokens"],
        dict(reader.stats.skipped) or "none",
    )


if __name__ == "__main__":
    exit_on_input_error(main)()
