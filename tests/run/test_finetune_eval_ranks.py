"""Fine-tuning evaluation under tensor slicing: the ranks of one replica share their examples, and
sample from one stream, so the figures equal those of one process (see [Note: evaluation by data rank]
and [Note: one stream per replica] in tnlg.inference.ranks)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.support.finetune_cases import save_base_model, write_summaries
from tnlg.tools.spawn import run_distributed

pytestmark = [
    pytest.mark.slow,  # launches processes
    pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs the datasets package"),
]


SEED = 11  # rank r seeds SEED + r, as a resumed run reseeds by rank: only a shared stream agrees


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
    torch.manual_seed(SEED + rank)
    try:
        periodic = examples.evaluate(run.engine, run.tokenizer, run.accelerator)
        final = examples.final_evaluation(run.engine, run.tokenizer, run.accelerator)
    finally:
        run.engine.close()
    return {"periodic": periodic, "final": final}


SAMPLED = ["--evaluation.generation.do_sample", "true", "--evaluation.generation.temperature", "1.5",
           "--evaluation.generation.top_k", "0"]  # fmt: skip


@pytest.mark.parametrize("generation", [[], SAMPLED], ids=["greedy", "sampled"])
def test_tensor_sliced_evaluation_equals_one_process(cache, tmp_path, generation):
    base = save_base_model(tmp_path / "base")
    train = write_summaries(tmp_path / "train.jsonl")
    arguments = [
        "--model.init_from", str(base), "--task.columns", "{document: article, summary: highlights}",
        "--task.max_length", "160", "--data.paths", f"[{train}]", "--data.validation_paths", f"[{train}]",
        # 4 batches of 2: split by global rank, the two tensor ranks would feed different batches
        "--train.micro_batch_size", "2", "--train.eval_batches", "4", "--evaluation.max_examples", "8",
        "--evaluation.batch_size", "2", "--evaluation.generation.max_new_tokens", "4", *generation,
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
        for figure in ("eval_loss", "eval_perplexity"):
            assert result["final"][figure] == pytest.approx(alone["final"][figure], rel=1e-5)
        assert result["final"]["examples"] == alone["final"]["examples"] == 8
        # the generated text, and what it scores
        assert _generated(result["final"]) == _generated(alone["final"])


def _generated(final: dict) -> dict:
    return {key: value for key, value in final.items() if key not in ("eval_loss", "eval_perplexity")}
