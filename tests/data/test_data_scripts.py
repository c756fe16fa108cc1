"""The data scripts refuse to replace what they were not asked to replace, and apply their settings."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from scripts.prepare_data import main as prepare
from scripts.train_tokenizer import main as train
from tnlg.data.tokenizer import byte_level_tokenizer


def write_corpus(path: Path, subsets: tuple[str, ...] = ("A",), documents: int = 6) -> Path:
    lines = [
        json.dumps({"text": f"text number {i} " * 3, "meta": {"pile_set_name": subsets[i % len(subsets)]}})
        for i in range(documents)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def prepare_args(corpus: Path, output: Path, *extra: str) -> list[str]:
    return ["--input", str(corpus), "--tokenizer", "byte-level", "--output", str(output), *extra]


# ---------------------------------------------------------------- prepare_data
def test_prepare_data_refuses_an_existing_output_unless_overwrite(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    prepare(prepare_args(corpus, tmp_path / "out"))
    first = (tmp_path / "out.bin").read_bytes()
    other = write_corpus(tmp_path / "other.jsonl", documents=3)
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare(prepare_args(other, tmp_path / "out"))
    assert (tmp_path / "out.bin").read_bytes() == first
    prepare(prepare_args(other, tmp_path / "out", "--overwrite"))
    assert (tmp_path / "out.bin").read_bytes() != first


def test_prepare_data_never_writes_over_its_input(tmp_path):
    corpus = write_corpus(tmp_path / "mydata.json")
    before = corpus.read_bytes()
    for extra in ((), ("--overwrite",)):
        with pytest.raises(ValueError, match="is one of the inputs"):
            prepare(prepare_args(corpus, tmp_path / "mydata", *extra))
        assert corpus.read_bytes() == before


def test_prepare_data_writes_no_subset_when_one_is_empty(tmp_path):
    corpus = write_corpus(tmp_path / "pile.jsonl", subsets=("Wiki",))
    with pytest.raises(ValueError, match="Github: no documents"):
        prepare(prepare_args(corpus, tmp_path / "p", "--pile-set-name", "Wiki", "--pile-set-name", "Github"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pile.jsonl"]


# ---------------------------------------------------------------- train_tokenizer
def train_args(corpus: Path, output: Path, *extra: str) -> list[str]:
    return ["--input", str(corpus), "--vocab-size", "270", "--output", str(output), *extra]


def test_train_tokenizer_refuses_a_non_empty_directory_unless_overwrite(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        train(train_args(corpus, tmp_path / "tok"))
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["notes.txt"]
    train(train_args(corpus, tmp_path / "tok", "--overwrite"))
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_train_tokenizer_never_replaces_a_models_tokenizer(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    model = tmp_path / "model"
    byte_level_tokenizer().save_pretrained(model)
    (model / "config.json").write_text("{}")
    before = (model / "tokenizer.json").read_bytes()
    with pytest.raises(FileExistsError, match="holds a model"):
        train(train_args(corpus, model, "--overwrite"))
    assert (model / "tokenizer.json").read_bytes() == before


def test_train_tokenizer_applies_max_documents_and_reports_the_texts_used(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=6)
    with pytest.raises(ValueError, match="--max-documents must be at least 1"):
        train(train_args(corpus, tmp_path / "zero", "--max-documents", "0"))
    assert not (tmp_path / "zero").exists()
    with caplog.at_level(logging.INFO, logger="train_tokenizer"):
        train(train_args(corpus, tmp_path / "three", "--max-documents", "3"))
        train(train_args(corpus, tmp_path / "all"))
    reports = [r.getMessage() for r in caplog.records if r.name == "train_tokenizer"]
    assert "on 3 documents" in reports[0] and "on 6 documents" in reports[1]


def test_train_tokenizer_refuses_a_vocabulary_the_corpus_cannot_reach(tmp_path):
    # it saved a much smaller tokenizer and exited 0: a model sized to --vocab-size would carry rows
    # no token reaches
    corpus, output = write_corpus(tmp_path / "corpus.jsonl", documents=3), tmp_path / "tok"
    asking = ["--input", str(corpus), "--output", str(output), "--vocab-size"]
    with pytest.raises(
        ValueError, match=r"--vocab-size 4096: the 3 documents support only \d+ tokens"
    ) as error:
        train([*asking, "4096"])
    assert not output.exists() or not any(output.iterdir())
    reached = int(str(error.value).split("support only ")[1].split()[0])
    train([*asking, str(reached)])  # the size it names is taken
    assert len(byte_level_tokenizer()) < reached
