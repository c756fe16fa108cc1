"""lm-evaluation-harness (lm-eval) on a tnlg model, in this process: the field's yardstick, with no export.

[Note: lm-eval in process]
lm-eval's `HFLM` accepts an already loaded `PreTrainedModel` and its tokenizer: the TNLGForCausalLM
object is handed over as it is (importing tnlg has registered model type `tnlg` with the Auto classes,
though nothing here loads through them), and lm-eval scores it with its own requests, tokenization
and metrics, so that the figures are lm-eval's, comparable with any published ones. The backend is
named ("causal") rather than guessed from a model type lm-eval has never heard of. HFLM runs one
process on the whole model: a ZeRO-sharded model is not a `PreTrainedModel`, so scripts/evaluate.py
refuses --harness under a launcher or with --zero-stage / --zero-config.

Tasks come from lm-eval's own registry and from `include_path`, a folder of task YAML files (a local
jsonl through `dataset_path: json` and `dataset_kwargs: {data_files: ...}`: nothing downloads).
Indexing lm-eval's ~15,000 built-in task files takes about 10 s on 2 cores, so when every requested
name is a plain task of `include_path` only that folder is indexed (lm-eval lets `include_path` tasks
override built-in ones of the same name, so the task found is the same); a group or tag, which names
other tasks, and any name not found there, get the full index.

lm-eval is an optional dependency (`pip install "tnlg[eval]"`), imported only here, when used.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

HARNESS = "lm-eval"
INSTALL_HINT = 'pip install "tnlg[eval]" (or pip install lm-eval)'


def require_lm_eval(feature: str = "--harness lm-eval") -> ModuleType:
    """The `lm_eval` module; ImportError naming `feature` and the install command when it is missing."""
    try:
        return importlib.import_module("lm_eval")
    except ImportError as error:
        raise ImportError(f"{feature} needs lm-evaluation-harness ({error}): {INSTALL_HINT}") from error


def task_manager(tasks: Sequence[str], include_path: str | Path | None = None):
    """An lm-eval TaskManager that knows every name in `tasks` (see [Note: lm-eval in process]);
    ValueError naming the unknown ones, or a missing `include_path`."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("no lm-eval task named")
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise NotADirectoryError(f"{include_path}: no such directory of task YAML files")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(name in local.all_subtasks for name in tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if unknown:
        where = "lm-eval's tasks" + (f" or those of {include_path}" if include_path is not None else "")
        raise ValueError(
            f"unknown lm-eval task(s) {', '.join(unknown)}: not in {where} (`lm-eval ls tasks` lists them; "
            "an include path adds a folder of task YAML files; lm-eval skips a YAML file it cannot parse)"
        )
    return manager


def run_lm_eval(
    model: torch.nn.Module,
    tokenizer,
    manager,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    limit: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` output for `tasks` (found by `manager`, from `task_manager`) on
    `model`, a TNLGForCausalLM in this process: "results" per task, "samples" per document when
    `log_samples`."""
    lm_eval = require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    output = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
    )
    if output is None:  # lm-eval returns None on ranks other than 0; this is one process
        raise RuntimeError("lm-eval returned no results")
    return output


def harness_results(output: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{"lm-eval:<task>": {metric: value, ...}}` for eval_results.json and the results table. lm-eval
    names a metric "<metric>,<filter>": the filter is dropped when it is "none" (a loglikelihood task's
    only one); its accuracies are fractions (tnlg's LAMBADA accuracy is a percentage)."""
    lm_eval = require_lm_eval()
    version = getattr(lm_eval, "__version__", "unknown")
    results: dict[str, dict[str, Any]] = {}
    for task, metrics in output["results"].items():
        entry: dict[str, Any] = {"harness": f"{HARNESS} {version}"}
        if task in output.get("n-samples", {}):
            entry["samples"] = output["n-samples"][task]["effective"]
        if task in output.get("n-shot", {}):
            entry["num_fewshot"] = output["n-shot"][task]
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if not kind or isinstance(value, str):  # "alias", "name", and "N/A" standard errors
                continue
            entry[metric if kind == "none" else key] = value
        results[f"{HARNESS}:{task}"] = entry
    return results
