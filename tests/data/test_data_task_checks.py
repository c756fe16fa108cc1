"""Task formats keep what an example needs or refuse it by name: an extractive-QA context is cut around
its answer (never cutting the answer out), a column mapped by name must exist, and a prompt template
that would show the target is refused when the format is read."""

from __future__ import annotations

import json

import pytest

from tnlg.data.embedded_tasks import qa_fixture_path
from tnlg.data.finetune import encode_rows
from tnlg.data.tasks import IGNORE_INDEX, BadExampleError, TaskFormat, encode_example, encode_prompt
from tnlg.data.tokenizer import byte_level_tokenizer

FILLER = "Words that say nothing about the question at all. " * 6  # 306 bytes


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()  # one token per byte: lengths below are byte counts


def prompt_of(tokenizer, example) -> str:
    return tokenizer.decode(
        [t for t, label in zip(example["input_ids"], example["labels"], strict=True) if label == IGNORE_INDEX]
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_truncated_qa_context_keeps_its_answer_from_either_side(tokenizer, side):
    # the answer is in the middle: cutting either end to the budget alone would lose it
    context = FILLER + "The capital of France is Paris. " + FILLER
    row = {"context": context, "question": "What is the capital of France?", "answer": "Paris"}
    task = TaskFormat("extractive_qa", max_length=160, truncation_side=side)
    example = encode_example(row, task, tokenizer)
    assert len(example["input_ids"]) == task.max_length  # the context still fills the budget
    assert "Paris" in prompt_of(tokenizer, example).split("\n\nQuestion:")[0]
    prompt = encode_prompt(row, task, tokenizer, max_new_tokens=16)  # generation keeps it too
    assert "Paris" in tokenizer.decode(prompt["input_ids"]).split("\n\nQuestion:")[0]


def test_the_window_holds_the_answer_at_answer_start_not_an_earlier_mention(tokenizer):
    context = "Paris is mentioned first. " + FILLER + "Here Paris is the answer."
    start = context.index("Here Paris") + len("Here ")
    row = {
        "context": context,
        "question": "Which city?",
        "answers": {"text": ["Paris"], "answer_start": [start]},
    }
    task = TaskFormat("extractive_qa", columns={"answer": "answers"}, max_length=120, truncation_side="right")
    kept = prompt_of(tokenizer, encode_example(row, task, tokenizer)).split("\n\nQuestion:")[0]
    assert "Here Paris" in kept  # the right-side cut alone keeps only the first mention


def test_an_answer_longer_than_the_context_budget_is_a_bad_example(tokenizer):
    answer = "a very long answer that cannot fit in the little room left for the context"
    row = {"context": FILLER + answer + FILLER, "question": "What?", "answer": answer}
    # the target fits, and leaves a context too short to hold the answer
    task = TaskFormat("extractive_qa", max_length=len(answer) + 40)
    with pytest.raises(BadExampleError, match="answer truncated out of the context") as error:
        encode_example(row, task, tokenizer)
    assert error.value.reason == "answer truncated out of the context"


def test_the_qa_config_settings_keep_every_reference_in_the_embedded_fixture(tokenizer):
    rows = [json.loads(line) for line in qa_fixture_path().read_text().splitlines()]
    task = TaskFormat("extractive_qa", columns={"answer": "answers"}, max_length=128, truncation_side="left")
    refused = 0
    for row in rows:
        try:
            example = encode_example(row, task, tokenizer)
        except BadExampleError as error:  # a long answer beside a long question: no room for it
            assert error.reason == "answer truncated out of the context", row["id"]
            refused += 1
            continue
        context = prompt_of(tokenizer, example).split("\n\nQuestion:")[0]
        assert row["answers"]["text"][0] in context, row["id"]
    assert refused <= 3  # of 42; before, 32 kept a context without their answer, silently


def test_a_mapped_optional_column_must_exist(tokenizer):
    row = {"question": "What do bees make?", "answer": "honey", "passage": "Bees make honey."}
    mapped = TaskFormat("generative_qa", columns={"context": "passage"})
    assert prompt_of(tokenizer, encode_example(row, mapped, tokenizer)).startswith("Bees make honey.")
    misspelt = TaskFormat("generative_qa", columns={"context": "pasage"})
    with pytest.raises(
        ValueError, match=r"no column 'pasage' \(the generative_qa field 'context'\).*'passage'"
    ):
        encode_rows([row], misspelt, tokenizer)
    unmapped = TaskFormat("generative_qa")  # not mapped: a row without a context has none
    assert prompt_of(tokenizer, encode_example(row, unmapped, tokenizer)).startswith("Question:")


@pytest.mark.parametrize(
    ("kind", "template", "target"),
    [
        ("summarization", "{document}\n\nSummary ({summary}):", "summary"),
        ("extractive_qa", "{context}\n\nQuestion: {question} ({answer})\nAnswer:", "answer"),
        ("generative_qa", "{context}Question: {question}\nAnswer: {answer!r}", "answer"),
    ],
)
def test_a_prompt_template_showing_the_target_is_refused_when_read(kind, template, target):
    with pytest.raises(ValueError, match=rf"prompt_template shows the target field '{target}'"):
        TaskFormat(kind, prompt_template=template)


class SlowTokenizer:
    """The byte-level tokenizer as one without offsets (a Python "slow" tokenizer)."""

    is_fast = False

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_id = tokenizer, tokenizer.eos_token_id

    def __call__(self, *args, **kwargs):
        assert "return_offsets_mapping" not in kwargs  # slow tokenizers have none
        return self.tokenizer(*args, **kwargs)


def test_a_tokenizer_without_offsets_keeps_the_answer_too(tokenizer):
    context = FILLER + "The capital of France is Paris. " + FILLER
    row = {"context": context, "question": "What is the capital of France?", "answer": "Paris"}
    task = TaskFormat("extractive_qa", max_length=160, truncation_side="left")
    example = encode_example(row, task, SlowTokenizer(tokenizer))
    assert "Paris" in prompt_of(tokenizer, example).split("\n\nQuestion:")[0]


class CountingTokenizer:
    """A fast tokenizer that counts the times it is given `text` (alone or in a batch)."""

    is_fast = True

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text, self.calls = tokenizer, text, 0
        self.eos_token_id = tokenizer.eos_token_id

    def __call__(self, texts, **kwargs):
        self.calls += (texts == self.text) if isinstance(texts, str) else list(texts).count(self.text)
        return self.tokenizer(texts, **kwargs)


def test_a_qa_context_longer_than_its_room_is_tokenized_once(tokenizer):
    # it was tokenized for its ids and again for the offsets that place its answer
    context = FILLER + "The capital of France is Paris. " + FILLER
    row = {"context": context, "question": "What is the capital of France?", "answer": "Paris"}
    task = TaskFormat("extractive_qa", max_length=160, truncation_side="left")
    counting = CountingTokenizer(tokenizer, context)
    example = encode_example(row, task, counting)
    assert counting.calls == 1
    assert example == encode_example(row, task, tokenizer)
    assert "Paris" in prompt_of(tokenizer, example).split("\n\nQuestion:")[0]
