"""Fine-tuning: the training loop (tnlg.run.loop) on task examples.

Any TNLG checkpoint (`model.init_from`: from pretraining, or converted from GPT-2 / Megatron) is
fine-tuned with the same ZeRO engine, checkpoints and resume as pretraining, on summarization or
question-answering rows (tnlg.data.tasks) with the loss on the target tokens only. Every
`train.eval_every` steps the validation targets' loss is reported; before (optionally) and after
training the task metric is computed by generation (tnlg.eval.tasks) on every rank's slice of
the validation rows, and written to `<output_dir>/evaluation.json`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from tnlg.data.finetune import FinetuneBatches, Rows, encode_rows, load_rows, validation_rows
from tnlg.data.tokenizer import pad_id
from tnlg.eval.tasks import EvaluationRows, evaluation_rows, target_loss, task_metrics
from tnlg.run.finetune_config import FinetuneConfig
from tnlg.run.loop import TrainingJob, train
from tnlg.run.lora import lora_model, save_lora_model

logger = logging.getLogger(__name__)


def finetune(config: FinetuneConfig, resume: str | None = None) -> dict[str, Any]:
    """Fine-tune per `config`; returns the losses, the saved model's directory and the evaluation."""
    examples = TaskExamples(config)  # reads nothing yet: build_run's refusals come first
    evaluating = examples.evaluating
    if not evaluating:
        logger.warning("no validation data (data.validation_split / validation_paths): no evaluation")
    job = TrainingJob(
        name="fine-tuning",
        seq_len=examples.task.max_length,
        tokenizer=config.data.tokenizer,
        batches=examples.batches,
        evaluate=examples.evaluate if evaluating else None,
        final_evaluation=examples.final_evaluation if evaluating else None,
        evaluate_before=config.evaluation.before_training,
        evaluate_after=config.evaluation.after_training,
    )
    lora = config.lora
    if lora.enabled:
        job.build_model = lambda architecture: lora_model(
            architecture, config.model.init_from, lora, config.train.seed
        )
        job.save_model = lambda accelerator, model, tokenizer, directory: save_lora_model(
            accelerator, model, tokenizer, directory, lora, config.model.init_from, config.train.seed
        )
    return train(config, job, resume)


class TaskExamples:
    """The fine-tuning job's data for the loop (`TrainingJob.batches`, `evaluate`, `final_evaluation`):
    training and validation rows, each split encoded once with the run's tokenizer and shared by the
    batches and both evaluations."""

    def __init__(self, config: FinetuneConfig):
        data = config.data
        self.config, self.task = config, config.task.format()
        self.evaluating = bool(data.validation_paths or data.validation_split)
        self._encoded: dict[str, Any] = {}
        self._generation_rows: EvaluationRows | None = None

    @functools.cached_property
    def held_out(self) -> Rows | None:
        """The validation rows (None without validation data), read on first use: in `batches`, once the
        run has made its refusals."""
        data = self.config.data
        return validation_rows(
            data.dataset, data.validation_paths, data.validation_split, data.dataset_config
        )

    def _examples(self, tokenizer, where: str, rows, limit: int | None):
        if where not in self._encoded:
            self._encoded[where] = encode_rows(
                rows,
                self.task,
                tokenizer,
                on_long_example=self.config.data.on_long_example,
                max_examples=limit,
                where=where,
            )
        return self._encoded[where]

    def batches(self, tokenizer, rank: int, world: int) -> FinetuneBatches:
        data, train_section = self.config.data, self.config.train
        rows = load_rows(data.dataset, data.paths, data.split, data.dataset_config)
        logger.info("training rows: %d", len(rows))
        if self.held_out is not None:  # a bad validation row stops the run now, not at its first evaluation
            self.validation_examples(tokenizer, world, 0)
            evaluation = self.config.evaluation
            if evaluation.before_training or evaluation.after_training:
                self.generation_rows(tokenizer)  # and rows that make no prompt: now, not after training
        return FinetuneBatches(
            self._examples(tokenizer, "train", rows, data.max_examples),
            micro_batch_size=train_section.micro_batch_size,
            rank=rank,
            world_size=world,
            seed=train_section.seed,
            pad_token_id=pad_id(tokenizer),
            packing=data.packing,
            max_length=self.task.max_length,
        )

    def validation_examples(self, tokenizer, world: int, limit: int):
        """The first `limit` encoded validation examples (the periodic evaluation's), encoded once: as many
        rows as either evaluation reads, so that `data.on_long_example` judges the final evaluation's too."""
        periodic = self.config.train.eval_batches * self.config.train.micro_batch_size * world
        encoded = self._examples(
            tokenizer, "validation", self.held_out, max(periodic, self.config.evaluation.max_examples)
        )
        return encoded[:limit]

    def generation_rows(self, tokenizer) -> EvaluationRows:
        """The rows of the generation-based evaluation (before and after training): chosen once."""
        if self._generation_rows is None:
            evaluation = self.config.evaluation
            self._generation_rows = evaluation_rows(
                self.held_out,
                self.task,
                tokenizer,
                evaluation.generation.max_new_tokens,
                evaluation.max_examples,
            )
        return self._generation_rows

    def evaluate(self, model, tokenizer, accelerator) -> dict[str, float]:
        # `train.eval_batches` batches per data-parallel rank, as in pretraining: the ranks of one
        # tensor-sliced replica share theirs (see [Note: evaluation by data rank] in tnlg.inference.ranks)
        train_section = self.config.train
        replicas = accelerator.data_parallel_size
        limit = train_section.eval_batches * train_section.micro_batch_size * replicas
        examples = self.validation_examples(tokenizer, replicas, limit)
        return target_loss(model, examples, train_section.micro_batch_size, pad_id(tokenizer))

    def final_evaluation(self, model, tokenizer, accelerator) -> dict[str, Any]:
        # the references' loss (teacher forcing) and the generated predictions' scores, on the same rows
        evaluation = self.config.evaluation
        return task_metrics(
            model,
            tokenizer,
            self.generation_rows(tokenizer),
            self.task,
            evaluation.generation,
            batch_size=evaluation.batch_size,
        )
