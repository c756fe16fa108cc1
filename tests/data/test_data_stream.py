"""The streaming pipeline: readers, rank sharding, packing, mixing, shuffling, exact resume, bad records."""

from __future__ import annotations

import gzip
import itertools
import json

import numpy as np
import pytest

from tnlg.data.packing import Mixture, PackedSource
from tnlg.data.sources import BadRecordError, DocumentReader, SourceConfig
from tnlg.data.stream import StreamConfig, TokenStream
from tnlg.data.tokenizer import byte_level_tokenizer

# The GPU image has no zstandard: these tests need it to write .zst data, so they skip there.
zstandard = pytest.importorskip("zstandard")


def write_jsonl(path, records, compression=None):
    data = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)
    if compression == "zst":
        data = zstandard.ZstdCompressor().compress(data)
    elif compression == "gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def docs(prefix, count, subset=None):
    return [
        {"text": f"{prefix} document number {i}.", "meta": {"pile_set_name": subset}} for i in range(count)
    ]


@pytest.fixture
def corpus(tmp_path):
    """Two sources in three files and three compressions."""
    write_jsonl(tmp_path / "a1.jsonl", docs("alpha", 7))
    write_jsonl(tmp_path / "a2.jsonl.zst", docs("alpha-two", 6), "zst")
    write_jsonl(tmp_path / "b.jsonl.gz", docs("beta", 9), "gz")
    return {
        "alpha": SourceConfig(name="alpha", paths=(str(tmp_path / "a*.jsonl*"),), weight=3.0),
        "beta": SourceConfig(name="beta", paths=(str(tmp_path / "b.jsonl.gz"),), weight=1.0),
    }


def one_epoch(reader):
    """The texts a reader yields in its first epoch."""
    texts = []
    for document in reader:
        if reader.epoch > 0:
            break
        texts.append(document.text)
    return texts


def test_every_record_is_read_once_per_epoch_at_every_world_size(corpus):
    everything = one_epoch(DocumentReader(corpus["alpha"]))
    assert len(everything) == 13
    for world_size in (2, 3, 5):
        shares = [one_epoch(DocumentReader(corpus["alpha"], rank, world_size)) for rank in range(world_size)]
        assert sorted(itertools.chain(*shares)) == sorted(everything)


def test_later_epochs_reshuffle_the_file_order(corpus):
    reader = DocumentReader(corpus["alpha"], seed=0)
    orders = {tuple(p.name for p in reader.file_order(epoch)) for epoch in range(8)}
    assert len(orders) == 2  # both orders of the two files occur


def test_bad_records_are_counted_by_reason_and_skipped(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"text": "good one"},
            b"{not json",
            {"body": "no text field"},
            {"text": "   "},
            b"\xff\xfe bad bytes",
            {"text": 5},
            b"",
            [1, 2],
            {"text": "good two"},
        ],
    )
    reader = DocumentReader(SourceConfig(name="bad", paths=(str(path),)))
    assert one_epoch(reader) == ["good one", "good two"]
    assert reader.stats.skipped == {
        "malformed JSON (Expecting property name enclosed in double quotes)": 1,
        "no 'text' field": 1,
        "empty document": 1,
        "not UTF-8": 1,
        "'text' is not a string": 1,
        "empty line": 1,
        "not a JSON object": 1,
    }
    assert f"{path}:2: malformed JSON" in caplog.text


def test_fatal_policy_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, b"{oops"])
    reader = DocumentReader(SourceConfig(name="bad", paths=(str(path),)), on_bad_record="fatal")
    with pytest.raises(BadRecordError, match=rf"{path}:2: malformed JSON"):
        one_epoch(reader)


def test_missing_files_and_sources_without_documents_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        DocumentReader(SourceConfig(name="x", paths=(str(tmp_path / "none*.jsonl"),)))
    path = write_jsonl(tmp_path / "empty.jsonl", [{"other": 1}])
    with pytest.raises(ValueError, match="no document in a whole epoch"):
        next(iter(DocumentReader(SourceConfig(name="x", paths=(str(path),)))))


def test_pile_subsets_can_be_selected(tmp_path):
    path = write_jsonl(tmp_path / "pile.jsonl", docs("web", 4, "Pile-CC") + docs("code", 3, "Github"))
    reader = DocumentReader(SourceConfig(name="github", paths=(str(path),), pile_set_name="Github"))
    assert [d.text for d in itertools.islice(reader, 3)] == [f"code document number {i}." for i in range(3)]
    assert reader.stats.filtered == 4  # the four Pile-CC records before them


def test_packing_loses_and_pads_nothing(corpus):
    tokenizer = byte_level_tokenizer()
    packed = PackedSource(DocumentReader(corpus["beta"]), tokenizer, seq_len=16)
    stream = np.concatenate([next(packed) for _ in range(40)])
    expected = np.concatenate(
        [np.asarray(tokenizer(f"beta document number {i % 9}.")["input_ids"] + [256]) for i in range(40)]
    )
    assert np.array_equal(stream, expected[: len(stream)])


def test_mixture_follows_the_weights_at_every_prefix(corpus):
    tokenizer = byte_level_tokenizer()
    sources = [PackedSource(DocumentReader(corpus[name]), tokenizer, 8) for name in ("alpha", "beta")]
    mixture = Mixture(sources, [3.0, 1.0])
    for n in range(1, 200):
        next(mixture)
        assert abs(mixture.counts[0] - 0.75 * n) < 1 and abs(mixture.counts[1] - 0.25 * n) < 1


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_resumed_stream_continues_exactly(corpus, world_size):
    config = StreamConfig(sources=(corpus["alpha"], corpus["beta"]), seq_len=12, seed=3, shuffle_buffer=7)
    tokenizer = byte_level_tokenizer()
    for rank in range(world_size):
        uninterrupted = TokenStream(config, tokenizer, batch_size=3, rank=rank, world_size=world_size)
        expected = [b["input_ids"] for b in itertools.islice(iter(uninterrupted), 30)]  # several epochs
        first = TokenStream(config, tokenizer, batch_size=3, rank=rank, world_size=world_size)
        iterator = iter(first)
        for _ in range(11):
            next(iterator)
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores: plain JSON
        resumed = TokenStream(config, tokenizer, batch_size=3, rank=rank, world_size=world_size)
        resumed.load_state_dict(state)
        rest = [b["input_ids"] for b in itertools.islice(iter(resumed), 19)]
        for got, want in zip(rest, expected[11:], strict=True):
            assert np.array_equal(got, want)


def test_state_of_another_rank_is_refused(corpus):
    config = StreamConfig(sources=(corpus["alpha"],), seq_len=8)
    state = TokenStream(config, byte_level_tokenizer(), 2, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="saved by rank 0 cannot resume rank 1"):
        TokenStream(config, byte_level_tokenizer(), 2, rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved at world size 2 and is per rank.*pre-tokenized"):
        TokenStream(config, byte_level_tokenizer(), 2, rank=0, world_size=1).load_state_dict(state)


def test_batches_are_labelled_for_the_causal_lm(corpus):
    config = StreamConfig(sources=(corpus["alpha"],), seq_len=10, shuffle_buffer=1)
    batch = next(iter(TokenStream(config, byte_level_tokenizer(), batch_size=4)))
    assert batch["input_ids"].shape == (4, 10) and batch["input_ids"].dtype.is_floating_point is False
    assert np.array_equal(batch["labels"], batch["input_ids"])


def test_parquet_sources_read_through_datasets(tmp_path):
    pytest.importorskip("datasets")  # the reader's; the GPU image has none
    import pyarrow  # a dependency of datasets
    import pyarrow.parquet

    table = pyarrow.table({"content": ["first parquet row", "second parquet row", ""]})
    pyarrow.parquet.write_table(table, tmp_path / "rows.parquet")
    reader = DocumentReader(
        SourceConfig(name="pq", paths=(str(tmp_path / "rows.parquet"),), text_field="content")
    )
    assert one_epoch(reader) == ["first parquet row", "second parquet row"]
    assert reader.stats.skipped == {"empty document": 1}


@pytest.fixture
def dataset_directory(tmp_path):
    """A local `datasets` dataset (a directory whose file names give the splits) and the same records
    as one plain file."""
    pytest.importorskip("datasets")  # such a source is read through it; the GPU image has none
    records = docs("gamma", 11, "Pile-CC")
    (tmp_path / "gamma" / "data").mkdir(parents=True)
    write_jsonl(tmp_path / "gamma" / "data" / "train.jsonl", records)
    write_jsonl(tmp_path / "gamma" / "data" / "validation.jsonl", docs("held-out", 2))
    return tmp_path / "gamma", write_jsonl(tmp_path / "gamma.jsonl", records)


def test_a_datasets_source_reads_like_the_same_records_in_a_file(dataset_directory):
    directory, plain = dataset_directory
    by_name = SourceConfig(name="gamma", dataset=str(directory))
    by_file = SourceConfig(name="gamma", paths=(str(plain),))
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            assert one_epoch(DocumentReader(by_name, rank, world_size)) == one_epoch(
                DocumentReader(by_file, rank, world_size)
            )
    validation = SourceConfig(name="gamma", dataset=str(directory), split="validation")
    assert one_epoch(DocumentReader(validation)) == [
        "held-out document number 0.",
        "held-out document number 1.",
    ]


def test_a_datasets_source_resumes_exactly(dataset_directory):
    directory, _ = dataset_directory
    source = SourceConfig(name="gamma", dataset=str(directory))
    reader = DocumentReader(source, rank=1, world_size=2)
    uninterrupted = [d.text for d in itertools.islice(DocumentReader(source, 1, 2), 9)]
    first = [d.text for d in itertools.islice(reader, 4)]
    resumed = DocumentReader(source, rank=1, world_size=2)
    resumed.load_state_dict(json.loads(json.dumps(reader.state_dict())))
    assert first + [d.text for d in itertools.islice(resumed, 5)] == uninterrupted  # crosses an epoch


def test_an_unreachable_dataset_is_an_error_naming_it(dataset_directory, monkeypatch):
    datasets = pytest.importorskip("datasets")

    monkeypatch.setattr(
        datasets.config, "HF_HUB_OFFLINE", True
    )  # no network in tests: the hub is "unreachable"
    with pytest.raises(
        OSError, match=r"source 'pile': cannot read someone/no-such-dataset:train: the dataset"
    ):
        next(iter(DocumentReader(SourceConfig(name="pile", dataset="someone/no-such-dataset"))))
    directory, _ = dataset_directory
    with pytest.raises(OSError, match="Bad split: test"):
        next(iter(DocumentReader(SourceConfig(name="gamma", dataset=str(directory), split="test"))))
    with pytest.raises(ValueError, match=r"either paths .* or dataset"):
        SourceConfig(name="both", paths=("a.jsonl",), dataset="x")
    with pytest.raises(ValueError, match=r"either paths .* or dataset"):
        SourceConfig(name="neither")
