"""What each rank runs in the fine-tuning tests (importable by spawned processes), and their data."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import torch

SUMMARIES = [
    ("the quick brown fox jumps over the lazy dog near the river bank", "fox jumps"),
    ("heavy rain fell all night and the streets of the old town were flooded", "town flooded"),
    ("the library opens at nine and closes at five on every weekday", "library hours"),
    ("a new bridge across the bay was opened to traffic this morning", "bridge opened"),
    ("the team won the final after a penalty shoot out late in the evening", "team won"),
    ("prices of fresh fruit rose sharply after a cold and dry spring", "fruit prices rose"),
    ("the museum shows paintings from the early twentieth century this year", "museum paintings"),
    ("volunteers planted three hundred trees along the new cycle path", "trees planted"),
]
QUESTIONS = [
    ("What colour is the sky on a clear day?", "blue", "The sky on a clear day is blue."),
    ("How many legs does a spider have?", "eight", ""),
    ("What do bees make?", "honey", "Bees collect nectar and make honey."),
    ("What is frozen water called?", "ice", ""),
    ("Which planet do we live on?", "Earth", "We live on the planet Earth."),
    ("What is the opposite of hot?", "cold", ""),
    ("What do cows drink?", "water", ""),
    ("What gas do plants take in?", "carbon dioxide", "Plants take in carbon dioxide and give out oxygen."),
]


def write_summaries(path: Path) -> Path:
    """CNN/DailyMail's column names (article / highlights), as jsonl."""
    path.write_text("".join(json.dumps({"article": a, "highlights": h}) + "\n" for a, h in SUMMARIES))
    return path


def write_questions(path: Path) -> Path:
    """Generative QA as csv, the context present on some rows only."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["question", "answer", "context"])
        writer.writerows(QUESTIONS)
    return path


def save_base_model(directory: Path) -> Path:
    """A seeded debug model with the byte-level tokenizer: the checkpoint fine-tuning starts from."""
    from tnlg import TNLGConfig, TNLGForCausalLM
    from tnlg.data.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    config = TNLGConfig.from_preset(
        "debug",
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    TNLGForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_finetune(
    rank: int, world_size: int, cache: str, overrides: list[str], resume: str | None = None
) -> dict:
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.finetune import finetune
    from tnlg.run.finetune_config import load_finetune_config

    arguments = ["--logging.trackers", "[]", "--train.eval_every", "0", *overrides]
    result = finetune(load_finetune_config(None, arguments), resume=resume)
    return {"losses": result["losses"], "evaluation": result["evaluation"], "model": result["model"]}
