"""scripts/evaluate.py records in every entry of eval_results.json the dtype its forward passes computed
in, and keeps a result computed in another dtype rather than replacing it: an fp32 perplexity was
silently replaced by a bf16 one of the same file and window, and nobody reading the file could tell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scripts.evaluate as evaluate_script
from tests.support.finetune_cases import save_base_model, write_summaries
from tests.support.lm_eval_tasks import TASK_YAML

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TEXT = "The library opens at nine and closes at five on every weekday. " * 4
PASSAGES = [f"one two three {word} four {word}" for word in "abc"]
TASK_NAME = "task:summarization"


@pytest.fixture
def run(tmp_path, monkeypatch):
    """(model directory, the flags measuring its perplexity, LAMBADA and summarization task, and the
    dtype names the loaded models computed in), every load recorded."""
    pytest.importorskip("datasets", reason="needs the datasets package")
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    model = save_base_model(tmp_path / "model")
    text = tmp_path / "notes.txt"
    text.write_text(TEXT)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": passage}) + "\n" for passage in PASSAGES))
    summaries = write_summaries(tmp_path / "validation.jsonl")
    config = tmp_path / "task.yaml"
    config.write_text(
        "task: {kind: summarization, columns: {document: article, summary: highlights}, max_length: 160}\n"
        f"data: {{paths: [{summaries}], validation_paths: [{summaries}]}}\n"
        "evaluation: {max_examples: 2, batch_size: 2, generation: {max_new_tokens: 2}}\n"
    )
    flags = {
        "perplexity:notes.txt": ["--perplexity", str(text), "--max-length", "64"],
        "lambada:lambada.jsonl": ["--lambada", str(lambada)],
        TASK_NAME: ["--config", str(config)],
    }
    loaded: list[str] = []
    real_load = evaluate_script.load_for_evaluation

    def recording_load(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)
        # the dtype the forward passes use: a ZeRO engine's compute dtype, a whole model's parameters'
        dtype = getattr(model, "compute_dtype", None) or next(model.parameters()).dtype
        loaded.append(str(dtype).removeprefix("torch."))
        return model, tokenizer

    monkeypatch.setattr(evaluate_script, "load_for_evaluation", recording_load)
    return model, flags, loaded


def every_kind(flags: dict[str, list[str]]) -> list[str]:
    return [flag for measure in flags.values() for flag in measure]


def bf16_zero_config(directory: Path) -> str:
    path = directory / "bf16.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}))
    return str(path)


@pytest.mark.parametrize("precision", ["default", "--dtype bfloat16", "--zero-config bf16"])
def test_every_entry_records_the_dtype_its_forward_passes_computed_in(run, precision):
    model, flags, loaded = run
    extra, expected = {
        "default": ([], "float32"),
        "--dtype bfloat16": (["--dtype", "bfloat16"], "bfloat16"),
        "--zero-config bf16": (["--zero-config", bf16_zero_config(model.parent)], "bfloat16"),
    }[precision]
    evaluate_script.main(["--model", str(model), *every_kind(flags), *extra])
    saved = json.loads((model / "eval_results.json").read_text())
    assert loaded == [expected]  # the dtype recorded is the one the model was loaded in
    assert {name: entry["dtype"] for name, entry in saved.items()} == dict.fromkeys(flags, expected)


@pytest.mark.parametrize("name", ["perplexity:notes.txt", "lambada:lambada.jsonl", TASK_NAME])
def test_a_result_computed_in_float32_is_kept_from_a_bf16_run(run, name):
    model, flags, loaded = run
    evaluate_script.main(["--model", str(model), *every_kind(flags)])
    before = (model / "eval_results.json").read_bytes()
    for extra in (["--dtype", "bfloat16"], ["--zero-config", bf16_zero_config(model.parent)]):
        with pytest.raises(
            ValueError,
            match=rf"already holds {name} computed in float32, not in bfloat16 as this run would: saving "
            "would replace it; move the earlier results away",
        ):
            evaluate_script.main(["--model", str(model), *flags[name], *extra])
        assert (model / "eval_results.json").read_bytes() == before  # kept byte for byte
    assert loaded == ["float32"]  # refused before the model loaded


def test_an_entry_without_a_dtype_is_replaced_as_before(run):
    # written by a tnlg that recorded no dtype: nothing to compare, so it is replaced
    model, flags, _ = run
    evaluate_script.main(["--model", str(model), *every_kind(flags)])
    target = model / "eval_results.json"
    older = {
        name: {k: v for k, v in entry.items() if k != "dtype"}
        for name, entry in json.loads(target.read_text()).items()
    }
    target.write_text(json.dumps(older))
    evaluate_script.main(["--model", str(model), *every_kind(flags), "--dtype", "bfloat16"])
    saved = json.loads(target.read_text())
    assert {name: entry["dtype"] for name, entry in saved.items()} == dict.fromkeys(flags, "bfloat16")


def test_a_result_of_the_same_dtype_is_replaced(run):
    model, flags, _ = run
    measure = ["--model", str(model), *flags["perplexity:notes.txt"], "--dtype", "bfloat16"]
    evaluate_script.main(measure)
    target = model / "eval_results.json"
    measured = json.loads(target.read_text())["perplexity:notes.txt"]
    assert measured["dtype"] == "bfloat16"
    target.write_text(json.dumps({"perplexity:notes.txt": measured | {"perplexity": 1.0}}))
    evaluate_script.main(measure)
    assert json.loads(target.read_text())["perplexity:notes.txt"] == measured  # measured again, replaced


@pytest.mark.slow  # lm-eval's task index and two harness runs: about 17 s
def test_an_lm_eval_result_records_its_dtype_and_is_kept_from_another(run, tmp_path):
    pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness")
    model, flags, loaded = run
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    lambada = flags["lambada:lambada.jsonl"][1]
    (tasks / "local_task.yaml").write_text(
        TASK_YAML.format(task="local_task", data=lambada, cache=tmp_path / "lm-cache")
    )
    (tasks / "local_group.yaml").write_text("group: local_group\ntask: [local_task]\n")
    harness = ["--model", str(model), "--harness", "lm-eval", "--include-path", str(tasks)]
    evaluate_script.main([*harness, "--tasks", "local_task", "--dtype", "bfloat16"])
    target = model / "eval_results.json"
    assert json.loads(target.read_text())["lm-eval:local_task"]["dtype"] == "bfloat16"
    before = target.read_bytes()
    message = "already holds lm-eval:local_task computed in bfloat16, not in float32 as this run would"
    with pytest.raises(ValueError, match=message):  # named: refused before the model loads
        evaluate_script.main([*harness, "--tasks", "local_task"])
    assert loaded == ["bfloat16"] and target.read_bytes() == before
    # a group names its tasks only once lm-eval has run them: refused then, before anything is written
    with pytest.raises(ValueError, match=message):
        evaluate_script.main([*harness, "--tasks", "local_group"])
    assert loaded == ["bfloat16", "float32"] and target.read_bytes() == before
