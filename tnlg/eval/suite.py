"""The evaluations of scripts/evaluate.py on a saved checkpoint, in one process or distributed.

- `perplexity` of a text with a sliding window, every token scored (as lm-eval's rolling
  log-likelihood), plus bits per byte. A data file (`DATA_SUFFIXES`:
  json / jsonl / csv / parquet, and compressed json lines) gives the `text_field` of its rows joined
  by blank lines; any other file (.txt, .md, .py, no suffix) is read as UTF-8 text, whole. A file that
  is not UTF-8 (named with the byte offset), holds a NUL byte (binary), or is another compressed
  file (.txt.gz: decompress it first) is refused rather than scored as something it is not;
- `lambada`: last-word accuracy and perplexity over a data file of passages (`text_field`), with the
  boundaries of lm-eval's `lambada_openai` (see [Note: LAMBADA boundaries] in tnlg.eval.lambada);
- `task`: a fine-tuning task on rows (scripts/evaluate.py passes a config's validation rows, or
  another split, and its generation settings): the references' loss and ROUGE (summarization) or
  SQuAD EM / F1 (QA).

With several processes (`accelerate launch`, torchrun) the model is sharded by the ZeRO engine at
`zero_stage` (inference only: each rank reads only its slices of the checkpoint under stage 3) and
every evaluation splits its work across the ranks; results are gathered, the same on every rank.
Results are written next to the checkpoint (`eval_results.json`, one entry per evaluation, merged
with earlier ones) and printed as a table. An entry records what it was measured on (a file's
`source` and a perplexity's window; a task's or lm-eval task's `measured_on`) and the `dtype` its
forward passes computed in, and an earlier entry of the same name measured on something else or in
another dtype is never replaced (`refuse_other_measurements`, `refuse_other_dtype`; the file and window
checks are scripts/evaluate.py's): the run is refused before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tnlg.data.files import DamagedFileError, compression_of
from tnlg.data.finetune import BUILDERS, Rows, load_rows
from tnlg.data.tasks import TaskFormat
from tnlg.eval.lambada import check_last_word_fits, encode_passage, encoded_last_word_scores, split_last_word
from tnlg.eval.perplexity import perplexity
from tnlg.eval.tasks import EvaluationRows, evaluation_rows, task_metrics
from tnlg.inference.distributed import (
    init_process_group_from_environment,
    load_sharded_model,
    sharded_precision,
)
from tnlg.inference.generation import load_model_and_tokenizer
from tnlg.inference.ranks import rank_and_world
from tnlg.inference.settings import GenerationSettings
from tnlg.sharding import ZeroConfig

RESULTS_FILE = "eval_results.json"
DATA_SUFFIXES = tuple(sorted(BUILDERS))  # the files read as rows of a text column, not as text


def load_for_evaluation(
    model_dir: str | Path, sharding: ZeroConfig | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, Any]:
    """The checkpoint sharded across the launched ranks by the ZeRO engine under `sharding`, a settled
    ZeroConfig whose mixed precision is the compute dtype (`sharding_from_flags`), else whole in this
    process in `dtype` (None: float32). Launched on several processes without a `sharding`, the model
    is sharded at stage 3 in `dtype`'s precision."""
    distributed = init_process_group_from_environment()
    if sharding is None and distributed:
        sharding = sharded_precision(ZeroConfig(stage=3), dtype)
    if sharding is not None:
        return load_sharded_model(model_dir, sharding)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model_and_tokenizer(model_dir, dtype or torch.float32, device)


def is_data_file(path: str | Path) -> bool:
    return Path(path).name.endswith(DATA_SUFFIXES)


def read_text(path: str | Path, text_field: str = "text") -> str:
    """The text to score: a data file's `text_field` rows joined by blank lines, else the file as
    UTF-8 text (see the module docstring)."""
    path = Path(path)
    if is_data_file(path):
        return "\n\n".join(text_column(path, text_field))
    if compression_of(path) is not None:
        raise ValueError(
            f"{path} is compressed but not a data file ({', '.join(DATA_SUFFIXES)}): decompress it to score "
            "its text"
        )
    return read_plain_text(path)


def read_plain_text(path: Path) -> str:
    """The file as UTF-8 text; ValueError naming the file and the byte offset where it is not."""
    if not path.is_file():
        raise FileNotFoundError(f"no file at {path}")
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"{path} has a NUL byte at offset {nul}: a binary file, not text (perplexity reads UTF-8 text, or the "
            f"text column of a data file: {', '.join(DATA_SUFFIXES)})"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = data[error.start : error.end]
        raise ValueError(
            f"{path} is not UTF-8 text: byte offset {error.start} ({bad!r}): {error.reason}"
        ) from error


def text_column(path: str | Path, text_field: str) -> list[str]:
    """The `text_field` of a data file's rows; ValueError naming the row where it is not text."""
    rows = load_rows(None, [str(path)], "train")
    if text_field not in rows.column_names:
        raise ValueError(f"{path} has no column {text_field!r}; columns: {rows.column_names}")
    texts = rows.column(text_field)
    for index, text in enumerate(texts):
        if not isinstance(text, str):  # str() would score the text "None" (or "5")
            kind = "null" if text is None else f"{type(text).__name__} {text!r:.60}"
            raise ValueError(f"{rows.origin(index)}: {text_field!r} is {kind}, not text")
    return texts


def prefix_token(tokenizer) -> int:
    """The token a text's first token is predicted from: BOS, else EOS, as lm-eval's `prefix_token_id`
    ([Note: every token scored] in tnlg.eval.perplexity)."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError(
            "the tokenizer has neither a BOS nor an EOS token to predict a text's first token from"
        )
    return token


def text_tokens(tokenizer, text: str, source: str | Path) -> list[int]:
    """The text's token ids; ValueError naming `source` when there is none to score."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{source} holds no token of text: nothing to score")
    return ids


def score_perplexity(
    model, tokenizer, text: str, ids: list[int], source: str | Path, *, max_length: int, stride: int | None
) -> dict[str, Any]:
    """The perplexity and bits per byte of `text` (its token `ids`), every token scored."""
    result = perplexity(
        model,
        ids,
        max_length=max_length,
        stride=stride,
        prefix_token_id=prefix_token(tokenizer),
        text_bytes=len(text.encode("utf-8")),
    )
    return {
        "source": source_name(source),
        "max_length": max_length,
        "stride": stride or max_length,
        **result.as_dict(),
    }


def source_name(source: str | Path) -> str:
    """How a result names the file it measured: resolved, so that a later run in another directory
    compares the file itself, not how it was spelt relative to where each run started."""
    return str(Path(source).resolve())


def evaluate_perplexity(
    model, tokenizer, path: str | Path, *, max_length: int, stride: int | None, text_field: str = "text"
) -> dict[str, Any]:
    text = read_text(path, text_field)
    ids = text_tokens(tokenizer, text, path)
    return score_perplexity(model, tokenizer, text, ids, path, max_length=max_length, stride=stride)


def read_passages(path: str | Path, text_field: str = "text") -> list[str]:
    """The LAMBADA passages of a data file, each checked to have a context and a last word."""
    if not is_data_file(path):
        raise ValueError(
            f"{path}: LAMBADA passages are read from a data file ({', '.join(DATA_SUFFIXES)}) with a "
            f"{text_field!r} column"
        )
    passages = text_column(path, text_field)
    for index, passage in enumerate(passages):
        try:
            split_last_word(passage)
        except ValueError as error:
            raise ValueError(f"{path} row {index}: {error}") from error
    return passages


def check_passage_tokens(
    tokenizer, passages: list[str], path: str | Path, max_length: int | None
) -> list[tuple[list[int], list[int]]]:
    """Every passage's (context ids, last word's ids), each checked to make a context and a last word
    that fits `max_length` positions: before any evaluation, so that a bad passage costs none; the
    scoring takes them as they are (`score_lambada`)."""
    encoded = []
    for index, passage in enumerate(passages):
        try:
            context, target = encode_passage(tokenizer, passage)
            check_last_word_fits(target, max_length)
        except ValueError as error:
            raise ValueError(f"{path} row {index}: {error}") from error
        encoded.append((context, target))
    return encoded


def evaluate_lambada(
    model, tokenizer, path: str | Path, text_field: str = "text", max_length: int | None = None
) -> dict[str, Any]:
    """Last-word accuracy and perplexity of the passages of a data file; passages longer than
    `max_length` tokens (the model's positions) keep their last ones, as lm-eval's do."""
    encoded = check_passage_tokens(tokenizer, read_passages(path, text_field), path, max_length)
    return score_lambada(model, encoded, path, max_length)


def score_lambada(
    model, encoded: list[tuple[list[int], list[int]]], source: str | Path, max_length: int | None = None
) -> dict[str, Any]:
    """`evaluate_lambada`'s result for passages `check_passage_tokens` encoded."""
    result = encoded_last_word_scores(model, encoded, max_length=max_length)
    return {"source": source_name(source), **result.as_dict()}


# Rows, task format and generation settings, not a FinetuneConfig: eval sits below tnlg.run (which
# imports it) and must not import it back. scripts/evaluate.py turns a fine-tuning config into these.
def evaluate_task(
    model,
    tokenizer,
    rows: Rows,
    task: TaskFormat,
    settings: GenerationSettings,
    *,
    batch_size: int,
    max_examples: int | None,
    split: str = "validation",
) -> dict[str, Any]:
    """The `task` on `rows` (the `split` named in the results): the references' loss and the task
    metric of generations with `settings`, on the first `max_examples` rows that make an example and a
    prompt (the same rows for both)."""
    selected = evaluation_rows(rows, task, tokenizer, settings.max_new_tokens, max_examples)
    return score_task(model, tokenizer, selected, task, settings, batch_size=batch_size, split=split)


def score_task(
    model,
    tokenizer,
    selected: EvaluationRows,
    task: TaskFormat,
    settings: GenerationSettings,
    *,
    batch_size: int,
    split: str = "validation",
) -> dict[str, Any]:
    scores = task_metrics(model, tokenizer, selected, task, settings, batch_size=batch_size)
    return {"task": task.kind, "split": split, "generation": dataclasses.asdict(settings), **scores}


def results_path(model_dir: str | Path) -> Path | None:
    """The checkpoint's eval_results.json, its earlier results checked readable (so that a damaged
    file stops the run before the evaluations, not after them); None for a preset name (no directory
    to write to)."""
    if not Path(model_dir).is_dir():
        return None
    path = Path(model_dir) / RESULTS_FILE
    earlier_results(path)
    return path


def earlier_results(path: Path) -> dict[str, Any]:
    """The results already saved at `path` ({} when none); DamagedFileError when it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        existing = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedFileError(
            path, f"its earlier results are not valid JSON ({error}); move it away"
        ) from error
    if not isinstance(existing, dict):
        raise DamagedFileError(
            path, f"it holds a JSON {type(existing).__name__}, not an object; move it away"
        )
    return existing


def refuse_other_measurements(path: Path | None, planned: dict[str, dict[str, Any]]) -> None:
    """ValueError when `path` holds a result of a name in `planned` that was measured on other data
    (its "measured_on": the data source, split, example count, or lm-eval's limit and shots): saving
    would replace it with numbers of something else. A result that records none is replaced."""
    _refuse_another("measured_on", path, planned, "measured on", json.dumps)


def refuse_other_dtype(path: Path | None, names: Iterable[str], dtype: str) -> None:
    """ValueError when `path` holds a result of one of `names` computed in another dtype than `dtype`
    (its "dtype": "float32", "bfloat16" or "float16"): saving would replace a figure with one of another
    precision. A result that records no dtype (written by an older tnlg) is not compared: it is replaced,
    as for any setting an earlier result does not record."""
    _refuse_another("dtype", path, dict.fromkeys(names, dtype), "computed in", str)


def _refuse_another(
    key: str, path: Path | None, planned: dict[str, Any], phrase: str, shown: Callable[[Any], str]
) -> None:
    """ValueError when an earlier result of a name in `planned` records another `key` than planned,
    said as "{name} {phrase} {before}, not {preposition} {planned}"."""
    earlier = earlier_results(path) if path is not None else {}
    preposition = phrase.split()[-1]
    for name, value in planned.items():
        entry = earlier.get(name)
        before = entry.get(key) if isinstance(entry, dict) else None
        if before is not None and before != value:
            raise ValueError(
                f"{path} already holds {name} {phrase} {shown(before)}, not {preposition} {shown(value)} as "
                "this run would: saving would replace it; move the earlier results away to replace them"
            )


def save_results(path: Path, results: dict[str, dict[str, Any]]) -> Path:
    """Merge `results` into `path` (from `results_path`); the main process only writes."""
    if rank_and_world()[0] == 0:
        _write_atomically(path, json.dumps(earlier_results(path) | results, indent=2))
    return path


def _write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file renamed over it: an interrupted write leaves the
    earlier results whole, never a truncated file that would stop every later run."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def results_table(results: dict[str, dict[str, Any]]) -> str:
    """evaluation | metric | value, numbers only (samples and settings stay in the JSON)."""
    rows = [("evaluation", "metric", "value")]
    for name, metrics in results.items():
        for metric, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or metric == "max_length":
                continue
            shown = f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)
            rows.append((name, metric, shown))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)
