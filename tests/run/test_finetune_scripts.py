"""The fine-tuning and evaluation scripts for real: `accelerate launch` with 2 processes fine-tunes on
the embedded docstring set and resumes; scripts/evaluate.py scores a checkpoint in one process and,
sharded at ZeRO stage 3, on 2 processes with the same results, written next to the checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.finetune_cases import save_base_model, write_summaries

pytestmark = [
    pytest.mark.slow,  # every test here launches processes (see pyproject's markers)
    # a mark, so that no base model is built for nothing: both scripts read their data through datasets
    pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs the datasets package"),
]

SPREAD = {1: ["--cpu", "--num_processes", "1"], 2: ["--multi_gpu", "--num_processes", "2"]}


def launch(script: str, arguments: list[str], cache: Path, processes: int = 2) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", *SPREAD[processes], "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "scripts" / script), *arguments,
    ]  # fmt: skip
    environment = {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("base"))


def test_the_summarization_config_fine_tunes_on_the_docstring_set_and_resumes(base, cache, tmp_path):
    config = REPO / "configs" / "finetune" / "summarization.yaml"
    common = [
        "--config", str(config), "--model.init_from", str(base), "--task.max_length", "192",
        "--train.max_steps", "4", "--train.save_every", "2", "--train.keep_last", "2", "--train.eval_every", "2",
        "--train.micro_batch_size", "2", "--evaluation.max_examples", "4", "--evaluation.batch_size", "2",
        "--evaluation.generation.max_new_tokens", "4", "--logging.trackers", "[]",
    ]  # fmt: skip
    launch("finetune.py", [*common, "--train.output_dir", str(tmp_path / "a")], cache)
    evaluation = json.loads((tmp_path / "a" / "evaluation.json").read_text())
    assert evaluation["after"]["examples"] == 4 and "rougeL" in evaluation["before"]
    first = json.loads((tmp_path / "a" / "loss_curve.json").read_text())["losses"]
    assert (tmp_path / "a" / "model" / "tokenizer.json").is_file()

    # stopped after step 2 (its checkpoint copied out), then resumed: the same losses
    resumed = [*common, "--train.output_dir", str(tmp_path / "b"), "--evaluation.after_training", "false"]
    launch(
        "finetune.py", [*resumed, "--resume", str(tmp_path / "a" / "checkpoints" / "step-00000002")], cache
    )
    second = json.loads((tmp_path / "b" / "loss_curve.json").read_text())["losses"]
    assert second == pytest.approx(first, rel=1e-6)  # the whole curve: steps 1-2 from the checkpoint


def test_evaluate_scores_a_checkpoint_alike_in_one_process_and_sharded_on_two(base, cache, tmp_path):
    summaries = write_summaries(tmp_path / "summaries.jsonl")
    config = tmp_path / "task.yaml"
    config.write_text(
        "task: {kind: summarization, columns: {document: article, summary: highlights}, max_length: 160}\n"
        f"data: {{paths: [{summaries}], validation_paths: [{summaries}]}}\n"
        "evaluation: {max_examples: 5, batch_size: 2, generation: {max_new_tokens: 6}}\n"
    )
    text = tmp_path / "text.txt"
    text.write_text("The library opens at nine. " * 40)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": f"one two three {w} four {w}"}) + "\n" for w in "abcde"))
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"stage": 3, "param_persistence_threshold": 0}))  # every parameter sharded
    arguments = [
        "--model", str(base), "--config", str(config), "--perplexity", str(text), "--stride", "64",
        "--max-length", "128", "--lambada", str(lambada),
    ]  # fmt: skip
    single = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "evaluate.py"), *arguments],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "TNLG_CACHE": str(cache)},
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    assert "bits_per_byte" in single.stdout and "written to" in single.stdout  # the table, then where
    one = json.loads((base / "eval_results.json").read_text())
    (base / "eval_results.json").unlink()
    launch("evaluate.py", [*arguments, "--zero-config", str(zero)], cache)
    two = json.loads((base / "eval_results.json").read_text())
    assert set(one) == {"perplexity:text.txt", "lambada:lambada.jsonl", "task:summarization"}
    for name in one:
        for metric, value in one[name].items():
            if isinstance(value, float):
                assert two[name][metric] == pytest.approx(value, rel=1e-5), (name, metric)
            else:
                assert two[name][metric] == value, (name, metric)
    assert one["lambada:lambada.jsonl"]["total"] == 5
    assert one["perplexity:text.txt"]["tokens"] == len(text.read_text().encode())  # byte-level: each byte
