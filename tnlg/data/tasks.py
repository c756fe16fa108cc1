"""Fine-tuning examples: a dataset row → prompt and target tokens, with the loss on the target only.

Three task kinds, each a prompt template and a target template over named fields, with a column
mapping from the dataset's own names:

    summarization   fields document, summary         (XSum: document/summary; CNN/DailyMail:
                                                      {"document": "article", "summary": "highlights"})
    extractive_qa   fields context, question, answer (SQuAD: the first of answers.text is the target;
                                                      all of them are the references)
    generative_qa   fields question, answer, and an optional context

When the prompt and target exceed `max_length`, the long field (`document` or `context`) is cut,
from `truncation_side`; the target never is (an example whose target and fixed prompt text alone
do not fit is refused by name). Labels are -100 on every prompt token, so only the target (and the
end-of-text token that closes it) carries loss.

Every field is text: a row whose field is null, not a string, or empty (only whitespace) cannot
make an example and raises `BadExampleError` (never the text "None" or "5" in a prompt); so does a
SQuAD row without answer text and an example whose target cannot fit. The optional context of
generative QA may be null or empty (no context block).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .tokenizer import encode_text

IGNORE_INDEX = -100


class BadExampleError(ValueError):
    """A row that cannot make an example (the data's fault, not the config's): `reason` counts it."""

    def __init__(self, message: str, reason: str):
        self.reason = reason
        super().__init__(message)

    def __reduce__(self):  # the default would rebuild it from the message alone
        return type(self), (self.args[0], self.reason)


TASKS: dict[str, dict[str, Any]] = {
    "summarization": {
        "fields": ("document", "summary"),
        "prompt": "{document}\n\nTL;DR:",
        "target": " {summary}",
        "truncate": "document",
    },
    "extractive_qa": {
        "fields": ("context", "question", "answer"),
        "prompt": "{context}\n\nQuestion: {question}\nAnswer:",
        "target": " {answer}",
        "truncate": "context",
    },
    "generative_qa": {
        "fields": ("question", "answer"),
        "optional": ("context",),
        "prompt": "{context}Question: {question}\nAnswer:",
        "target": " {answer}",
        "truncate": "context",
    },
}


@dataclass(frozen=True)
class TaskFormat:
    """How rows of one dataset become training examples (see the module docstring)."""

    kind: str
    columns: Mapping[str, str] = field(
        default_factory=dict
    )  # field → the dataset's column (default: same name)
    prompt_template: str | None = None  # default: TASKS[kind]["prompt"]
    target_template: str | None = None
    max_length: int = 1024
    truncation_side: str = "right"  # which end of the long field is cut: "left" or "right"
    add_eos: bool = True

    def __post_init__(self) -> None:
        if self.kind not in TASKS:
            raise ValueError(f"task kind must be one of {sorted(TASKS)}, got {self.kind!r}")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}")
        unknown = set(self.columns) - set(self.fields) - set(TASKS[self.kind].get("optional", ()))
        if unknown:
            raise ValueError(
                f"columns maps unknown fields {sorted(unknown)}; {self.kind} has {list(self.fields)}"
            )

    @property
    def fields(self) -> tuple[str, ...]:
        return TASKS[self.kind]["fields"]

    @property
    def prompt(self) -> str:
        return self.prompt_template if self.prompt_template is not None else TASKS[self.kind]["prompt"]

    @property
    def target(self) -> str:
        return self.target_template if self.target_template is not None else TASKS[self.kind]["target"]

    def column(self, name: str) -> str:
        return self.columns.get(name, name)


def row_fields(row: Mapping[str, Any], task: TaskFormat) -> dict[str, Any]:
    """The row's fields by the task's names, plus `references` (all acceptable targets)."""
    values: dict[str, Any] = {}
    for name in task.fields:
        column = task.column(name)
        if column not in row:
            raise KeyError(
                f"the row has no column {column!r} (the {task.kind} field {name!r}); columns: {sorted(row)}"
            )
        value = row[column]
        if name == "answer" and task.kind == "extractive_qa" and isinstance(value, Mapping):
            values[name] = value  # SQuAD's {"text": [...], "answer_start": [...]}: checked below
        else:
            values[name] = _text(value, f"{column!r} (the {task.kind} field {name!r})")
    for name in TASKS[task.kind].get("optional", ()):
        value = row.get(task.column(name))
        if value is not None and not isinstance(value, str):
            _text(value, f"{task.column(name)!r} (the optional {name!r})")  # raises: not text
        # generative QA: the context block only when there is a context
        values[name] = f"{value}\n\n" if value and value.strip() else ""
    references = [values["summary" if task.kind == "summarization" else "answer"]]
    if task.kind == "extractive_qa" and isinstance(values["answer"], Mapping):
        column = task.column("answer")
        references = list(values["answer"]["text"])
        if not references:
            raise BadExampleError(
                f"{column!r} has no answer text (unanswerable questions are not supported)", "no answer"
            )
        references = [_text(r, f"an answer text in {column!r}") for r in references]
        values["answer"] = references[0]
    values["references"] = references
    return values


def _text(value: Any, what: str) -> str:
    """`value` when it is text with something in it, else BadExampleError naming `what`."""
    if value is None:
        raise BadExampleError(f"{what} is null", "null field")
    if not isinstance(value, str):
        raise BadExampleError(f"{what} holds {type(value).__name__} {value!r:.60}, not text", "not text")
    if not value.strip():
        raise BadExampleError(f"{what} is empty", "empty field")
    return value


def encode_example(row: Mapping[str, Any], task: TaskFormat, tokenizer) -> dict[str, list[int]]:
    """`input_ids` (prompt + target [+ eos]) and `labels` (-100 on the prompt), within `max_length`."""
    return _encode(row_fields(row, task), task, tokenizer)


def _encode(values: dict[str, Any], task: TaskFormat, tokenizer) -> dict[str, list[int]]:
    long_field = TASKS[task.kind]["truncate"]
    marker = "{" + long_field + "}"
    if marker not in task.prompt:
        raise ValueError(f"the prompt template must contain {marker}: {task.prompt!r}")
    before, after = task.prompt.split(marker, 1)
    text = {k: v for k, v in values.items() if k != "references"}

    def tokens(piece: str) -> list[int]:
        return encode_text(tokenizer, piece.format(**text)) if piece else []

    prefix, suffix = tokens(before), tokens(after)
    # Field text is data: special-token text in it stays text ([Note: special-token text] in tokenizer.py).
    long_ids = encode_text(tokenizer, str(text[long_field]))
    target = tokens(task.target)
    if task.add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("add_eos needs a tokenizer with an eos_token_id")
        target = [*target, tokenizer.eos_token_id]
    budget = task.max_length - len(prefix) - len(suffix) - len(target)
    if budget < 0:
        raise BadExampleError(
            f"the target ({len(target)} tokens) and the prompt's fixed text ({len(prefix) + len(suffix)}) exceed "
            f"max_length {task.max_length}; the target is never truncated: raise max_length or drop the example",
            "target does not fit max_length",
        )
    if len(long_ids) > budget:
        long_ids = long_ids[len(long_ids) - budget :] if task.truncation_side == "left" else long_ids[:budget]
    prompt = prefix + long_ids + suffix
    return {"input_ids": prompt + target, "labels": [IGNORE_INDEX] * len(prompt) + target}


def encode_prompt(row: Mapping[str, Any], task: TaskFormat, tokenizer, max_new_tokens: int) -> dict[str, Any]:
    """The prompt alone (for generation), cut like `encode_example` to leave `max_new_tokens` of room,
    with the row's references."""
    values = row_fields(row, task)
    prompt_only = dataclasses.replace(
        task, target_template="", max_length=task.max_length - max_new_tokens, add_eos=False
    )
    return {
        "input_ids": _encode(values, prompt_only, tokenizer)["input_ids"],
        "references": values["references"],
    }


def pad_batch(examples: Sequence[Mapping[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Dynamic padding on the right to the batch's longest example: pads get label -100 and mask 0."""
    if not examples:
        raise ValueError("an empty batch")
    length = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[i, :n] = torch.tensor(example["input_ids"])
        labels[i, :n] = torch.tensor(example["labels"])
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
