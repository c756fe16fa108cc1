"""The embedded default corpus: Pile-style `.jsonl.zst` built from text every Python install carries.

Two subsets, each a `pile_set_name`:
- `PythonStdlibCode`: the standard library's own source files (tests, demos and site-packages
  excluded), one document per file;
- `PythonDocs`: English prose: the `pydoc` help topics, and every standard-library module's
  docstring (read with `ast`, so nothing is imported or executed).

Files are visited in sorted order and nothing time-dependent is written, so for a given Python
version the corpus is the same bytes everywhere. It is built once into a cache directory
(`$TNLG_CACHE`, else `~/.cache/tnlg`), atomically, with a held-out validation split (every
`VALIDATION_EVERY`-th document of each subset, from the first, so it is never empty).
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .optional import require_zstandard

logger = logging.getLogger(__name__)

VALIDATION_EVERY = 20
# Enough text for a few hundred CPU training steps, small enough to build in seconds.
DEFAULT_MAX_BYTES = 3_000_000
_EXCLUDED_PARTS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
}


@dataclass(frozen=True)
class EmbeddedCorpus:
    """Where the embedded corpus lives: `{subset}.{split}.jsonl.zst` files in `directory`."""

    directory: Path
    subsets: tuple[str, ...] = ("PythonStdlibCode", "PythonDocs")

    def files(self, split: str = "train") -> list[Path]:
        return [self.directory / f"{subset}.{split}.jsonl.zst" for subset in self.subsets]


def cache_root() -> Path:
    return Path(os.environ.get("TNLG_CACHE", Path.home() / ".cache" / "tnlg"))


def embedded_corpus(
    max_bytes_per_subset: int = DEFAULT_MAX_BYTES, root: Path | None = None
) -> EmbeddedCorpus:
    """The embedded corpus, built on first use (a few seconds) and reused after."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    directory = (root or cache_root()) / f"embedded-corpus-{version}-{max_bytes_per_subset}"
    corpus = EmbeddedCorpus(directory)
    if all(f.is_file() for split in ("train", "validation") for f in corpus.files(split)):
        return corpus

    def write(staging: Path) -> None:
        for subset, documents in (("PythonStdlibCode", _stdlib_sources()), ("PythonDocs", _english_docs())):
            _write_subset(staging, subset, documents, max_bytes_per_subset)

    build_atomically(directory, write)
    logger.info("embedded corpus ready in %s", directory)
    return corpus


def build_atomically(directory: Path, write: Callable[[Path], None]) -> None:
    """Run `write` on a staging directory beside `directory`, then rename it to `directory`."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent) as staging:
        staging = Path(staging)
        write(staging)
        try:
            staging.rename(directory)  # atomic: another process either sees all files or none
        except OSError:
            if not directory.is_dir():  # not a concurrent build that won the race
                raise
        else:
            staging.mkdir()  # TemporaryDirectory removes its (now empty) path on exit


def _stdlib_directory() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> Iterator[Path]:
    root = _stdlib_directory()
    for path in sorted(root.rglob("*.py")):
        if not _EXCLUDED_PARTS.intersection(path.relative_to(root).parts):
            yield path


def _stdlib_sources() -> Iterator[str]:
    for path in _stdlib_files():
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are deliberately not UTF-8


def _english_docs() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        yield topics[name].strip()
    root = _stdlib_directory()
    for path in _stdlib_files():
        try:
            docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if docstring and len(docstring) > 200:
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            yield f"{module}\n\n{docstring}"


def _write_subset(directory: Path, subset: str, documents: Iterator[str], max_bytes: int) -> None:
    zstandard = require_zstandard("writing the embedded corpus (.jsonl.zst files)")
    written = 0
    with contextlib.ExitStack() as stack:
        # A checksum per frame: a damaged cached file is then refused, not read as far as it goes.
        writers = {
            split: stack.enter_context(
                zstandard.ZstdCompressor(level=10, write_checksum=True).stream_writer(
                    stack.enter_context(open(directory / f"{subset}.{split}.jsonl.zst", "wb"))
                )
            )
            for split in ("train", "validation")
        }
        for index, text in enumerate(documents):
            if not text.strip():
                continue
            record = json.dumps({"text": text, "meta": {"pile_set_name": subset}}, ensure_ascii=False)
            split = "validation" if index % VALIDATION_EVERY == 0 else "train"
            writers[split].write(record.encode("utf-8") + b"\n")
            written += len(text)
            if written >= max_bytes:
                break
