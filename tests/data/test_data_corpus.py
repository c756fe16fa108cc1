"""The embedded default corpus and byte-level BPE training."""

from __future__ import annotations

import json

import pytest

from tnlg.data.corpus import embedded_corpus
from tnlg.data.tokenizer import load_tokenizer, train_byte_level_bpe

# The GPU image has no zstandard: these tests need it to write .zst data, so they skip there.
zstandard = pytest.importorskip("zstandard")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return embedded_corpus(max_bytes_per_subset=300_000, root=tmp_path_factory.mktemp("cache"))


def read(path):
    with zstandard.ZstdDecompressor().stream_reader(open(path, "rb")) as reader:
        return [json.loads(line) for line in reader.read().decode().splitlines()]


def test_corpus_has_both_subsets_and_a_validation_split(corpus):
    for split in ("train", "validation"):
        for path, subset in zip(corpus.files(split), corpus.subsets, strict=True):
            records = read(path)
            assert records, path
            assert {r["meta"]["pile_set_name"] for r in records} == {subset}
            assert all(r["text"].strip() for r in records)
    code = read(corpus.files("train")[0])
    assert any("def " in r["text"] for r in code)
    prose = " ".join(r["text"] for r in read(corpus.files("train")[1]))
    assert " the " in prose


def test_corpus_is_the_same_bytes_when_built_again(corpus, tmp_path):
    again = embedded_corpus(max_bytes_per_subset=300_000, root=tmp_path)
    for first, second in zip(
        corpus.files() + corpus.files("validation"), again.files() + again.files("validation"), strict=True
    ):
        assert first.read_bytes() == second.read_bytes()


def test_corpus_is_reused_once_built(corpus):
    before = [p.stat().st_mtime_ns for p in corpus.files()]
    embedded_corpus(max_bytes_per_subset=300_000, root=corpus.directory.parent)
    assert [p.stat().st_mtime_ns for p in corpus.files()] == before


def test_trained_tokenizer_round_trips_and_ends_with_eos(tmp_path, corpus):
    texts = [r["text"] for r in read(corpus.files()[1])]
    tokenizer = train_byte_level_bpe(texts, vocab_size=600)
    assert len(tokenizer) == 600 and tokenizer.eos_token_id == 599
    sample = "Return the number of items in a container. Ünïcödé too: 🙂"
    ids = tokenizer(sample)["input_ids"]
    assert tokenizer.decode(ids) == sample
    assert len(ids) < len(sample.encode())  # merges were learned
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(tmp_path)
    assert reloaded(sample)["input_ids"] == ids


def test_tokenizer_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="at least 257"):
        train_byte_level_bpe(["text"], vocab_size=100)
    with pytest.raises(FileNotFoundError, match="no tokenizer directory"):
        load_tokenizer(tmp_path / "missing")
    assert len(load_tokenizer("byte-level")) == 257
