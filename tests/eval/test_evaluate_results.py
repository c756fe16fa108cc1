"""scripts/evaluate.py reads every input before the model loads, keeps results measured on other data
(another file, split, example count or lm-eval setting) rather than replacing them, and a task's loss
and generated scores cover the same rows."""

from __future__ import annotations

import json

import pytest

import scripts.evaluate as evaluate_script
from tests.support.finetune_cases import save_base_model, write_summaries
from tnlg.data.tasks import TaskFormat, encode_example
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.eval.suite import evaluate_task
from tnlg.eval.tasks import target_loss
from tnlg.inference.settings import GenerationSettings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def task_config(path, validation, **evaluation) -> str:
    settings = {"max_examples": 2, "batch_size": 2, "generation": {"max_new_tokens": 2}} | evaluation
    path.write_text(
        "task: {kind: summarization, columns: {document: article, summary: highlights}, max_length: 160}\n"
        f"data: {{paths: [{validation}], validation_paths: [{validation}]}}\n"
        f"evaluation: {json.dumps(settings)}\n"
    )
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: what is checked here must be checked before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(evaluate_script, "load_for_evaluation", refuse)


def test_a_bad_later_input_stops_the_script_before_the_model_loads(tmp_path, no_model):
    pytest.importorskip("datasets", reason="needs the datasets package")
    text = tmp_path / "text.txt"
    text.write_text("The library opens at nine. " * 20)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(json.dumps({"text": "alone"}) + "\n")
    base = ["--model", str(tmp_path), "--perplexity", str(text), "--max-length", "64"]
    with pytest.raises(ValueError, match=rf"{lambada} row 0: passage has no context"):
        evaluate_script.main([*base, "--lambada", str(lambada)])
    with pytest.raises(FileNotFoundError, match=r"no file at|no data files match"):
        evaluate_script.main([*base, "--lambada", str(tmp_path / "missing.jsonl")])
    config = task_config(tmp_path / "task.yaml", tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"no data files match \[.*nope.jsonl"):
        evaluate_script.main([*base, "--config", config])
    assert not (tmp_path / "eval_results.json").exists()


def test_split_of_a_files_config_is_refused(tmp_path, no_model):
    config = task_config(tmp_path / "task.yaml", write_summaries(tmp_path / "validation.jsonl"))
    with pytest.raises(ValueError, match=r"--split test: the config's data are files .* no splits"):
        evaluate_script.main(["--model", str(tmp_path), "--config", config, "--split", "test"])


def test_a_task_result_on_other_data_is_kept_not_replaced(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="needs the datasets package")
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    model = save_base_model(tmp_path / "model")
    first = task_config(tmp_path / "first.yaml", write_summaries(tmp_path / "validation.jsonl"))
    evaluate_script.main(["--model", str(model), "--config", first])
    saved = json.loads((model / "eval_results.json").read_text())
    entry = saved["task:summarization"]
    assert entry["measured_on"] == {
        "source": [str((tmp_path / "validation.jsonl").resolve())],
        "split": "validation",
        "max_examples": 2,
    }
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"article": "another document entirely", "highlights": "another"}) + "\n")
    for config, flags in [
        (task_config(tmp_path / "second.yaml", other), []),  # another validation file
        (first, ["--max-examples", "1"]),  # fewer examples of the same file
    ]:
        with pytest.raises(ValueError, match="already holds task:summarization measured on"):
            evaluate_script.main(["--model", str(model), "--config", config, *flags])
        assert json.loads((model / "eval_results.json").read_text()) == saved  # kept whole
    evaluate_script.main(["--model", str(model), "--config", first])  # the same data: replaced
    assert json.loads((model / "eval_results.json").read_text()).keys() == saved.keys()


def test_a_split_is_saved_under_its_own_name(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="needs the datasets package")
    monkeypatch.setenv("TNLG_CACHE", str(tmp_path / "cache"))
    model = save_base_model(tmp_path / "model")
    config = tmp_path / "qa.yaml"
    config.write_text(
        "task: {kind: extractive_qa, columns: {answer: answers}, max_length: 128, truncation_side: left}\n"
        "data: {dataset: 'embedded:qa', validation_split: validation}\n"
        "evaluation: {max_examples: 2, batch_size: 2, generation: {max_new_tokens: 2}}\n"
    )
    evaluate_script.main(["--model", str(model), "--config", str(config)])
    evaluate_script.main(["--model", str(model), "--config", str(config), "--split", "train"])
    saved = json.loads((model / "eval_results.json").read_text())
    assert saved["task:extractive_qa"]["split"] == "validation"
    assert saved["task:extractive_qa:train"]["split"] == "train"
    assert saved["task:extractive_qa:train"]["measured_on"]["source"] == "embedded:qa:train"


def test_an_lm_eval_result_with_other_settings_is_kept(tmp_path, no_model):
    pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_task.yaml").write_text(
        "task: local_task\ndataset_path: json\ndataset_kwargs: {data_files: {test: none.jsonl}}\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{text}}'\ndoc_to_target: ' x'\n"
    )
    earlier = {"lm-eval:local_task": {"acc": 0.5, "measured_on": {"num_fewshot": None, "limit": 5}}}
    (tmp_path / "eval_results.json").write_text(json.dumps(earlier))
    harness = [
        "--model",
        str(tmp_path),
        "--harness",
        "lm-eval",
        "--tasks",
        "local_task",
        "--include-path",
        str(tasks),
    ]
    for flags in (["--limit", "3"], ["--limit", "5", "--num-fewshot", "2"]):
        with pytest.raises(ValueError, match="already holds lm-eval:local_task measured on"):
            evaluate_script.main([*harness, *flags])
    assert json.loads((tmp_path / "eval_results.json").read_text()) == earlier


def test_the_loss_and_the_scores_of_a_task_cover_the_same_rows(debug_model):
    tokenizer = byte_level_tokenizer()
    task = TaskFormat("summarization", max_length=48)
    rows = [
        {"document": "the first document", "summary": "first"},
        {
            "document": "short",
            "summary": "a summary far too long to fit the forty-eight tokens of an example",
        },
        {"document": "the third document", "summary": "third"},
    ]  # row 1 makes a prompt (its target is not in it) but no example
    settings = GenerationSettings(max_new_tokens=2)
    result = evaluate_task(debug_model, tokenizer, rows, task, settings, batch_size=2, max_examples=2)
    assert [sample["reference"] for sample in result["samples"]] == ["first", "third"]
    assert result["examples"] == 2 and result["skipped_rows"] == 1
    examples = [encode_example(rows[i], task, tokenizer) for i in (0, 2)]
    assert result["eval_loss"] == pytest.approx(target_loss(debug_model, examples, 2, 256)["eval_loss"])
