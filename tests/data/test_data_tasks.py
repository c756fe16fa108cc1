"""Fine-tuning examples: column mappings, prompt templates, loss only on target tokens (checked token by
token), truncation of the long field from either side and never of the target, dynamic padding."""

from __future__ import annotations

import pytest
import torch

from tnlg.data.tasks import IGNORE_INDEX, TaskFormat, encode_example, encode_prompt, pad_batch, row_fields
from tnlg.data.tokenizer import byte_level_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()  # one token per byte: lengths below are byte counts


def decode(tokenizer, ids):
    return tokenizer.decode([i for i in ids if i != IGNORE_INDEX])


def test_summarization_puts_loss_on_the_summary_and_eos_only(tokenizer):
    task = TaskFormat("summarization", columns={"document": "article", "summary": "highlights"})  # CNN/DM
    example = encode_example({"article": "Cats sleep a lot.", "highlights": "Cats nap."}, task, tokenizer)
    prompt = "Cats sleep a lot.\n\nTL;DR:"
    assert decode(tokenizer, example["input_ids"]) == prompt + " Cats nap.<|endoftext|>"
    assert example["labels"][: len(prompt)] == [IGNORE_INDEX] * len(prompt)  # no loss on any prompt token
    assert example["labels"][len(prompt) :] == example["input_ids"][len(prompt) :]
    assert decode(tokenizer, example["labels"]) == " Cats nap.<|endoftext|>"


def test_squad_rows_train_on_the_first_answer_and_keep_all_as_references(tokenizer):
    task = TaskFormat("extractive_qa", columns={"answer": "answers"})
    row = {"context": "Paris is in France.", "question": "Where is Paris?", "answers": {"text": ["France", "in France"], "answer_start": [12, 9]}}  # fmt: skip
    assert row_fields(row, task)["references"] == ["France", "in France"]
    example = encode_example(row, task, tokenizer)
    assert decode(tokenizer, example["input_ids"]).startswith(
        "Paris is in France.\n\nQuestion: Where is Paris?"
    )
    assert decode(tokenizer, example["labels"]) == " France<|endoftext|>"


def test_generative_qa_with_and_without_context(tokenizer):
    task = TaskFormat("generative_qa", add_eos=False)
    plain = encode_example({"question": "2+2?", "answer": "4"}, task, tokenizer)
    assert decode(tokenizer, plain["input_ids"]) == "Question: 2+2?\nAnswer: 4"
    with_context = encode_example(
        {"question": "2+2?", "answer": "4", "context": "Arithmetic."}, task, tokenizer
    )
    assert decode(tokenizer, with_context["input_ids"]) == "Arithmetic.\n\nQuestion: 2+2?\nAnswer: 4"
    assert decode(tokenizer, with_context["labels"]) == " 4"


@pytest.mark.parametrize("side, kept", [("right", "0123456789"), ("left", "KLMNOPQRST")])
def test_the_long_field_is_cut_from_its_side_and_the_target_never(tokenizer, side, kept):
    document = "0123456789ABCDEFGHIJKLMNOPQRST"
    task = TaskFormat(
        "summarization", max_length=len("\n\nTL;DR:") + 10 + len(" sum") + 1, truncation_side=side
    )
    example = encode_example({"document": document, "summary": "sum"}, task, tokenizer)
    assert len(example["input_ids"]) == task.max_length
    assert decode(tokenizer, example["input_ids"]) == kept + "\n\nTL;DR: sum<|endoftext|>"
    too_short = TaskFormat("summarization", max_length=10)
    with pytest.raises(ValueError, match="the target is never truncated"):
        encode_example({"document": document, "summary": "a long summary"}, too_short, tokenizer)


def test_prompts_for_generation_leave_room_for_new_tokens(tokenizer):
    task = TaskFormat("summarization", max_length=30)
    encoded = encode_prompt({"document": "x" * 100, "summary": "y"}, task, tokenizer, max_new_tokens=8)
    assert len(encoded["input_ids"]) == 30 - 8
    assert decode(tokenizer, encoded["input_ids"]).endswith("\n\nTL;DR:")
    assert encoded["references"] == ["y"]


def test_bad_formats_and_rows_are_named(tokenizer):
    with pytest.raises(ValueError, match="task kind must be one of"):
        TaskFormat("translation")
    with pytest.raises(ValueError, match="unknown fields"):
        TaskFormat("summarization", columns={"article": "text"})
    with pytest.raises(KeyError, match="no column 'highlights'"):
        encode_example(
            {"document": "d"}, TaskFormat("summarization", columns={"summary": "highlights"}), tokenizer
        )


def test_dynamic_padding_masks_pads(tokenizer):
    examples = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}]
    batch = pad_batch(examples, pad_token_id=256)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 256, 256]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
