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
do not fit is refused by name). An extractive-QA context keeps a window that holds its answer (see
[Note: the answer's window]). Labels are -100 on every prompt token, so only the target (and the
end-of-text token that closes it) carries loss. A prompt template that shows the target field is
refused when the format is made: the answer would be in the prompt.

Every field is text: a row whose field is null, not a string, or empty (only whitespace) cannot
make an example and raises `BadExampleError` (never the text "None" or "5" in a prompt); so does a
SQuAD row without answer text, an example whose target cannot fit, and an extractive-QA example
whose answer cannot fit the room left for its context. The optional context of generative QA may be
null, empty or absent (no context block), unless `columns` names its column: that column must exist.

[Note: the answer's window]
An extractive-QA context longer than its room keeps the window that `truncation_side` gives when that
window holds the answer (from SQuAD's `answer_start` when it points at the answer text, else the
answer's first occurrence; an answer not in the context at all is cut as any other field). Otherwise
it keeps another window of the same length that holds the answer, placed by a hash of the question and
the context: the same window in every run and process, and not one at a fixed distance from the
answer (a window starting or ending at the answer, or centred on it, would tell the model where the
answer is). An answer longer than the room is refused as a bad example ("answer truncated out of the
context"), so that `on_long_example` decides; cutting it would train on a context without its answer
and score a generation that could not contain it.
"""

from __future__ import annotations

import dataclasses
import re
import string
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .tokenizer import encode_text

IGNORE_INDEX = -100
# Values a row gives besides its text fields: never format fields of a template.
NOT_TEXT = ("references", "answer_start")
ANSWER_CUT = "answer truncated out of the context"
TARGET_CUT = "target does not fit max_length"


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
        "target_field": "summary",
        "truncate": "document",
    },
    "extractive_qa": {
        "fields": ("context", "question", "answer"),
        "prompt": "{context}\n\nQuestion: {question}\nAnswer:",
        "target": " {answer}",
        "target_field": "answer",
        "truncate": "context",
    },
    "generative_qa": {
        "fields": ("question", "answer"),
        "optional": ("context",),
        "prompt": "{context}Question: {question}\nAnswer:",
        "target": " {answer}",
        "target_field": "answer",
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
        target = TASKS[self.kind]["target_field"]
        if target in template_fields(self.prompt, "prompt_template"):
            # the model would learn to copy the answer from its prompt, and be scored on copying it
            raise ValueError(
                f"prompt_template shows the target field {target!r}: {self.prompt!r}; the target belongs "
                "in target_template only"
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


def template_fields(template: str, what: str) -> set[str]:
    """The field names a format string uses (`{answer!r}`, `{answer[0]}` and `{answer.x}` use answer)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"{what} {template!r} is not a format string: {error}") from error
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for _, name, _, _ in parsed if name}


def _missing_column(row: Mapping[str, Any], column: str, task: TaskFormat, name: str) -> KeyError:
    return KeyError(
        f"the row has no column {column!r} (the {task.kind} field {name!r}); columns: {sorted(row)}"
    )


def row_fields(row: Mapping[str, Any], task: TaskFormat) -> dict[str, Any]:
    """The row's fields by the task's names, plus `references` (all acceptable targets)."""
    values: dict[str, Any] = {}
    for name in task.fields:
        column = task.column(name)
        if column not in row:
            raise _missing_column(row, column, task, name)
        value = row[column]
        if name == "answer" and task.kind == "extractive_qa" and isinstance(value, Mapping):
            values[name] = value  # SQuAD's {"text": [...], "answer_start": [...]}: checked below
        else:
            values[name] = _text(value, f"{column!r} (the {task.kind} field {name!r})")
    for name in TASKS[task.kind].get("optional", ()):
        column = task.column(name)
        # a column named in `columns` is meant to be there: a misspelt name is not an absent context
        if name in task.columns and column not in row:
            raise _missing_column(row, column, task, name)
        value = row.get(column)
        if value is not None and not isinstance(value, str):
            _text(value, f"{column!r} (the optional {name!r})")  # raises: not text
        # generative QA: the context block only when there is a context
        values[name] = f"{value}\n\n" if value and value.strip() else ""
    values["references"] = [values[TASKS[task.kind]["target_field"]]]
    values["answer_start"] = None
    if task.kind == "extractive_qa" and isinstance(values["answer"], Mapping):
        _squad_answers(values, task.column("answer"))
    return values


def _squad_answers(values: dict[str, Any], column: str) -> None:
    """SQuAD's answers: the first text is the target (and `answer_start` its place), all are references."""
    answers = values["answer"]
    references = list(answers.get("text") or [])
    if not references:
        raise BadExampleError(
            f"{column!r} has no answer text (unanswerable questions are not supported)", "no answer"
        )
    values["references"] = [_text(r, f"an answer text in {column!r}") for r in references]
    values["answer"] = values["references"][0]
    starts = answers.get("answer_start") or [None]
    values["answer_start"] = starts[0] if isinstance(starts[0], int) else None


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
    text = {k: v for k, v in values.items() if k not in NOT_TEXT}

    def tokens(piece: str) -> list[int]:
        return encode_text(tokenizer, piece.format(**text)) if piece else []

    prefix, suffix = tokens(before), tokens(after)
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
            TARGET_CUT,
        )
    prompt = prefix + _long_field_tokens(values, task, tokenizer, budget) + suffix
    return {"input_ids": prompt + target, "labels": [IGNORE_INDEX] * len(prompt) + target}


def _long_field_tokens(values: dict[str, Any], task: TaskFormat, tokenizer, budget: int) -> list[int]:
    """The long field's tokens, cut to `budget` from `truncation_side`, except that an extractive-QA
    context keeps its answer ([Note: the answer's window])."""
    long_field = TASKS[task.kind]["truncate"]
    text = str(values[long_field])
    offsets = None
    # Field text is data: special-token text in it stays text ([Note: special-token text] in tokenizer.py).
    if task.kind == "extractive_qa" and getattr(tokenizer, "is_fast", False):
        # one pass gives the ids and, should the context need cutting, where its answer lies
        encoded = tokenizer(
            text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True
        )
        long_ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    else:
        long_ids = encode_text(tokenizer, text)
    if len(long_ids) <= budget:
        return long_ids
    start = len(long_ids) - budget if task.truncation_side == "left" else 0
    answer = (
        _answer_tokens(values, tokenizer, len(long_ids), offsets) if task.kind == "extractive_qa" else None
    )
    if answer is not None and not (start <= answer[0] and answer[1] <= start + budget):
        start = _answer_window(answer, len(long_ids), budget, f"{values['question']}\n{values['context']}")
    return long_ids[start : start + budget]


def _answer_window(answer: tuple[int, int], length: int, budget: int, key: str) -> int:
    """Where a window of `budget` of `length` tokens starts so as to hold the `answer` tokens, placed
    by a hash of `key` ([Note: the answer's window])."""
    first, end = answer
    if end - first > budget:
        raise BadExampleError(
            f"the answer ({end - first} tokens) does not fit the {budget} tokens of context that max_length "
            f"leaves: {ANSWER_CUT}",
            ANSWER_CUT,
        )
    lowest, highest = max(0, end - budget), min(first, length - budget)
    return lowest + zlib.crc32(key.encode("utf-8")) % (highest - lowest + 1)


def _answer_tokens(
    values: dict[str, Any], tokenizer, length: int, offsets: list[tuple[int, int]] | None
) -> tuple[int, int] | None:
    """[first, end) of the context's `length` tokens that hold the target answer; None when it is not
    there. `offsets`: each token's character span (a fast tokenizer's), else None."""
    context, answer, start = values["context"], values["answer"], values["answer_start"]
    if start is None or context[start : start + len(answer)] != answer:
        start = context.find(answer)
    if start < 0:
        return None
    end = start + len(answer)
    if offsets is None:
        # no offsets: the tokens of the text before the answer and up to its end bound it, one token
        # wider on each side, since a token may straddle either boundary
        first = max(0, len(encode_text(tokenizer, context[:start])) - 1)
        return first, min(length, len(encode_text(tokenizer, context[:end])) + 1)
    inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return (inside[0], inside[-1] + 1) if inside else None


def encode_prompt(row: Mapping[str, Any], task: TaskFormat, tokenizer, max_new_tokens: int) -> dict[str, Any]:
    """The prompt alone (for generation), cut like `encode_example` to leave `max_new_tokens` of room,
    with the row's references."""
    values = row_fields(row, task)
    prompt_only = dataclasses.replace(
        task, target_template="", max_length=task.max_length - max_new_tokens, add_eos=False
    )
    try:
        input_ids = _encode(values, prompt_only, tokenizer)["input_ids"]
    except BadExampleError as error:
        if error.reason != TARGET_CUT:
            raise
        raise BadExampleError(  # there is no target here: the prompt's own text is what does not fit
            f"the prompt's fixed text does not fit the {prompt_only.max_length} tokens that max_new_tokens "
            f"{max_new_tokens} leaves of max_length {task.max_length}",
            "prompt does not fit",
        ) from error
    return {"input_ids": input_ids, "references": values["references"]}


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
