"""A file that two of a reader's paths name is refused, naming it and both paths, however it is spelt
([Note: each file once] in tnlg/data/files.py): its records would repeat within an epoch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from scripts.prepare_data import main as prepare
from tnlg.data.finetune import load_rows
from tnlg.data.sources import DocumentReader, SourceConfig


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # so that relative spellings (./a.jsonl) name the same files
    for name in ("a", "b"):
        rows = [{"text": f"{name} {i}", "document": f"{name} {i}", "summary": "s"} for i in range(3)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.symlink(tmp_path / "a.jsonl", tmp_path / "link-to-a.jsonl")
    os.link(tmp_path / "a.jsonl", tmp_path / "hard-link-to-a.jsonl")
    return tmp_path


TWICE = {
    "a glob over a listed file": ("a.jsonl", "[ab].jsonl"),
    "a relative and an absolute spelling": ("./a.jsonl", "{dir}/a.jsonl"),
    "a symbolic link": ("a.jsonl", "link-to-a.jsonl"),
    "a hard link": ("hard-link-to-a.jsonl", "a.jsonl"),
    "the same path twice": ("b.jsonl", "b.jsonl"),
}


def named_twice(corpus: Path, case: str) -> tuple[list[str], str]:
    """The two paths of `case`, and the message that must name them."""
    paths = [path.format(dir=corpus) for path in TWICE[case]]
    first, second = (re.escape(repr(path)) for path in paths)
    if first == second:
        return paths, rf"is named twice by {first}"
    return paths, rf"is named by both {first} and {second}"


@pytest.mark.parametrize("case", TWICE)
def test_a_source_refuses_a_file_that_two_paths_name(corpus, case):
    paths, message = named_twice(corpus, case)
    with pytest.raises(ValueError, match=rf"source 's': .*{message}.*weight in the mixture"):
        SourceConfig(name="s", paths=tuple(paths)).files()


@pytest.mark.parametrize("case", TWICE)
def test_fine_tuning_files_refuse_a_file_that_two_paths_name(corpus, case):
    paths, message = named_twice(corpus, case)
    with pytest.raises(ValueError, match=rf"{message}, so its rows would be read twice"):
        load_rows(None, paths, "train")


def test_prepare_data_refuses_inputs_that_name_a_file_twice_and_writes_nothing(corpus):
    args = ["--input", "a.jsonl", "b.jsonl", "[ab].jsonl", "--tokenizer", "byte-level", "--output", "out"]
    with pytest.raises(ValueError, match=r"a\.jsonl is named by both 'a\.jsonl' and '\[ab\]\.jsonl'"):
        prepare(args)
    assert not list(corpus.glob("out*"))


def test_one_glob_that_reaches_a_file_twice_is_refused(corpus):
    # *.jsonl matches a.jsonl and the two links to it
    with pytest.raises(ValueError, match=r"a\.jsonl is named twice by '\*\.jsonl' \(the second time as"):
        SourceConfig(name="s", paths=("*.jsonl",)).files()


def test_paths_that_name_different_files_read_each_record_once(corpus):
    source = SourceConfig(name="s", paths=("a.jsonl", "b.jsonl"))
    texts = list(DocumentReader(source).first_epoch_texts())
    assert sorted(texts) == [f"{name} {i}" for name in "ab" for i in range(3)]
