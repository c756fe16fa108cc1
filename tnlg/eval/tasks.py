"""Fine-tuning evaluations, run distributed (each rank a slice, results gathered) or in one process.

- `target_loss`: the validation examples' loss on their target tokens (teacher forcing), summed over
  every rank's slice: the loss and perplexity of the references.
- `task_scores`: generation from each validation prompt, then ROUGE-1/2/L (summarization) or SQuAD
  exact match and F1 (question answering) against the references. A generation is cut at its first
  line break when every reference is one line (an untrained model rambles on), as the GPT-2 paper cut
  its TL;DR summaries; when a reference spans lines (CNN/DailyMail's highlights) it is scored whole, to
  its end of text or max_new_tokens, and rougeLsum reads it line by line (`predictions_for`).
- `task_metrics`: both, as the fine-tuning run's final evaluation and scripts/evaluate.py report them,
  on the `evaluation_rows`: the first rows that make both an example and a prompt, so that the loss
  and the scores cover the same rows and `examples` counts them (a row can make one and not the
  other: a target too long for an example is not in its prompt, and a prompt leaves room for
  `max_new_tokens` where an example leaves room for its target).

Under ZeRO stage 3 every forward pass is collective, so every rank runs the same number of them: a
rank whose slice is shorter runs dummy batches with no weight, and generation keeps finished ranks
stepping (tnlg.inference.distributed). The slices are cut by data-parallel rank: the ranks of one
tensor-sliced replica take the same examples (see [Note: evaluation by data rank] in
tnlg.inference.ranks).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tnlg.data.finetune import MAX_LOGGED_SKIPS, row_name
from tnlg.data.tasks import (
    IGNORE_INDEX,
    BadExampleError,
    TaskFormat,
    encode_example,
    encode_prompt,
    pad_batch,
)
from tnlg.data.tokenizer import pad_id
from tnlg.eval.text_metrics import rouge_scores, squad_scores
from tnlg.inference.distributed import generate_on_ranks
from tnlg.inference.ranks import all_ranks_sum, model_device, rank_share, work_share
from tnlg.inference.settings import GenerationSettings

logger = logging.getLogger(__name__)

SAMPLES = 3  # predictions kept in the results, to read next to the scores


@torch.no_grad()
def target_loss(
    model: torch.nn.Module,
    examples: Sequence[Mapping[str, list[int]]],
    batch_size: int,
    pad_token_id: int,
) -> dict[str, float]:
    """{"eval_perplexity", "eval_loss"}: the mean loss of the examples' target tokens, over all ranks."""
    if not examples:
        raise ValueError("no examples to evaluate")
    batches = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    device, was_training = model_device(model), model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # [summed NLL, target tokens]
    share = work_share(model)
    for chunk, weight in rank_share(batches, share):  # weight 0: a repeat that keeps this rank in step
        batch = {k: v.to(device) for k, v in pad_batch(chunk, pad_token_id).items()}
        loss = model(**batch).loss
        targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        if targets > 0:  # a batch with no target token has a loss of nan (0 / 0): it adds nothing
            totals += weight * torch.stack([loss.double() * targets, targets.double()]).cpu()
    model.train(was_training)
    totals = all_ranks_sum(totals, share)
    if totals[1] == 0:
        raise ValueError(
            f"the {len(examples)} examples have no target token after the first position to score"
        )
    mean = (totals[0] / totals[1]).item()
    return {"eval_perplexity": math.exp(mean), "eval_loss": mean}


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def predictions_for(completions: list[str], references: list[list[str]]) -> list[str]:
    """The generations as the metric reads them: each cut at its first line break when every reference
    is one line (what follows is rambling); whole, stripped, when any reference spans lines, since a first
    line would be scored against a whole multi-line reference (a copy of it scored about half)."""
    one_line = all("\n" not in answer.strip() for answers in references for answer in answers)
    return [first_line(text) if one_line else text.strip() for text in completions]


@dataclass(frozen=True)
class EvaluationRows:
    """The rows a task evaluation scores: each one's example (for the loss) and prompt (for generation),
    in the same order, and how many rows before them could make neither."""

    examples: list[dict[str, list[int]]]
    prompts: list[dict[str, Any]]
    skipped: int


def evaluation_rows(
    rows: Any, task: TaskFormat, tokenizer, max_new_tokens: int, max_examples: int | None
) -> EvaluationRows:
    """The first `max_examples` rows that make both an example and a prompt; a row that cannot (see
    tnlg.data.tasks) is skipped and logged. ValueError when none can, or a column is missing."""
    examples, prompts, skipped, first_error = [], [], 0, None
    for index in range(len(rows)):
        if max_examples is not None and len(prompts) >= max_examples:
            break
        try:
            example = encode_example(rows[index], task, tokenizer)
            prompt = encode_prompt(rows[index], task, tokenizer, max_new_tokens)
        except BadExampleError as error:
            if skipped < MAX_LOGGED_SKIPS:
                logger.warning("evaluation: skipping %s: %s", row_name(rows, index), error)
            skipped, first_error = skipped + 1, first_error or f"{row_name(rows, index)}: {error}"
            continue
        except KeyError as error:  # a missing column: every row would miss it
            raise ValueError(f"evaluation: {row_name(rows, index)}: {error.args[0]}") from error
        examples.append(example)
        prompts.append(prompt)
    if not prompts:
        raise ValueError(
            f"evaluation: no rows to evaluate ({len(rows)} rows, {skipped} of them unusable; the first: {first_error})"
        )
    return EvaluationRows(examples, prompts, skipped)


def task_scores(
    model: torch.nn.Module,
    tokenizer,
    selected: EvaluationRows,
    task: TaskFormat,
    settings: GenerationSettings,
    *,
    batch_size: int = 8,
) -> dict[str, Any]:
    """The task's metric on generations from the `selected` prompts, across the ranks; every rank
    returns the same scores. Skipped rows are counted as "skipped_rows": the training data policy
    (`data.on_long_example`) has already refused them when it says "stop"."""
    prompts, skipped = selected.prompts, selected.skipped
    was_training = model.training
    model.eval()
    completions = generate_on_ranks(model, tokenizer, [p["input_ids"] for p in prompts], settings, batch_size)
    model.train(was_training)
    references = [p["references"] for p in prompts]
    predictions = predictions_for(completions, references)
    if task.kind == "summarization":
        scores = rouge_scores(predictions, [r[0] for r in references])
    else:
        scores = squad_scores(predictions, references)
    samples = [
        {"prediction": p, "reference": r[0]} for p, r in zip(predictions[:SAMPLES], references, strict=False)
    ]
    return {
        "examples": len(prompts),
        **scores,
        **({"skipped_rows": skipped} if skipped else {}),
        "samples": samples,
    }


def task_metrics(
    model: torch.nn.Module,
    tokenizer,
    selected: EvaluationRows,
    task: TaskFormat,
    settings: GenerationSettings,
    *,
    batch_size: int,
) -> dict[str, Any]:
    """What a fine-tuned model is judged by, after training and in scripts/evaluate.py alike: the
    references' loss and the task metric of generations, on the same `selected` rows."""
    loss = target_loss(model, selected.examples, batch_size, pad_id(tokenizer))
    return loss | task_scores(model, tokenizer, selected, task, settings, batch_size=batch_size)
