"""Evaluation inputs are read as what they are or refused by name: text that is not UTF-8 (with the
byte offset), binary and compressed files, null passages; and an evaluation over nothing is an
error, never a perplexity of nan."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support import REPO
from tnlg.data.tasks import IGNORE_INDEX, TaskFormat, encode_example
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.eval.lambada import LastWordResult
from tnlg.eval.perplexity import PerplexityResult
from tnlg.eval.suite import evaluate_lambada, evaluate_perplexity, read_text
from tnlg.eval.tasks import evaluation_rows, target_loss, task_scores
from tnlg.inference.settings import GenerationSettings


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def test_text_that_is_not_utf8_is_refused_naming_the_file_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path} is not UTF-8 text: byte offset 3 \(b'\\xe9'\)"):
        read_text(path)


@pytest.mark.parametrize("name", ["README.md", "notes", "module.py", "wiki.test.txt"])
def test_any_file_that_is_not_a_data_format_is_read_as_text(tmp_path, debug_model, tokenizer, name):
    text = "# Title\n\nSome prose, with a {brace} and a \u00e9.\n" * 2
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert read_text(path) == text
    result = evaluate_perplexity(debug_model, tokenizer, path, max_length=128, stride=None)
    # byte-level: every byte is scored
    assert result["tokens"] == len(text.encode())


def test_binary_and_compressed_text_files_are_refused_by_name(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"abc\x00\x01\x02")
    with pytest.raises(ValueError, match=rf"{binary} has a NUL byte at offset 3: a binary file"):
        read_text(binary)
    packed = tmp_path / "notes.txt.gz"
    packed.write_bytes(gzip.compress(b"some text"))
    with pytest.raises(ValueError, match=rf"{packed} is compressed but not a data file \(.*\.jsonl\.gz"):
        read_text(packed)
    with pytest.raises(FileNotFoundError, match="no file at"):
        read_text(tmp_path / "missing.txt")


def test_an_empty_text_is_refused_naming_the_file(tmp_path, debug_model, tokenizer):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match=rf"{path} holds no token of text"):
        evaluate_perplexity(debug_model, tokenizer, path, max_length=64, stride=None)


def test_null_or_non_text_rows_of_a_data_file_are_named(tmp_path, debug_model, tokenizer):
    pytest.importorskip("datasets", reason="needs the datasets package")  # a data file is read through it
    path = tmp_path / "passages.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["one two three", None, "four five"]))
    with pytest.raises(ValueError, match=rf"{path} row 1: 'text' is null, not text"):
        read_text(path)  # str(None) would have scored the text "None"
    with pytest.raises(ValueError, match=rf"{path} row 1: 'text' is null"):
        evaluate_lambada(debug_model, tokenizer, path)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["one two three", "alone"]))
    with pytest.raises(ValueError, match=rf"{path} row 1: passage has no context"):
        evaluate_lambada(debug_model, tokenizer, path)
    text = tmp_path / "passages.txt"
    text.write_text("one two three\n")
    with pytest.raises(ValueError, match=rf"{text}: LAMBADA passages are read from a data file"):
        evaluate_lambada(debug_model, tokenizer, text)


def test_evaluations_over_nothing_are_errors_not_nan(debug_model, tokenizer):
    with pytest.raises(ValueError, match="perplexity over 0 scored tokens"):
        PerplexityResult(nll=0.0, tokens=0)
    with pytest.raises(ValueError, match="last-word accuracy over 0 passages"):
        LastWordResult(correct=0, total=0)
    no_target = {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX] * 3}
    with pytest.raises(ValueError, match="have no target token"):
        target_loss(debug_model, [no_target], batch_size=1, pad_token_id=256)


def test_a_batch_without_targets_does_not_poison_the_loss(debug_model, tokenizer):
    task = TaskFormat("summarization", max_length=64)
    example = encode_example({"document": "a short document", "summary": "short"}, task, tokenizer)
    no_target = {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX] * 3}
    alone = target_loss(debug_model, [example], batch_size=1, pad_token_id=256)
    mixed = target_loss(debug_model, [example, no_target], batch_size=1, pad_token_id=256)
    assert torch.isfinite(torch.tensor(mixed["eval_loss"]))
    assert mixed == pytest.approx(alone)


def test_task_scores_skip_rows_that_cannot_make_a_prompt_and_count_them(debug_model, tokenizer, caplog):
    task = TaskFormat("summarization", max_length=96)
    rows = [
        {"document": "first document", "summary": "one"},
        {"document": None, "summary": "two"},
        {"document": "third document", "summary": "three"},
    ]
    settings = GenerationSettings(max_new_tokens=2)
    selected = evaluation_rows(rows, task, tokenizer, settings.max_new_tokens, max_examples=None)
    scores = task_scores(debug_model, tokenizer, selected, task, settings, batch_size=2)
    assert scores["examples"] == 2 and scores["skipped_rows"] == 1
    assert "skipping row 1: 'document'" in caplog.text
    assert [s["reference"] for s in scores["samples"]] == ["one", "three"]


@pytest.mark.slow
def test_the_script_ends_with_one_line_naming_the_bad_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"ok then \xff\xfe")
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "evaluate.py"),
            "--model",
            "debug",
            "--perplexity",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TNLG_TRACEBACK": "0"},
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"error: {path} is not UTF-8 text: byte offset 8" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_preset_model_prints_its_results_and_says_they_are_not_saved(tmp_path, capsys, caplog):
    from scripts.evaluate import main

    text = tmp_path / "notes.md"
    text.write_text("Some notes to score. " * 4)
    results = main(["--model", "debug", "--perplexity", str(text), "--max-length", "128"])
    assert results["perplexity:notes.md"]["tokens"] == len(text.read_bytes())
    assert "perplexity:notes.md" in capsys.readouterr().out
    assert "not saved: --model debug is a preset name" in caplog.text


def test_a_damaged_results_file_stops_the_script_before_evaluating(tmp_path):
    from scripts.evaluate import main

    (tmp_path / "eval_results.json").write_text('{"perplexity:a.txt": {"tokens"')
    with pytest.raises(
        ValueError, match=r"eval_results.json is damaged: its earlier results are not valid JSON"
    ):
        main(["--model", str(tmp_path), "--perplexity", str(tmp_path / "never-read.txt")])
