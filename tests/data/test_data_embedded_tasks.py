"""The embedded fine-tuning datasets: stdlib docstring summaries and the hand-written QA fixture."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tnlg.data.embedded_tasks import (
    DOCSTRING_SPLITS,
    QA_SPLITS,
    check_squad_rows,
    docstring_summaries,
    embedded_dataset_files,
    qa_fixture_path,
)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def docstrings(root):
    directory = docstring_summaries(root)
    return {split: read_jsonl(directory / f"{split}.jsonl") for split in DOCSTRING_SPLITS}


@pytest.mark.slow
def test_docstring_splits_are_disjoint_nonempty_and_well_formed(docstrings):
    keys = {split: {(r["module"], r["name"]) for r in rows} for split, rows in docstrings.items()}
    assert all(docstrings.values()), {split: len(rows) for split, rows in docstrings.items()}
    assert not keys["train"] & keys["validation"]
    assert not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    for rows in docstrings.values():
        for row in rows:
            assert set(row) == {"module", "name", "document", "summary"}
            assert row["document"].strip() and row["summary"].strip(), row
            assert "\n" not in row["summary"], row
            assert row["summary"] not in row["document"], row
            assert not row["name"].split(".")[-1].startswith("_"), row


def test_known_stdlib_function_has_its_summary(docstrings):
    (dedent,) = [
        row
        for rows in docstrings.values()
        for row in rows
        if (row["module"], row["name"]) == ("textwrap", "dedent")
    ]
    assert dedent["summary"] == "Remove any common leading whitespace from every line in `text`."
    assert dedent["document"].startswith("def dedent(text):\nThis can be used to make triple-quoted")


@pytest.mark.slow
def test_docstrings_are_the_same_bytes_when_built_again(root, docstrings, tmp_path):
    first, again = docstring_summaries(root), docstring_summaries(tmp_path)
    for split in DOCSTRING_SPLITS:
        assert (first / f"{split}.jsonl").read_bytes() == (again / f"{split}.jsonl").read_bytes()


def test_docstrings_are_reused_once_built(root, docstrings):
    directory = docstring_summaries(root)
    before = [(directory / f"{s}.jsonl").stat().st_mtime_ns for s in DOCSTRING_SPLITS]
    assert docstring_summaries(root) == directory
    assert [(directory / f"{s}.jsonl").stat().st_mtime_ns for s in DOCSTRING_SPLITS] == before


def test_qa_fixture_answers_are_spans_of_their_context():
    rows = read_jsonl(qa_fixture_path())
    assert len(rows) >= 40
    check_squad_rows(rows)
    assert any(len(row["answers"]["text"]) == 2 for row in rows)


def test_squad_check_names_the_broken_row():
    rows = read_jsonl(qa_fixture_path())[:3]
    broken = copy.deepcopy(rows)
    broken[1]["answers"]["answer_start"][0] += 1
    with pytest.raises(ValueError, match=repr(broken[1]["id"])):
        check_squad_rows(broken)
    missing = copy.deepcopy(rows)
    del missing[2]["title"]
    with pytest.raises(ValueError, match=repr(missing[2]["id"])):
        check_squad_rows(missing)


def test_qa_validation_holds_out_whole_contexts(root):
    train, validation = (
        read_jsonl(Path(embedded_dataset_files("embedded:qa", split, root=root)[0])) for split in QA_SPLITS
    )
    assert train and validation
    assert not {r["context"] for r in train} & {r["context"] for r in validation}
    assert len(train) + len(validation) == len(read_jsonl(qa_fixture_path()))


def test_unknown_names_and_splits_list_the_known_ones(root):
    with pytest.raises(ValueError, match=r"embedded:docstrings.*embedded:qa"):
        embedded_dataset_files("embedded:nope", "train", root=root)
    with pytest.raises(ValueError, match=r"'train', 'validation', 'test'"):
        embedded_dataset_files("embedded:docstrings", "dev", root=root)
    with pytest.raises(ValueError, match=r"'train', 'validation'\]"):
        embedded_dataset_files("embedded:qa", "test", root=root)


@pytest.mark.parametrize(
    ("name", "split"),
    [("embedded:docstrings", split) for split in DOCSTRING_SPLITS]
    + [("embedded:qa", split) for split in QA_SPLITS],
)
def test_datasets_loads_each_split(root, docstrings, tmp_path, name, split):
    # Imported here: the GPU image has no datasets, and a module-level import would stop collection.
    datasets = pytest.importorskip("datasets")
    files = embedded_dataset_files(name, split, root=root)
    loaded = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path))
    assert len(loaded) == len(read_jsonl(Path(files[0])))
    if name == "embedded:qa":
        assert loaded.column_names == ["id", "title", "context", "question", "answers"]
        assert set(loaded[0]["answers"]) == {"text", "answer_start"}
    else:
        assert loaded.column_names == ["module", "name", "document", "summary"]
