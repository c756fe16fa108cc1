"""scripts/evaluate.py: a flag nothing reads, a 0 that would mean "the default", or two results under
one name are refused before the model loads; eval_results.json is replaced whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.evaluate import main, parse_arguments
from tnlg.eval.suite import save_results
from tnlg.inference.generation import load_tokenizer_for
from tnlg.modeling import TNLGConfig, TNLGForCausalLM


def refusal(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--perplexity", "a.txt", "--max-length", "0"], "--max-length 0"),
        (["--perplexity", "a.txt", "--max-length", "1"], "--max-length 1"),
        (["--perplexity", "a.txt", "--stride", "0"], "--stride 0"),
        (["--perplexity", "a.txt", "--max-length", "8", "--stride", "9"], "--stride 9"),
        (["--lambada", "l.jsonl", "--max-length", "64"], "--max-length: only with --perplexity"),
        (["--lambada", "l.jsonl", "--stride", "64"], "--stride: only with --perplexity"),
        (["--perplexity", "a.txt", "--batch-size", "8"], "--batch-size: only with --harness"),
        (["--config", "c.yaml", "--batch-size", "8"], "--batch-size: only with --harness"),
        (["--config", "c.yaml", "--max-examples", "0"], "--max-examples 0"),
        (["--perplexity", "a.txt", "--max-examples", "5"], "--max-examples: only with --config"),
        (["--perplexity", "a.txt", "--split", "test"], "--split: only with --config"),
        (["--config", "c.yaml", "--text-field", "body"], "--text-field: only with --perplexity or --lambada"),
    ],
)
def test_flags_nothing_reads_and_zero_sizes_are_refused(flags, named, capsys):
    assert named in refusal(["--model", "debug", *flags], capsys)


def _bf16_config(tmp_path: Path) -> str:
    path = tmp_path / "deepspeed.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    return str(path)


def test_a_dtype_the_zero_config_disagrees_with_is_refused(tmp_path, capsys):
    config = _bf16_config(tmp_path)
    error = refusal(
        ["--model", "debug", "--perplexity", "a.txt", "--zero-config", config, "--dtype", "float32"], capsys
    )
    assert f"--dtype float32 conflicts with --zero-config {config}, which enables bf16" in error


def test_the_zero_configs_precision_is_kept_without_a_dtype(tmp_path, monkeypatch):
    # --dtype defaulted to float32 and load_sharded_model computed a bf16 config's model in float32
    import scripts.evaluate as script

    class Loaded(Exception):
        pass

    def load(model_dir, sharding, dtype):
        raise Loaded(sharding.stage, sharding.mixed_precision, dtype)

    monkeypatch.setattr(script, "load_for_evaluation", load)
    (tmp_path / "a.txt").write_text("some text to score")
    argv = [
        "--model",
        str(tmp_path),
        "--perplexity",
        str(tmp_path / "a.txt"),
        "--zero-config",
        _bf16_config(tmp_path),
    ]
    with pytest.raises(Loaded) as loaded:
        main(argv)
    assert loaded.value.args == (3, "bf16", None)  # the config's stage and precision, settled once


def test_two_perplexity_files_of_one_name_are_refused(tmp_path, capsys):
    first, second = tmp_path / "a" / "notes.txt", tmp_path / "b" / "notes.txt"
    error = refusal(["--model", "debug", "--perplexity", str(first), "--perplexity", str(second)], capsys)
    assert "notes.txt" in error


def test_an_earlier_result_of_another_file_of_the_same_name_is_kept(tmp_path):
    earlier = {"perplexity:notes.txt": {"source": str(tmp_path / "old" / "notes.txt"), "perplexity": 3.0}}
    (tmp_path / "eval_results.json").write_text(json.dumps(earlier))
    with pytest.raises(ValueError, match="a different file than"):
        main(["--model", str(tmp_path), "--perplexity", str(tmp_path / "new" / "notes.txt")])
    assert json.loads((tmp_path / "eval_results.json").read_text()) == earlier


def test_an_earlier_perplexity_of_another_window_is_kept(tmp_path, monkeypatch):
    # the same text scored with another window is another figure: it was replaced without a word
    import scripts.evaluate as script

    text = tmp_path / "notes.txt"
    text.write_text("some text to score")
    earlier = {
        "perplexity:notes.txt": {"source": str(text), "max_length": 64, "stride": 64, "perplexity": 3.0}
    }
    (tmp_path / "eval_results.json").write_text(json.dumps(earlier))
    with pytest.raises(
        ValueError,
        match=r"measured with max_length 64 / stride 64, not max_length 32 / stride 32 as this run",
    ):
        main(["--model", str(tmp_path), "--perplexity", str(text), "--max-length", "32"])
    assert json.loads((tmp_path / "eval_results.json").read_text()) == earlier

    class Loaded(Exception):
        pass

    def load(*args):
        raise Loaded

    monkeypatch.setattr(script, "load_for_evaluation", load)
    with pytest.raises(Loaded):  # the same window, or the model's own positions (64 here): on to the model
        main(["--model", str(tmp_path), "--perplexity", str(text), "--max-length", "64"])
    TNLGConfig.from_preset("debug", max_position_embeddings=64).save_pretrained(tmp_path)
    with pytest.raises(Loaded):
        main(["--model", str(tmp_path), "--perplexity", str(text)])


def test_an_interrupted_save_keeps_the_earlier_results(tmp_path, monkeypatch):
    target = tmp_path / "eval_results.json"
    target.write_text(json.dumps({"perplexity:a.txt": {"perplexity": 3.0}}))
    real_write_text = Path.write_text

    def interrupted_write_text(self, text, *args, **kwargs):
        real_write_text(self, text[:10], *args, **kwargs)
        raise OSError("no space left on device")

    monkeypatch.setattr(Path, "write_text", interrupted_write_text)
    with pytest.raises(OSError, match="no space left"):
        save_results(target, {"perplexity:b.txt": {"perplexity": 4.0}})
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"perplexity:a.txt": {"perplexity": 3.0}}
    assert [path.name for path in tmp_path.iterdir()] == ["eval_results.json"]


def test_an_earlier_result_of_another_column_is_kept(tmp_path):
    # --text-field b replaced the perplexity of column a of the same file without a word
    rows = tmp_path / "two.jsonl"
    rows.write_text('{"a": "first column", "b": "second column"}\n')
    earlier = {
        "perplexity:two.jsonl": {
            "source": str(rows), "max_length": 64, "stride": 64, "text_field": "a", "perplexity": 3.0,
        },
        "lambada:two.jsonl": {"source": str(rows), "text_field": "a", "accuracy": 0.5},
    }  # fmt: skip
    (tmp_path / "eval_results.json").write_text(json.dumps(earlier))
    for measure in (["--perplexity", str(rows), "--max-length", "64"], ["--lambada", str(rows)]):
        with pytest.raises(ValueError, match=r"measured with .*text_field 'a', not .*text_field 'b'"):
            main(["--model", str(tmp_path), *measure, "--text-field", "b"])
    assert json.loads((tmp_path / "eval_results.json").read_text()) == earlier


def test_a_result_names_its_file_resolved_so_another_directory_compares_the_file(tmp_path, monkeypatch):
    # the relative name was saved as typed: a later run elsewhere took another file of that name as the
    # same one (and replaced its figure), and the same file reached another way as a different one
    from tnlg.eval.suite import score_perplexity

    text = tmp_path / "x" / "text.txt"
    text.parent.mkdir()
    text.write_text("some text to score")
    monkeypatch.chdir(tmp_path / "x")
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug")).eval()
    tokenizer = load_tokenizer_for("debug", "byte-level")
    ids = tokenizer(text.read_text())["input_ids"]
    result = score_perplexity(
        model, tokenizer, text.read_text(), ids, Path("text.txt"), max_length=16, stride=None
    )
    assert result["source"] == str(text.resolve())
    (tmp_path / "eval_results.json").write_text(json.dumps({"perplexity:text.txt": result}))
    other = tmp_path / "y" / "text.txt"
    other.parent.mkdir()
    other.write_text("another text")
    monkeypatch.chdir(tmp_path / "y")
    with pytest.raises(ValueError, match="a different file than"):
        main(["--model", str(tmp_path), "--perplexity", "text.txt"])


@pytest.mark.parametrize("model", ["directory", "debug"])
def test_a_window_past_the_models_positions_is_refused_before_it_loads(tmp_path, model):
    # it failed at the first forward, naming a sequence length, after the files before it were scored
    text = tmp_path / "notes.txt"
    text.write_text("some text to score")
    if model == "directory":
        TNLGConfig.from_preset("debug", max_position_embeddings=64).save_pretrained(tmp_path)
        model, positions = str(tmp_path), 64
    else:
        positions = TNLGConfig.from_preset("debug").max_position_embeddings
    with pytest.raises(
        ValueError, match=rf"--max-length {positions + 1} exceeds the model's {positions} positions"
    ):
        main(["--model", model, "--perplexity", str(text), "--max-length", str(positions + 1)])
