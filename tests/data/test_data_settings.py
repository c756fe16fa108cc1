"""Data settings and inputs that must be applied or refused, never silently bent."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from tnlg.data.packing import PackedSource
from tnlg.data.pretokenized import PretokenizedCorpus, PretokenizedStream, write_pretokenized
from tnlg.data.sources import DocumentReader, SourceConfig
from tnlg.data.tasks import TaskFormat, encode_example
from tnlg.data.tokenizer import END_OF_TEXT, byte_level_tokenizer, encode_texts, train_byte_level_bpe


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def gpt2_style_tokenizer(directory: Path):
    """A GPT-2 tokenizer (vocab.json + merges.txt, GPT2Tokenizer) over the 256 byte symbols."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[END_OF_TEXT] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(directory)


def every_tokenizer_kind(tmp_path: Path) -> list:
    bpe = train_byte_level_bpe(["hello world, hello data"] * 20, 280)
    bpe.save_pretrained(tmp_path / "bpe")
    (tmp_path / "gpt2").mkdir()
    return [
        byte_level_tokenizer(),
        AutoTokenizer.from_pretrained(tmp_path / "bpe"),
        gpt2_style_tokenizer(tmp_path / "gpt2"),
    ]


# ---------------------------------------------------------------- special-token text stays text
def test_special_token_text_is_encoded_as_text_by_every_tokenizer_kind(tmp_path):
    for tokenizer in every_tokenizer_kind(tmp_path):
        ids = encode_texts(tokenizer, [f"ab{END_OF_TEXT}cd"])[0]
        assert tokenizer.eos_token_id not in ids, type(tokenizer).__name__
        assert tokenizer.decode(ids) == f"ab{END_OF_TEXT}cd"


def test_packed_documents_end_only_at_real_document_ends(tmp_path):
    tokenizer = byte_level_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", [f"ab{END_OF_TEXT}cd", "ef"])
    packed = PackedSource(DocumentReader(SourceConfig(name="a", paths=(str(path),))), tokenizer, 8)
    tokens = np.concatenate([next(packed) for _ in range(3)]).tolist()
    first_end = len(f"ab{END_OF_TEXT}cd")
    ends = [i for i, t in enumerate(tokens) if t == tokenizer.eos_token_id]
    assert ends[:2] == [first_end, first_end + len("ef") + 1]


def test_pretokenized_documents_end_only_at_real_document_ends(tmp_path):
    tokenizer = byte_level_tokenizer()
    write_pretokenized([f"ab{END_OF_TEXT}cd", "ef"], tokenizer, tmp_path / "c")
    tokens = np.fromfile(tmp_path / "c.bin", dtype=np.uint16).tolist()
    assert tokens.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(tokens[:-4]) == f"ab{END_OF_TEXT}cd"


def test_task_fields_keep_special_token_text_as_text():
    tokenizer = byte_level_tokenizer()
    task = TaskFormat("summarization")
    example = encode_example({"document": f"x{END_OF_TEXT}y", "summary": f"s{END_OF_TEXT}"}, task, tokenizer)
    assert example["input_ids"].count(tokenizer.eos_token_id) == 1  # the add_eos one, at the end
    assert example["input_ids"][-1] == tokenizer.eos_token_id


# ---------------------------------------------------------------- a corpus's tokenizer is the run's
def pretokenized_run(prefix: Path):
    from tnlg.run.config import load_run_config

    overrides = ["--data.pretokenized", f"[{{prefix: {prefix}, weight: 1}}]", "--data.seq_len", "8"]
    return load_run_config(None, overrides)


def test_a_pretokenized_corpus_is_refused_under_another_tokenizer(tmp_path):
    from tnlg.run.pretrain import training_stream

    write_pretokenized(["some text to train on"] * 20, byte_level_tokenizer(), tmp_path / "corpus")
    config = pretokenized_run(tmp_path / "corpus")
    bpe = train_byte_level_bpe(["some text to train on"] * 20, 272)
    with pytest.raises(ValueError, match=r"vocab_size 257 vs \d+, eos_token_id 256 vs \d+"):
        training_stream(config, bpe, rank=0, world=1)
    same_size = byte_level_tokenizer(eos_token="<|end|>")  # same size and end-of-text id, other vocabulary
    with pytest.raises(ValueError, match="vocabulary fingerprint"):
        training_stream(config, same_size, rank=0, world=1)
    assert isinstance(training_stream(config, byte_level_tokenizer(), rank=0, world=1), PretokenizedStream)


def test_a_corpus_written_before_fingerprints_is_checked_on_what_it_records(tmp_path):
    write_pretokenized(["some text to train on"] * 20, byte_level_tokenizer(), tmp_path / "old")
    meta_path = tmp_path / "old.json"
    meta = json.loads(meta_path.read_text())
    del meta["tokenizer_fingerprint"]
    meta_path.write_text(json.dumps(meta))
    corpus = PretokenizedCorpus(tmp_path / "old", 8)
    corpus.check_tokenizer(byte_level_tokenizer(eos_token="<|end|>"))  # size and id agree: accepted
    with pytest.raises(ValueError, match=r"eos_token_id 256 vs \d+"):
        corpus.check_tokenizer(train_byte_level_bpe(["some text"] * 20, 272))


# ---------------------------------------------------------------- mixture weights
@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan])
def test_pretokenized_mixture_weights_must_be_finite_and_positive(tmp_path, weight):
    tokenizer = byte_level_tokenizer()
    write_pretokenized(["a" * 40] * 4, tokenizer, tmp_path / "a")
    write_pretokenized(["b" * 40] * 4, tokenizer, tmp_path / "b")
    corpora = [PretokenizedCorpus(tmp_path / name, 8) for name in ("a", "b")]
    with pytest.raises(ValueError, match=r"b: weight must be a finite number > 0"):
        PretokenizedStream(corpora, [1, weight], batch_size=2)


@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan])
def test_streamed_source_weights_must_be_finite_and_positive(tmp_path, weight):
    # NaN passes `weight <= 0`: the shares were all NaN, and the first source took every sequence
    with pytest.raises(ValueError, match=r"source 'b': weight must be a finite number > 0"):
        SourceConfig(name="b", paths=(str(tmp_path / "b.jsonl"),), weight=weight)


# ---------------------------------------------------------------- streaming resume over the same files
def read_some(reader: DocumentReader, count: int) -> list[str]:
    documents = iter(reader)
    return [next(documents).text for _ in range(count)]


def test_a_streaming_resume_over_other_files_is_refused(tmp_path):
    write_jsonl(tmp_path / "a1.jsonl", [f"one {i}" for i in range(5)])
    write_jsonl(tmp_path / "a2.jsonl", [f"two {i}" for i in range(5)])
    source = SourceConfig(name="a", paths=(str(tmp_path / "a*.jsonl"),))
    reader = DocumentReader(source)
    read_some(reader, 7)
    state = json.loads(json.dumps(reader.state_dict()))
    write_jsonl(tmp_path / "a0.jsonl", ["zero"])
    (tmp_path / "a2.jsonl").unlink()
    with pytest.raises(ValueError, match=r"added: \[.*a0.jsonl'\]; removed: \[.*a2.jsonl'\]"):
        DocumentReader(source).load_state_dict(state)


def test_a_streaming_state_without_files_resumes_with_a_warning_but_not_past_a_files_end(tmp_path, caplog):
    path = write_jsonl(tmp_path / "a.jsonl", [f"doc {i}" for i in range(6)])
    source = SourceConfig(name="a", paths=(str(path),))
    reader = DocumentReader(source)
    read_some(reader, 4)
    state = reader.state_dict()
    del state["files"]  # as saved before the state recorded them
    resumed = DocumentReader(source)
    with caplog.at_level(logging.WARNING, logger="tnlg.data.sources"):
        resumed.load_state_dict(state)
    assert "does not record its files" in caplog.text
    assert read_some(resumed, 2) == ["doc 4", "doc 5"]
    write_jsonl(path, ["doc 0", "doc 1"])  # shorter than the saved position (record 4)
    shortened = DocumentReader(source)
    shortened.load_state_dict(state)
    with pytest.raises(ValueError, match="holds 2 records, but the saved data position is at record 4"):
        read_some(shortened, 1)


# ---------------------------------------------------------------- .json files
def test_a_json_array_file_is_read_as_records_beside_json_lines(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "first"}, {"text": "second"}], indent=1))
    write_jsonl(tmp_path / "b.json", ["third"])
    reader = DocumentReader(SourceConfig(name="a", paths=(str(tmp_path / "*.json"),)))
    assert list(reader.first_epoch_texts()) == ["first", "second", "third"]
    assert not reader.stats.skipped


# ---------------------------------------------------------------- what reading skipped reaches the user
def test_one_epochs_texts_count_that_epochs_bad_records_once(tmp_path):
    # first_epoch_texts read on into the next epoch to see it had begun: a bad record leading it was
    # counted (and logged) a second time, so prepare_data and train_tokenizer reported too many skipped
    (tmp_path / "a.jsonl").write_text('{"nottext": 1}\n' + json.dumps({"text": "kept"}) + "\n")
    reader = DocumentReader(SourceConfig(name="a", paths=(str(tmp_path / "a.jsonl"),)))
    assert list(reader.first_epoch_texts()) == ["kept"]
    assert dict(reader.stats.skipped) == {"no 'text' field": 1}


def test_a_source_logs_each_new_epoch_once_with_its_bad_record_totals(tmp_path, caplog):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "good"}\nnot json\n{"text": ""}\n{"text": "also good"}\n')
    reader = DocumentReader(SourceConfig(name="a", paths=(str(path),)))
    with caplog.at_level(logging.INFO, logger="tnlg.data.sources"):
        read_some(reader, 5)  # two epochs and a half
    epochs = [r.getMessage() for r in caplog.records if "starting epoch" in r.getMessage()]
    assert len(epochs) == 2
    assert "epoch 0 read, starting epoch 1; so far 2 documents" in epochs[0]
    assert "'empty document': 2" in epochs[1] and "'malformed JSON" in epochs[1]


def test_a_clean_source_starting_over_again_logs_at_debug(tmp_path, caplog):
    # the first start-over is news, the next ones of a clean source are not (a small corpus wraps often)
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "good"}\n{"text": "also good"}\n')
    reader = DocumentReader(SourceConfig(name="a", paths=(str(path),)))
    with caplog.at_level(logging.DEBUG, logger="tnlg.data.sources"):
        read_some(reader, 7)  # three epochs and a half
    epochs = [r.levelname for r in caplog.records if "starting epoch" in r.getMessage()]
    assert epochs == ["INFO", "DEBUG", "DEBUG"]


# ---------------------------------------------------------------- token ids beyond the vocabulary
@pytest.mark.parametrize("recorded", [True, False])
def test_a_corpus_with_ids_beyond_its_vocabulary_is_refused_when_opened(tmp_path, recorded):
    from tnlg.data.files import DamagedFileError

    write_pretokenized(["some text"] * 4, byte_level_tokenizer(), tmp_path / "c")
    tokens = np.fromfile(tmp_path / "c.bin", dtype=np.uint16)
    tokens[3] = 300
    tokens.tofile(tmp_path / "c.bin")
    meta = json.loads((tmp_path / "c.json").read_text())
    if recorded:
        meta["max_token_id"] = 300
    else:
        del meta["max_token_id"]  # written before the largest id was recorded: the small file is scanned
    (tmp_path / "c.json").write_text(json.dumps(meta))
    with pytest.raises(
        DamagedFileError, match=r"c.bin is damaged: it holds token id 300, beyond its vocabulary"
    ):
        PretokenizedCorpus(tmp_path / "c", 8)
