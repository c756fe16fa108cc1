"""Fine-tuning: the training loop (tnlg.run.loop) on task examples.

Any TNLG checkpoint (`model.init_from`: from pretraining, or converted from GPT-2 / Megatron) is
fine-tuned with the same ZeRO engine, checkpoints and resume as pretraining, on summarization or
question-answering rows (tnlg.data.tasks) with the loss on the target tokens only. Every
`train.eval_every` steps the validation targets' loss is reported; before (optionally) and after
training the task metric is computed by generation (tnlg.eval.tasks) on every rank's slice of
the validation rows, and written to `<output_dir>/evaluation.json`.
"""

from __future__ import annotations

import logging
from typing import Any

from tnlg.data.finetune import FinetuneBatches, encode_rows, load_rows
from tnlg.eval.tasks import target_loss, task_scores
from tnlg.run.build import check_init_from
from tnlg.run.finetune_config import FinetuneConfig
from tnlg.run.loop import TrainingJob, train
from tnlg.run.lora import lora_model, save_lora_model

logger = logging.getLogger(__name__)


def validation_rows(config: FinetuneConfig):
    """The held-out rows (a split of the source, or files), or None when none is configured."""
    data = config.data
    if data.validation_paths:
        return load_rows(data.dataset, data.validation_paths, "train", data.dataset_config)
    if data.validation_split:
        return load_rows(data.dataset, [], data.validation_split, data.dataset_config)
    return None


def finetune(config: FinetuneConfig, resume: str | None = None) -> dict[str, Any]:
    """Fine-tune per `config`; returns the losses, the saved model's directory and the evaluation."""
    data, task = config.data, config.task.format()
    check_init_from(config.model.init_from)  # before any data is read
    settings = config.evaluation.generation
    held_out = validation_rows(config)
    if held_out is None:
        logger.warning("no validation data (data.validation_split / validation_paths): no evaluation")
    cache: dict[str, Any] = {}

    def tokenizer_examples(tokenizer, where: str, rows, limit: int | None):
        if where not in cache:
            cache[where] = encode_rows(
                rows, task, tokenizer, on_long_example=data.on_long_example, max_examples=limit, where=where
            )
        return cache[where]

    def batches(tokenizer, rank: int, world: int) -> FinetuneBatches:
        rows = load_rows(data.dataset, data.paths, data.split, data.dataset_config)
        logger.info("training rows: %d", len(rows))
        if held_out is not None:  # a bad validation row stops the run now, not at its first evaluation
            validation_examples(tokenizer, world, 0)
        return FinetuneBatches(
            tokenizer_examples(tokenizer, "train", rows, data.max_examples),
            micro_batch_size=config.train.micro_batch_size,
            rank=rank,
            world_size=world,
            seed=config.train.seed,
            pad_token_id=pad_id(tokenizer),
            packing=data.packing,
            max_length=task.max_length,
        )

    def validation_examples(tokenizer, world: int, limit: int):
        """The first `limit` encoded validation examples; encoded once, for both evaluations."""
        periodic = config.train.eval_batches * config.train.micro_batch_size * world
        encoded = tokenizer_examples(
            tokenizer, "validation", held_out, max(periodic, config.evaluation.max_examples)
        )
        return encoded[:limit]

    def evaluate(model, tokenizer, accelerator) -> dict[str, float]:
        # `train.eval_batches` batches per rank, as in pretraining
        limit = config.train.eval_batches * config.train.micro_batch_size * accelerator.num_processes
        examples = validation_examples(tokenizer, accelerator.num_processes, limit)
        return target_loss(model, examples, config.train.micro_batch_size, pad_id(tokenizer))

    def final_evaluation(model, tokenizer, accelerator) -> dict[str, Any]:
        # the references' loss (teacher forcing) and the generated predictions' scores
        examples = validation_examples(tokenizer, accelerator.num_processes, config.evaluation.max_examples)
        loss = target_loss(model, examples, config.evaluation.batch_size, pad_id(tokenizer))
        return loss | task_scores(
            model,
            tokenizer,
            held_out,
            task,
            settings,
            batch_size=config.evaluation.batch_size,
            max_examples=config.evaluation.max_examples,
        )

    lora = config.lora
    job = TrainingJob(
        name="fine-tuning",
        seq_len=task.max_length,
        tokenizer=data.tokenizer,
        batches=batches,
        evaluate=evaluate if held_out is not None else None,
        final_evaluation=final_evaluation if held_out is not None else None,
        evaluate_before=config.evaluation.before_training,
        evaluate_after=config.evaluation.after_training,
    )
    if lora.enabled:
        job.build_model = lambda architecture: lora_model(
            architecture, config.model.init_from, lora, config.train.seed
        )
        job.save_model = lambda accelerator, model, tokenizer, directory: save_lora_model(
            accelerator, model, tokenizer, directory, lora, config.model.init_from, config.train.seed
        )
    return train(config, job, resume)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
