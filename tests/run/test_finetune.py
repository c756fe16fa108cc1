"""Fine-tuning on 2 ranks: every task format learns its training examples, through the ZeRO stages,
with LoRA, and a stopped run resumes with the same losses."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.support.finetune_cases import run_finetune, save_base_model, write_questions, write_summaries
from tnlg.tools.spawn import run_distributed

pytestmark = [
    pytest.mark.slow,  # every test here launches processes (see pyproject's markers)
    # a mark, so that no base model is built for nothing: fine-tuning reads its data through datasets
    pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs the datasets package"),
]

COMMON = [
    "--optimizer.lr", "3e-3", "--optimizer.warmup_steps", "2", "--optimizer.weight_decay", "0.0",
    "--train.micro_batch_size", "2", "--evaluation.batch_size", "4", "--evaluation.before_training", "true",
    "--evaluation.generation.max_new_tokens", "8", "--zero.gradient_clipping", "1.0",
]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base_model(tmp_path_factory.mktemp("base"))


def finetune(cache, base, output, *overrides, resume=None, steps=10):
    arguments = [
        *COMMON, "--model.init_from", str(base), "--train.output_dir", str(output),
        "--train.max_steps", str(steps), *overrides,
    ]  # fmt: skip
    return run_distributed(run_finetune, 2, str(cache), arguments, resume, timeout=400)


def summarization(path):
    train = write_summaries(path / "train.jsonl")
    return [
        "--task.kind", "summarization", "--task.columns", "{document: article, summary: highlights}",
        "--task.max_length", "160", "--data.paths", f"[{train}]", "--data.validation_paths", f"[{train}]",
    ]  # fmt: skip


def learned(result: dict, factor: float = 0.7) -> None:
    """The training examples' target loss fell, and the metric was computed before and after."""
    before, after = result["evaluation"]["before"], result["evaluation"]["after"]
    assert after["eval_loss"] < factor * before["eval_loss"], (before["eval_loss"], after["eval_loss"])
    assert result["losses"][-1] < result["losses"][0]


def test_summarization_from_cnn_dm_columns_at_stage_2(cache, base, tmp_path):
    results = finetune(cache, base, tmp_path / "run", *summarization(tmp_path), "--zero.stage", "2")
    learned(results[0])
    after = results[0]["evaluation"]["after"]
    assert set(after) >= {"rouge1", "rouge2", "rougeL", "examples", "samples"}
    assert after["examples"] == 8
    assert results[0]["evaluation"] == results[1]["evaluation"]  # gathered: every rank has all of it


def test_extractive_qa_on_the_embedded_fixture_packed_at_stage_3(cache, base, tmp_path):
    arguments = [
        "--task.kind", "extractive_qa", "--task.columns", "{answer: answers}", "--task.max_length", "256",
        "--task.truncation_side", "left", "--data.dataset", "embedded:qa", "--data.validation_split", "train",
        "--data.packing", "true", "--zero.stage", "3", "--evaluation.max_examples", "8",
    ]  # fmt: skip
    results = finetune(cache, base, tmp_path / "run", *arguments, steps=12)
    learned(results[0])
    assert set(results[0]["evaluation"]["after"]) >= {"exact_match", "f1"}


def test_generative_qa_from_csv_with_optional_context_at_stage_1(cache, base, tmp_path):
    train = write_questions(tmp_path / "train.csv")
    arguments = [
        "--task.kind", "generative_qa", "--task.max_length", "128", "--data.paths", f"[{train}]",
        "--data.validation_paths", f"[{train}]", "--zero.stage", "1",
    ]  # fmt: skip
    learned(finetune(cache, base, tmp_path / "run", *arguments)[0])


def test_lora_at_stage_3_trains_the_adapters_and_saves_them_merged(cache, base, tmp_path):
    from tnlg import TNLGForCausalLM
    from tnlg.data.finetune import encode_rows, load_rows
    from tnlg.data.tasks import TaskFormat, pad_batch
    from tnlg.data.tokenizer import byte_level_tokenizer

    arguments = [*summarization(tmp_path), "--lora.enabled", "true", "--lora.r", "4", "--zero.stage", "3",
                 "--zero.param_persistence_threshold", "0"]  # fmt: skip
    result = finetune(cache, base, tmp_path / "run", *arguments, "--optimizer.lr", "1e-2")[0]
    learned(result, factor=0.95)  # rank-4 adapters on a random model learn slower than full fine-tuning
    saved = tmp_path / "run" / "model"
    assert (saved / "adapter" / "adapter_config.json").is_file()
    merged, original = TNLGForCausalLM.from_pretrained(saved), TNLGForCausalLM.from_pretrained(base)
    changed = {n for n, p in merged.state_dict().items() if not torch.equal(p, original.state_dict()[n])}
    # the merged adapters change exactly the adapted projections' weights
    assert changed and all(
        n.endswith(("qkv_proj.weight", "out_proj.weight", "fc_in.weight", "fc_out.weight")) for n in changed
    ), sorted(changed)
    # and the merged checkpoint is the model the engine evaluated at the end of training
    task = TaskFormat(
        "summarization", columns={"document": "article", "summary": "highlights"}, max_length=160
    )
    tokenizer = byte_level_tokenizer()
    examples = encode_rows(load_rows(None, [str(tmp_path / "train.jsonl")], "train"), task, tokenizer)
    batch = pad_batch(examples, tokenizer.eos_token_id)
    with torch.no_grad():
        loss = merged.eval()(**batch).loss.item()
    assert loss == pytest.approx(result["evaluation"]["after"]["eval_loss"], rel=1e-4)


def test_a_stopped_run_resumes_with_the_same_losses(cache, base, tmp_path):
    arguments = [*summarization(tmp_path), "--zero.stage", "2", "--train.save_every", "3",
                 "--evaluation.after_training", "false"]  # fmt: skip
    whole = finetune(cache, base, tmp_path / "whole", *arguments, steps=6)[0]
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-00000003"
    resumed = finetune(cache, base, tmp_path / "resumed", *arguments, resume=str(checkpoint), steps=6)[0]
    assert resumed["losses"] == pytest.approx(whole["losses"], rel=1e-6)  # steps 1-3 from the checkpoint


def test_a_resumed_run_keeps_the_evaluation_before_training(cache, base, tmp_path):
    output = tmp_path / "run"
    arguments = [*summarization(tmp_path), "--train.save_every", "1", "--evaluation.max_examples", "2",
                 "--evaluation.generation.max_new_tokens", "2"]  # fmt: skip
    stopped = finetune(cache, base, output, *arguments, "--evaluation.after_training", "false", steps=1)[0]
    before = json.loads((output / "evaluation.json").read_text())["before"]
    assert before == stopped["evaluation"]["before"]
    checkpoint = output / "checkpoints" / "step-00000001"
    # the resume may change the precision: each evaluation says the dtype it was computed in
    resumed = finetune(
        cache, base, output, *arguments, "--train.mixed_precision", "bf16", resume=str(checkpoint), steps=2
    )[0]
    saved = json.loads((output / "evaluation.json").read_text())
    assert set(saved) == {"before", "after"} and saved["before"] == before  # measured by the first run
    assert resumed["evaluation"] == saved
    assert (saved["before"]["dtype"], saved["after"]["dtype"]) == ("float32", "bfloat16")
