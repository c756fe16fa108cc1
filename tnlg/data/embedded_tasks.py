"""Embedded fine-tuning datasets: usable with no download, as `.jsonl` files `datasets` can read.

`embedded:docstrings`: summarization built from the standard library's own source, which every
Python install carries. For each public function, method and class whose docstring has a one-line
summary paragraph and a body, one example:

    document  the definition's signature line, then the docstring's body (everything after the
              summary paragraph, dedented), e.g. "def dedent(text):\\nThis can be used to ..."
    summary   the docstring's first paragraph, joined to one line, e.g. "Remove any common
              leading whitespace from every line in `text`."
    module    the dotted module name, e.g. "textwrap"
    name      the qualified name in the module, e.g. "TextWrapper.wrap"

Sources are read with `ast`, never imported or executed. Kept: summaries that read as a sentence
(4-40 words, at most 200 characters, capitalised, ending in a full stop), bodies of at least 15
words, documents of at most 1,500 characters (longer ones are dropped, not cut, so no document
ends mid-sentence), the summary not repeated verbatim in the document. Skipped: private names and
modules (leading underscore), tests, demos, IDLE and site-packages, exact duplicates. Splits are a
stable hash of `module.name` (90/5/5), so a definition stays in its split across Python versions
and same-named definitions (a platform-specific variant in an `if`) never straddle two splits.
With Python 3.11.7 that is 1,101 train, 60 validation and 49 test examples (1,210 in all),
built in about 5 s on one CPU core (parsing ~600 files), once, atomically, into
`$TNLG_CACHE/embedded-docstrings-v1-py{x.y.z}/{split}.jsonl`: the same bytes for a given Python.

`embedded:qa`: a small extractive QA set in SQuAD's format (`id`, `title`, `context`, `question`,
`answers` = {"text": [...], "answer_start": [...]}), written by hand for this package
(`qa_fixture.jsonl`: 14 contexts, 42 questions, some with two acceptable spans). Its validation
split is every 4th context (from the first) with all of its questions (31 train, 11 validation
rows), so no validation context is seen in training; the split files are cached under a name
holding the fixture's hash.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .corpus import _stdlib_directory, _stdlib_files, build_atomically, cache_root

DOCSTRING_SPLITS = ("train", "validation", "test")
QA_SPLITS = ("train", "validation")
QA_VALIDATION_EVERY = 4
SQUAD_COLUMNS = ("id", "title", "context", "question", "answers")
# Bump when the filters or format change, so caches built by older code are not reused.
_DOCSTRINGS_FORMAT = 1
# corpus.py already skips tests, demos and site-packages; IDLE's modules document GUI callbacks.
_EXCLUDED_PACKAGES = {"idlelib"}
_SUMMARY_WORDS = (4, 40)
_SUMMARY_MAX_CHARS = 200
_BODY_MIN_WORDS = 15
_DOCUMENT_MAX_CHARS = 1500
_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def docstring_summaries(root: Path | None = None) -> Path:
    """The directory of `{train,validation,test}.jsonl`, built on first use (about 5 s)."""
    version = ".".join(map(str, sys.version_info[:3]))  # docstrings change between patch releases
    directory = (root or cache_root()) / f"embedded-docstrings-v{_DOCSTRINGS_FORMAT}-py{version}"
    if not all((directory / f"{split}.jsonl").is_file() for split in DOCSTRING_SPLITS):
        build_atomically(directory, _write_docstring_splits)
    return directory


def qa_fixture_path() -> Path:
    """The hand-written SQuAD-format fixture shipped in the package (all rows, unsplit)."""
    return Path(__file__).with_name("qa_fixture.jsonl")


def qa_splits(root: Path | None = None) -> Path:
    """The directory of the QA fixture's `{train,validation}.jsonl`, validated and built on first use."""
    fixture = qa_fixture_path().read_bytes()
    directory = (root or cache_root()) / f"embedded-qa-{hashlib.sha1(fixture).hexdigest()[:12]}"
    if not all((directory / f"{split}.jsonl").is_file() for split in QA_SPLITS):
        build_atomically(directory, _write_qa_splits)
    return directory


_DATASETS: dict[str, tuple[Callable[[Path | None], Path], tuple[str, ...]]] = {
    "embedded:docstrings": (docstring_summaries, DOCSTRING_SPLITS),
    "embedded:qa": (qa_splits, QA_SPLITS),
}


def embedded_split_file(name: str, split: str, root: Path | None = None) -> Path:
    """The `.jsonl` file of one split of an embedded dataset, built if needed."""
    if name not in _DATASETS:
        raise ValueError(f"unknown embedded dataset {name!r}; known: {sorted(_DATASETS)}")
    build, splits = _DATASETS[name]
    if split not in splits:
        raise ValueError(f"{name} has no split {split!r}; known: {list(splits)}")
    return build(root) / f"{split}.jsonl"


def embedded_dataset_files(name: str, split: str, *, root: Path | None = None) -> list[str]:
    """`data_files` for `datasets.load_dataset("json", data_files=...)`."""
    return [str(embedded_split_file(name, split, root))]


def check_squad_rows(rows: Iterable[Mapping[str, Any]]) -> None:
    """Raise ValueError, naming the row, unless every row has SQuAD's columns and answer spans."""
    seen: set[str] = set()
    for row in rows:
        row_id = row.get("id")
        if set(row) != set(SQUAD_COLUMNS):
            raise ValueError(f"row {row_id!r}: columns {sorted(row)}, expected {list(SQUAD_COLUMNS)}")
        if row_id in seen:
            raise ValueError(f"row {row_id!r}: duplicate id")
        seen.add(row_id)
        texts, starts = row["answers"]["text"], row["answers"]["answer_start"]
        if not texts or len(texts) != len(starts):
            raise ValueError(f"row {row_id!r}: needs as many answer_start as answer texts (at least one)")
        for text, start in zip(texts, starts, strict=True):
            found = row["context"][start : start + len(text)]
            if not text or found != text:
                raise ValueError(f"row {row_id!r}: answer {text!r} is not at {start} (found {found!r})")


def _write_qa_splits(directory: Path) -> None:
    rows = [json.loads(line) for line in qa_fixture_path().read_text(encoding="utf-8").splitlines()]
    check_squad_rows(rows)
    # Split by context, not by row: a validation question over a context seen in training would
    # measure memorisation of that context.
    contexts = list(dict.fromkeys(row["context"] for row in rows))
    held_out = set(contexts[::QA_VALIDATION_EVERY])
    _write_jsonl(directory / "train.jsonl", (row for row in rows if row["context"] not in held_out))
    _write_jsonl(directory / "validation.jsonl", (row for row in rows if row["context"] in held_out))


def _write_docstring_splits(directory: Path) -> None:
    rows: dict[str, list[dict[str, str]]] = {split: [] for split in DOCSTRING_SPLITS}
    for row in _docstring_examples():
        rows[_split_of(f"{row['module']}.{row['name']}")].append(row)
    for split, split_rows in rows.items():
        _write_jsonl(directory / f"{split}.jsonl", split_rows)


def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    # Bytes, not text mode: "\n" line ends on every platform keep the files identical everywhere.
    with open(path, "wb") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")


def _split_of(key: str) -> str:
    bucket = int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def _docstring_examples() -> Iterator[dict[str, str]]:
    root = _stdlib_directory()
    seen: set[tuple[str, str]] = set()
    for path in _stdlib_files():  # sorted, so the first of two duplicates is always the one kept
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or _EXCLUDED_PACKAGES.intersection(parts) or any(p.startswith("_") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # a few files are deliberately not UTF-8 or not valid Python (lib2to3 data)
        module = ".".join(parts)
        for qualname, node in _definitions(tree.body):
            example = _example(node)
            if example is not None and example not in seen:
                seen.add(example)
                document, summary = example
                yield {"module": module, "name": qualname, "document": document, "summary": summary}


def _definitions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, _Definition]]:
    """Public functions and classes, and the public methods of public classes, in source order."""
    for node in body:
        if isinstance(node, _Definition):
            if node.name.startswith("_"):
                continue
            yield prefix + node.name, node
            if isinstance(node, ast.ClassDef):
                yield from _definitions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.If | ast.Try):
            # Platform and fallback variants (`if sys.platform == "win32": def ...`) are public API.
            handlers = [h.body for h in node.handlers] if isinstance(node, ast.Try) else []
            finals = [node.finalbody] if isinstance(node, ast.Try) else []
            for block in [node.body, node.orelse, *handlers, *finals]:
                yield from _definitions(block, prefix)


def _example(node: _Definition) -> tuple[str, str] | None:
    """(document, summary) for a definition, or None when its docstring does not make a good one."""
    raw = ast.get_docstring(node, clean=False)
    if not raw:
        return None
    lines = inspect.cleandoc(raw).splitlines()
    blank = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
    summary = " ".join(" ".join(lines[:blank]).split())
    body = textwrap.dedent("\n".join(lines[blank:])).strip()
    words = len(summary.split())
    if not (
        _SUMMARY_WORDS[0] <= words <= _SUMMARY_WORDS[1]
        and len(summary) <= _SUMMARY_MAX_CHARS
        and summary[0].isupper()
        and summary.endswith(".")
        and ">>>" not in summary
        and len(body.split()) >= _BODY_MIN_WORDS
    ):
        return None
    document = f"{_signature(node)}\n{body}"
    # Whitespace-normalised: a summary repeated across a line break would still give the answer away.
    if len(document) > _DOCUMENT_MAX_CHARS or summary in " ".join(document.split()):
        return None
    return document, summary


def _signature(node: _Definition) -> str:
    """The definition's header line, rebuilt from the tree (the source may span several lines)."""
    type_params = getattr(node, "type_params", None)  # Python 3.12+: `def f[T](x: T)`
    generic = f"[{', '.join(ast.unparse(p) for p in type_params)}]" if type_params else ""
    if isinstance(node, ast.ClassDef):
        bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
        return f"class {node.name}{generic}({', '.join(bases)}):" if bases else f"class {node.name}{generic}:"
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{keyword} {node.name}{generic}({ast.unparse(node.args)}){returns}:"
