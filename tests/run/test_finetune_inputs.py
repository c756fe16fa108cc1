"""A fine-tuning run checks its evaluation inputs with its tokenizer before the first step: validation
rows that cannot make a generation prompt stop it then, not after training."""

from __future__ import annotations

import pytest

from tests.support.finetune_cases import write_summaries
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.run.finetune import TaskExamples
from tnlg.run.finetune_config import load_finetune_config


def test_validation_rows_without_room_for_a_prompt_stop_the_run_before_training(tmp_path):
    pytest.importorskip("datasets", reason="needs the datasets package")
    rows = write_summaries(tmp_path / "rows.jsonl")
    config = load_finetune_config(
        None,
        [
            "--task.kind", "summarization", "--task.columns", "{document: article, summary: highlights}",
            "--task.max_length", "64", "--data.paths", f"[{rows}]", "--data.validation_paths", f"[{rows}]",
            # 4 tokens left for a prompt: "\n\nTL;DR:" alone is 8
            "--evaluation.generation.max_new_tokens", "60",
        ],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"evaluation: no rows to evaluate \(8 rows, 8 of them unusable"):
        TaskExamples(config).batches(byte_level_tokenizer(), 0, 1)
    config.evaluation.after_training = False  # no generation: nothing to check
    assert TaskExamples(config).batches(byte_level_tokenizer(), 0, 1) is not None


def test_a_used_output_directory_is_refused_before_the_data_is_read(tmp_path):
    # the validation rows were read first (here: a missing file named), then the output directory refused
    from tnlg.run.finetune import finetune

    (tmp_path / "run" / "model").mkdir(parents=True)
    absent = tmp_path / "absent.jsonl"
    overrides = ["--data.paths", f"[{absent}]", "--data.validation_paths", f"[{absent}]"]
    config = load_finetune_config(None, ["--train.output_dir", str(tmp_path / "run"), *overrides])
    with pytest.raises(FileExistsError, match=r"train.output_dir .*run already holds a run \(model\)"):
        finetune(config)
