"""Data that is damaged, empty or wrongly typed is refused by name, never read silently as something else:
truncated / corrupt compressed files in every reader, null and non-text fields in fine-tuning rows,
empty files and corpora, and paths whose names hold glob characters."""

from __future__ import annotations

import gzip
import json
import logging
import pickle

import pytest

from tnlg.data import DamagedFileError
from tnlg.data.files import check_compressed, expand_path, read_lines
from tnlg.data.finetune import encode_rows, load_rows
from tnlg.data.pretokenized import PretokenizedCorpus, write_pretokenized
from tnlg.data.sources import DocumentReader, SourceConfig
from tnlg.data.stream import StreamConfig, TokenStream
from tnlg.data.tasks import BadExampleError, TaskFormat, encode_example
from tnlg.data.tokenizer import byte_level_tokenizer

# The GPU image has no zstandard: these tests need it to write .zst data, so they skip there.
zstandard = pytest.importorskip("zstandard")

SUMMARIZATION = TaskFormat("summarization", max_length=256)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def jsonl_bytes(count: int, field: str = "text") -> bytes:
    return b"".join(json.dumps({field: f"document number {i} " * 8}).encode() + b"\n" for i in range(count))


def two_zstd_frames(data: bytes, keep_of_second: int | None = None, checksum: bool = False) -> bytes:
    """`data` as two zstd frames split at a line end, the second cut to `keep_of_second` bytes: the
    first frame alone decompresses to whole lines, so only the frame check can see the cut."""
    middle = data.index(b"\n", len(data) // 2) + 1
    compressor = zstandard.ZstdCompressor(write_checksum=checksum)
    second = compressor.compress(data[middle:])
    return compressor.compress(data[:middle]) + second[:keep_of_second]


def damaged_files(data: bytes) -> dict[str, bytes]:
    """name -> bytes of each kind of damage, with a whole-file suffix the readers accept."""
    gz = gzip.compress(data)
    flipped_gz = bytearray(gz)
    flipped_gz[len(gz) // 2] ^= 0x55
    checked = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    flipped_zst = bytearray(checked)
    flipped_zst[len(checked) // 2] ^= 0x01
    return {
        "zst-cut-mid-frame.jsonl.zst": two_zstd_frames(data, keep_of_second=7),
        "zst-cut-half.jsonl.zst": checked[: len(checked) // 2],
        "zst-checksum.jsonl.zst": bytes(flipped_zst),
        "zst-not-zstd.jsonl.zst": b'{"text": "plain json in a .zst"}\n',
        "zst-empty.jsonl.zst": b"",
        "gz-cut-half.jsonl.gz": gz[: len(gz) // 2],
        "gz-crc.jsonl.gz": bytes(flipped_gz),
        "gz-empty.jsonl.gz": b"",
    }


@pytest.fixture
def damaged(tmp_path):
    paths = {}
    for name, data in damaged_files(jsonl_bytes(3000)).items():
        paths[name] = tmp_path / name
        paths[name].write_bytes(data)
    return paths


# ------------------------------------------------------------------ damaged compressed files


@pytest.mark.parametrize("policy", ["skip", "fatal"])
def test_the_streaming_reader_refuses_every_damaged_compressed_file_whatever_the_policy(damaged, policy):
    for name, path in damaged.items():
        reader = DocumentReader(SourceConfig(name="web", paths=(str(path),)), on_bad_record=policy)
        with pytest.raises(DamagedFileError, match=rf"{path} is damaged") as caught:
            list(reader.first_epoch_texts())
        assert caught.value.path == str(path), name


def test_the_damage_is_named_and_survives_pickling(damaged):
    with pytest.raises(DamagedFileError, match="truncated: the file ends inside a zstd frame"):
        list(read_lines(damaged["zst-cut-mid-frame.jsonl.zst"]))
    with pytest.raises(DamagedFileError, match="truncated: the gzip stream ends before its end marker"):
        list(read_lines(damaged["gz-cut-half.jsonl.gz"]))
    with pytest.raises(DamagedFileError, match="corrupt gzip data"):
        check_compressed(damaged["gz-crc.jsonl.gz"])
    with pytest.raises(DamagedFileError, match=r"empty \(0 bytes\), which is not a zstd stream"):
        check_compressed(damaged["zst-empty.jsonl.zst"])
    error = DamagedFileError("/data/a.jsonl.zst", "truncated")
    copy = pickle.loads(pickle.dumps(error))  # ranks send their errors to the launcher pickled
    assert (copy.path, copy.problem, str(copy)) == (error.path, error.problem, str(error))
    assert isinstance(copy, ValueError)


def test_whole_multi_frame_and_multi_member_files_read_every_line(tmp_path):
    data = jsonl_bytes(500)
    (tmp_path / "frames.jsonl.zst").write_bytes(two_zstd_frames(data, checksum=True))
    (tmp_path / "members.jsonl.gz").write_bytes(gzip.compress(data[:1000]) + gzip.compress(data[1000:]))
    (tmp_path / "crlf.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(data.replace(b"\n", b"\r\n"))
    )
    expected = data.splitlines()
    for name in ("frames.jsonl.zst", "members.jsonl.gz", "crlf.jsonl.zst"):
        assert list(read_lines(tmp_path / name)) == expected, name


def test_a_damaged_file_stops_the_token_stream(tmp_path, tokenizer):
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(two_zstd_frames(jsonl_bytes(100), keep_of_second=7))  # ~8 kB of whole lines first
    source = SourceConfig(name="web", paths=(str(path),))
    stream = TokenStream(StreamConfig(sources=(source,), seq_len=64, shuffle_buffer=1), tokenizer, 4)
    batches = iter(stream)
    with pytest.raises(DamagedFileError, match=r"cut\.jsonl\.zst is damaged"):
        for _ in range(100):  # the intact frame's sequences, then the cut one
            next(batches)


def test_prepare_data_refuses_a_damaged_input_and_writes_nothing(damaged, tmp_path):
    from scripts.prepare_data import main as prepare

    output = tmp_path / "out" / "corpus"
    # damage before the first document too: it was reported as "no documents"
    for name in (
        "zst-cut-mid-frame.jsonl.zst",
        "gz-cut-half.jsonl.gz",
        "zst-empty.jsonl.zst",
        "gz-empty.jsonl.gz",
    ):
        arguments = ["--input", str(damaged[name]), "--tokenizer", "byte-level", "--output", str(output)]
        with pytest.raises(DamagedFileError, match=rf"{name} is damaged"):
            prepare([*arguments, "--on-bad-record", "skip"])
    assert not list(output.parent.glob("*"))  # no corpus and no staged .tmp files


def test_prepare_data_names_a_fatal_first_record(tmp_path):
    from scripts.prepare_data import main as prepare

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": broken\n{"text": "fine"}\n')
    arguments = ["--input", str(corpus), "--tokenizer", "byte-level", "--output", str(tmp_path / "out" / "c")]
    with pytest.raises(ValueError, match=r"corpus.jsonl:1: .*JSON"):
        prepare([*arguments, "--on-bad-record", "fatal"])


def test_a_damaged_parquet_file_is_named_by_both_readers(tmp_path):
    pytest.importorskip("datasets", reason="needs the datasets package")  # both read parquet through it
    pd = pytest.importorskip("pandas")  # not at module level: the GPU image may lack it
    pd.DataFrame({"text": [f"row {i} " * 20 for i in range(200)]}).to_parquet(tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DamagedFileError, match=r"cut.parquet is damaged: it cannot be read as parquet"):
        list(DocumentReader(SourceConfig(name="pq", paths=(str(cut),))).first_epoch_texts())
    with pytest.raises(DamagedFileError, match=r"cut.parquet is damaged: it cannot be read as parquet"):
        load_rows(None, [str(cut)], "train")


@pytest.mark.parametrize(
    "name", ["zst-cut-mid-frame.jsonl.zst", "gz-cut-half.jsonl.gz", "zst-empty.jsonl.zst"]
)
def test_fine_tuning_files_that_are_damaged_are_refused(damaged, tmp_path, name):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    path = tmp_path / name
    path.write_bytes(damaged_files(jsonl_bytes(3000, field="document"))[name])
    with pytest.raises(DamagedFileError, match=rf"{name} is damaged"):
        load_rows(None, [str(path)], "train")


def test_a_damaged_pretokenized_corpus_is_named(tmp_path, tokenizer):
    prefix = tmp_path / "corpus"
    write_pretokenized([f"text {i} " * 10 for i in range(20)], tokenizer, prefix)
    meta = tmp_path / "corpus.json"
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])
    with pytest.raises(DamagedFileError, match=rf"{meta} is damaged: it is not valid JSON"):
        PretokenizedCorpus(prefix, seq_len=8)
    meta.write_text(json.dumps({"format_version": 1, "dtype": "uint16"}))
    with pytest.raises(DamagedFileError, match=r"it lacks \['tokens'"):
        PretokenizedCorpus(prefix, seq_len=8)
    good = json.loads(text)
    for key, value in (("vocab_size", "257"), ("max_token_id", -1), ("documents", True)):
        meta.write_text(json.dumps({**good, key: value}))  # a TypeError naming no file, or a wrong check
        with pytest.raises(
            DamagedFileError, match=rf"{meta} is damaged: {key} .* is not a whole number >= 0"
        ):
            PretokenizedCorpus(prefix, seq_len=8)


# ------------------------------------------------------------------ fine-tuning rows that are not text


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


BAD_VALUES = [
    (None, "is null", "null field"),
    (5, "holds int 5, not text", "not text"),
    (["a", "b"], "holds list .*, not text", "not text"),
    ("   ", "is empty", "empty field"),
]


@pytest.mark.parametrize(("value", "message", "reason"), BAD_VALUES)
@pytest.mark.parametrize("field", ["document", "summary"])
def test_a_null_or_non_text_field_stops_naming_file_and_row_or_is_skipped_and_counted(
    tmp_path, tokenizer, caplog, field, value, message, reason
):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    rows = [{"document": f"document {i}", "summary": f"summary {i}"} for i in range(4)]
    rows[2][field] = value
    path = write_rows(tmp_path / "train.jsonl", rows)
    loaded = load_rows(None, [str(path)], "train")
    with pytest.raises(BadExampleError, match=rf"train: {path} row 2: '{field}' .*{message}"):
        encode_rows(loaded, SUMMARIZATION, tokenizer, where="train")
    with caplog.at_level(logging.WARNING):
        examples = encode_rows(loaded, SUMMARIZATION, tokenizer, on_long_example="skip", where="train")
    assert len(examples) == 3
    assert f"train: 1 examples skipped ({reason}: 1)" in caplog.text
    assert f"{path} row 2" in caplog.text
    assert all("None" not in tokenizer.decode(e["input_ids"]) for e in examples)


def test_rows_of_several_files_are_named_by_their_own_file(tmp_path, tokenizer):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    good = [{"document": "d", "summary": "s"}] * 3
    first = write_rows(tmp_path / "a.jsonl", good)
    second = write_rows(tmp_path / "b.jsonl", [*good[:1], {"document": "d", "summary": None}])
    rows = load_rows(None, [str(tmp_path / "*.jsonl")], "train")
    assert len(rows) == 5 and rows.origin(2) == f"{first} row 2"
    with pytest.raises(BadExampleError, match=rf"{second} row 1: 'summary' .* is null"):
        encode_rows(rows, SUMMARIZATION, tokenizer)


def test_question_answering_fields_are_checked_too(tokenizer):
    extractive = TaskFormat("extractive_qa", columns={"answer": "answers"})
    row = {"context": "Paris is in France.", "question": "Where is Paris?", "answers": {"text": ["France"]}}
    assert encode_example(row, extractive, tokenizer)["input_ids"]
    for bad, message in [
        ({**row, "question": None}, "'question' .* is null"),
        ({**row, "answers": {"text": [None]}}, "an answer text in 'answers' is null"),
        ({**row, "answers": {"text": []}}, "'answers' has no answer text"),
        ({**row, "context": 3.5}, "'context' .* holds float 3.5, not text"),
    ]:
        with pytest.raises(BadExampleError, match=message):
            encode_example(bad, extractive, tokenizer)
    generative = TaskFormat("generative_qa")
    plain = {"question": "Why?", "answer": "Because."}
    without = encode_example(plain, generative, tokenizer)
    assert encode_example({**plain, "context": None}, generative, tokenizer) == without  # optional
    with pytest.raises(BadExampleError, match=r"'context' .* holds int 7, not text"):
        encode_example({**plain, "context": 7}, generative, tokenizer)


def test_csv_cells_are_read_as_the_text_written(tmp_path, tokenizer):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    pd = pytest.importorskip("pandas")
    path = tmp_path / "train.csv"
    pd.DataFrame({"document": ["agent", "power", "blank"], "summary": ["007", "1e3", None]}).to_csv(
        path, index=False
    )
    rows = load_rows(None, [str(path)], "train")
    assert [rows[i]["summary"] for i in range(2)] == ["007", "1e3"]
    with pytest.raises(BadExampleError, match=rf"{path} row 2: 'summary' .* is null"):
        encode_rows(rows, SUMMARIZATION, tokenizer)


# ------------------------------------------------------------------ empty files and corpora


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("train.jsonl", "", r"is empty \(0 bytes\): no examples"),
        ("train.json", "", r"is empty \(0 bytes\): no examples"),
        ("train.jsonl", "\n\n", "holds no rows: no examples"),
        ("train.csv", "document,summary\n", "holds no rows: no examples"),
        ("train.jsonl.gz", gzip.compress(b""), "holds no data once decompressed: no examples"),
    ],
)
def test_an_empty_fine_tuning_file_is_refused_by_name(tmp_path, name, content, message):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=rf"{path} {message}"):
        load_rows(None, [str(path)], "train")


def test_a_split_whose_rows_are_all_bad_has_no_examples(tokenizer):
    rows = [{"document": None, "summary": "s"}, {"document": "d", "summary": ""}]
    with pytest.raises(
        ValueError, match=r"validation: no examples: all 2 rows were skipped \(null field: 1, empty"
    ):
        encode_rows(rows, SUMMARIZATION, tokenizer, on_long_example="skip", where="validation")


def test_an_empty_pretraining_corpus_is_refused_naming_its_files(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n{"text": ""}\n')
    for path in (empty, bad):
        stream = TokenStream(
            StreamConfig(sources=(SourceConfig(name="web", paths=(str(path),)),), seq_len=8), tokenizer, 2
        )
        with pytest.raises(ValueError, match=rf"source 'web' \({path}\) gives rank 0 of 1 no document"):
            next(iter(stream))
    with pytest.raises(ValueError, match="no documents to write"):
        write_pretokenized([], tokenizer, tmp_path / "nothing")
    assert not list(tmp_path.glob("nothing*"))


# ------------------------------------------------------------------ glob characters in real names


@pytest.fixture
def bracketed(tmp_path):
    directory = tmp_path / "run[v1]"
    directory.mkdir()
    (directory / "train.jsonl").write_bytes(
        jsonl_bytes(3, field="document").replace(b"}", b', "summary": "s"}')
    )
    return directory


def test_existing_paths_are_literal_and_only_missing_ones_are_globs(bracketed):
    literal = bracketed / "train.jsonl"
    assert expand_path(str(literal)) == [literal]
    assert expand_path(str(bracketed / "*.jsonl")) == [literal]  # the existing directory taken literally
    assert expand_path(str(bracketed.parent / "run?v1?" / "train.jsonl")) == [literal]  # a glob still globs
    for part in (1, 2, 3):
        (bracketed / f"part{part}.jsonl").write_text("{}\n")
    # part[12].jsonl does not exist: it is a glob, its character class a class
    assert expand_path(str(bracketed / "part[12].jsonl")) == [
        bracketed / "part1.jsonl",
        bracketed / "part2.jsonl",
    ]
    (bracketed / "part[12].jsonl").write_text("{}\n")
    assert expand_path(str(bracketed / "part[12].jsonl")) == [bracketed / "part[12].jsonl"]  # now it exists


def test_a_bracketed_directory_is_read_by_every_reader(bracketed):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    for pattern in (bracketed / "train.jsonl", bracketed / "*.jsonl"):
        reader = DocumentReader(SourceConfig(name="r", paths=(str(pattern),), text_field="document"))
        assert len(list(reader.first_epoch_texts())) == 3
        assert len(load_rows(None, [str(pattern)], "train")) == 3
    with pytest.raises(FileNotFoundError, match="matches no file"):
        SourceConfig(name="r", paths=(str(bracketed / "none*.jsonl"),)).files()
    with pytest.raises(ValueError, match="is a directory"):
        SourceConfig(name="r", paths=(str(bracketed),)).files()
