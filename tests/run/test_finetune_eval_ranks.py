"""Fine-tuning evaluation under tensor slicing: the ranks of one replica share their examples, so the
figures equal those of one process (see [Note: evaluation by data rank] in tnlg.inference.ranks)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.support.finetune_cases import save_base_model, write_summaries
from tnlg.tools.spawn import run_distributed

pytestmark = [
    pytest.mark.slow,  # launches processes
    pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs the datasets package"),
]


def evaluate_untrained(rank: int, world_size: int, cache: str, overrides: list[str]) -> dict:
    """The periodic and the final evaluation of the starting model, on this rank."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.finetune import TaskExamples
    from tnlg.run.finetune_config import load_finetune_config
    from tnlg.run.loop import TrainingJob, build_run

    config = load_finetune_config(None, ["--logging.trackers", "[]", *overrides])
    examples = TaskExamples(config)
    job = TrainingJob(
        name="evaluation",
        seq_len=examples.task.max_length,
        tokenizer=config.data.tokenizer,
        batches=examples.batches,
    )
    run = build_run(config, job)
    try:
        periodic = examples.evaluate(run.engine, run.tokenizer, run.accelerator)
        final = examples.final_evaluation(run.engine, run.tokenizer, run.accelerator)
    finally:
        run.engine.close()
    return {"periodic": periodic, "final": final}


def test_tensor_sliced_evaluation_equals_one_process(cache, tmp_path):
    base = save_base_model(tmp_path / "base")
    train = write_summaries(tmp_path / "train.jsonl")
    arguments = [
        "--model.init_from", str(base), "--task.columns", "{document: article, summary: highlights}",
        "--task.max_length", "160", "--data.paths", f"[{train}]", "--data.validation_paths", f"[{train}]",
        # 4 batches of 2: split by global rank, the two tensor ranks would feed different batches
        "--train.micro_batch_size", "2", "--train.eval_batches", "4", "--evaluation.max_examples", "8",
        "--evaluation.batch_size", "2", "--evaluation.generation.max_new_tokens", "4",
    ]  # fmt: skip
    (alone,) = run_distributed(
        evaluate_untrained,
        1,
        str(cache),
        [*arguments, "--train.output_dir", str(tmp_path / "one")],
        timeout=400,
    )
    sliced = run_distributed(
        evaluate_untrained,
        2,
        str(cache),
        [*arguments, "--train.output_dir", str(tmp_path / "tensor"), "--parallel.tensor", "2"],
        timeout=400,
    )
    for result in sliced:
        assert result["periodic"]["eval_loss"] == pytest.approx(alone["periodic"]["eval_loss"], rel=1e-5)
        assert result["final"]["eval_loss"] == pytest.approx(alone["final"]["eval_loss"], rel=1e-5)
        assert result["final"]["examples"] == alone["final"]["examples"] == 8
        assert result["final"]["samples"] == alone["final"]["samples"]
