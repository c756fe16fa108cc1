"""The pre-tokenized memory-mapped format: writing, random access, global order, exact resume."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tnlg.data.pretokenized import PretokenizedCorpus, PretokenizedStream, write_pretokenized
from tnlg.data.tokenizer import byte_level_tokenizer

TEXTS = [f"document {i}: " + "words " * (i % 7) for i in range(60)]


@pytest.fixture
def prefix(tmp_path):
    write_pretokenized(TEXTS, byte_level_tokenizer(), tmp_path / "corpus")
    return tmp_path / "corpus"


def test_tokens_are_the_documents_each_followed_by_eos(prefix):
    tokenizer = byte_level_tokenizer()
    expected = np.concatenate([np.asarray(tokenizer(t)["input_ids"] + [256]) for t in TEXTS])
    corpus = PretokenizedCorpus(prefix, seq_len=10)
    assert corpus.tokens.dtype == np.uint16 and np.array_equal(corpus.tokens, expected)
    assert len(corpus) == len(expected) // 10
    assert np.array_equal(corpus[3], expected[30:40])
    offsets = np.fromfile(str(prefix) + ".idx", dtype=np.int64)
    assert len(offsets) == len(TEXTS) + 1 and offsets[-1] == len(expected)


def test_global_order_is_the_same_at_every_world_size(prefix):
    corpus = PretokenizedCorpus(prefix, seq_len=8)
    single = PretokenizedStream([corpus], [1.0], batch_size=1, seed=4)
    iterator = iter(single)
    reference = [next(iterator)["input_ids"][0] for _ in range(40)]
    # A real order, not one sample repeated (some sequences share their contents: the texts repeat).
    assert len({tuple(r.tolist()) for r in reference}) >= 15
    for world_size in (2, 4):
        streams = [
            iter(PretokenizedStream([corpus], [1.0], 1, 4, rank, world_size)) for rank in range(world_size)
        ]
        interleaved = [next(streams[i % world_size])["input_ids"][0] for i in range(40)]
        for got, want in zip(interleaved, reference, strict=True):
            assert np.array_equal(got, want)


def test_an_epoch_visits_every_sequence_once(prefix):
    corpus = PretokenizedCorpus(prefix, seq_len=8)
    stream = PretokenizedStream([corpus], [1.0], batch_size=1, seed=0)
    seen = {tuple(stream.global_sample(i)) for i in range(len(corpus))}
    assert seen == {tuple(corpus[i]) for i in range(len(corpus))}


def test_weights_blend_two_corpora(tmp_path):
    write_pretokenized(["a" * 50] * 20, byte_level_tokenizer(), tmp_path / "a")
    write_pretokenized(["b" * 50] * 20, byte_level_tokenizer(), tmp_path / "b")
    corpora = [PretokenizedCorpus(tmp_path / name, seq_len=5) for name in ("a", "b")]
    stream = PretokenizedStream(corpora, [1.0, 3.0], batch_size=1)
    letters = [int(stream.global_sample(i)[0]) for i in range(400)]
    a_token = byte_level_tokenizer()("a")["input_ids"][0]
    share = sum(1 for t in letters if t == a_token) / 400
    assert share == pytest.approx(0.25, abs=0.02)  # EOS-led sequences are rare and count as b or a


def test_resume_is_exact(prefix):
    corpus = PretokenizedCorpus(prefix, seq_len=8)
    expected = [
        b["input_ids"] for b in itertools.islice(iter(PretokenizedStream([corpus], [1.0], 3, 1, 1, 2)), 12)
    ]
    first = PretokenizedStream([corpus], [1.0], 3, 1, 1, 2)
    iterator = iter(first)
    for _ in range(5):
        next(iterator)
    resumed = PretokenizedStream([corpus], [1.0], 3, 1, 1, 2)
    resumed.load_state_dict(first.state_dict())
    for got, want in zip(itertools.islice(iter(resumed), 7), expected[5:], strict=True):
        assert np.array_equal(got["input_ids"], want)


@pytest.mark.parametrize("new_world_size", [1, 3, 4])
def test_a_position_saved_at_one_world_size_resumes_at_another_on_the_next_global_sample(
    prefix, new_world_size
):
    corpus = PretokenizedCorpus(prefix, seq_len=8)
    reference = PretokenizedStream([corpus], [1.0], 1, seed=2)
    saved = []
    for rank in range(2):  # two ranks took 5 batches of 3: global samples 0..29
        stream = PretokenizedStream([corpus], [1.0], 3, 2, rank, 2)
        for _ in itertools.islice(iter(stream), 5):
            pass
        saved.append(stream.state_dict())
    assert saved[0] == saved[1] and saved[0]["global_samples"] == 30
    resumed = []
    for rank in range(new_world_size):
        stream = PretokenizedStream([corpus], [1.0], 1, 2, rank, new_world_size)
        stream.load_state_dict(saved[rank % 2])
        resumed.append(iter(stream))
    for index in range(30, 30 + 4 * new_world_size):
        got = next(resumed[(index - 30) % new_world_size])["input_ids"][0]
        assert np.array_equal(got, reference.global_sample(index)), index


def test_a_position_written_by_the_per_rank_format_still_loads(prefix):
    corpus = PretokenizedCorpus(prefix, seq_len=8)
    stream = PretokenizedStream([corpus], [1.0], 1, 2, 0, 2)
    stream.load_state_dict({"sample": 7, "seed": 2, "world_size": 2})
    assert np.array_equal(next(iter(stream))["input_ids"][0], stream.global_sample(14))


def test_damaged_corpora_are_refused(prefix, tmp_path):
    bin_path = prefix.with_name("corpus.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated or missing"):
        PretokenizedCorpus(prefix, seq_len=8)
    with pytest.raises(FileNotFoundError, match="no pre-tokenized corpus"):
        PretokenizedCorpus(tmp_path / "nothing", seq_len=8)


def test_scripts_train_a_tokenizer_and_prepare_a_corpus(tmp_path):
    import json

    from scripts.prepare_data import main as prepare
    from scripts.train_tokenizer import main as train

    lines = [
        json.dumps({"text": f"text number {i} " * 5, "meta": {"pile_set_name": "A" if i % 2 else "B"}})
        for i in range(40)
    ]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    train(
        ["--input", str(tmp_path / "corpus.jsonl"), "--vocab-size", "300", "--output", str(tmp_path / "tok")]
    )
    prepare(
        [
            "--input",
            str(tmp_path / "corpus.jsonl"),
            "--tokenizer",
            str(tmp_path / "tok"),
            "--output",
            str(tmp_path / "data"),
            "--pile-set-name",
            "A",
            "--pile-set-name",
            "B",
        ]
    )
    for subset in ("A", "B"):
        corpus = PretokenizedCorpus(tmp_path / f"data.{subset}", seq_len=4)
        assert corpus.meta["documents"] == 20 and corpus.meta["vocab_size"] == 300
