"""Evaluate a TNLG checkpoint: perplexity (sliding window, bits per byte), LAMBADA-style last-word
accuracy and perplexity (lm-eval's lambada_openai boundaries), a fine-tuning task's metric (ROUGE for
summarization, SQuAD EM/F1 for QA), and lm-evaluation-harness tasks run on the model in this process.

    python scripts/evaluate.py --model runs/finetune-docstrings/model --config configs/finetune/summarization.yaml
    python scripts/evaluate.py --model runs/pretrain-debug/model --perplexity notes.txt --stride 64
    python scripts/evaluate.py --model DIR --lambada lambada_test.jsonl
    python scripts/evaluate.py --model DIR --harness lm-eval --tasks lambada_local --include-path tasks/

--harness lm-eval runs lm-eval's tasks (its own, or the task YAML files of --include-path) on the
loaded model, in one process (pip install "tnlg[eval]"); its metrics are lm-eval's (accuracies as
fractions).

--perplexity reads a data file (.json, .jsonl, .jsonl.gz, .jsonl.zst, .csv, .parquet: its
--text-field rows joined by blank lines) or any other file as UTF-8 text (.txt, .md, ...); a file
that is not UTF-8 text is refused, naming the byte offset.
    accelerate launch --multi_gpu --num_processes 2 scripts/evaluate.py --model DIR --config CFG --zero-stage 3

With several processes the model is sharded by the ZeRO engine (stage 3 by default: each rank
reads only its slices) and each rank evaluates a share. Every input is read and checked before the
model loads. Results are printed as a table and merged into DIR/eval_results.json, each recording what
it was measured on and its `dtype` (the compute dtype: --dtype, or the --zero-config's bf16 / fp16); one
that would replace an earlier result measured on other data (another file, --split, example count,
--limit or --num-fewshot) or in another dtype is refused before the run starts. A config's task
on its validation data is saved as task:KIND, on --split S as task:KIND:S. Generation settings come from the config's `evaluation.generation`;
`--section.key value` overrides any config key (e.g. --evaluation.generation.num_beams 4).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tnlg.data.finetune import Rows, data_files, load_rows, validation_rows
from tnlg.eval.harness import HARNESS, harness_results, require_lm_eval, run_lm_eval, task_manager
from tnlg.eval.suite import (
    check_passage_tokens,
    earlier_results,
    load_for_evaluation,
    read_passages,
    read_text,
    refuse_other_dtype,
    refuse_other_measurements,
    results_path,
    results_table,
    save_results,
    score_lambada,
    score_perplexity,
    score_task,
    text_tokens,
)
from tnlg.eval.tasks import EvaluationRows, evaluation_rows
from tnlg.inference.distributed import DTYPES, sharding_from_flags
from tnlg.inference.ranks import rank_and_world
from tnlg.modeling import TNLGConfig
from tnlg.modeling.loading import check_model_config
from tnlg.run.cli import configure_logging, exit_on_input_error
from tnlg.run.finetune_config import FinetuneConfig, load_finetune_config
from tnlg.sharding import ZeroConfig
from tnlg.sharding.engine import COMPUTE_DTYPES

logger = logging.getLogger("evaluate")
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # as entries record them: --dtype's names


def task_measurement(config: FinetuneConfig, split: str | None, max_examples: int | None) -> dict:
    """What the config's task is measured on: its data source (the files, or a dataset's split), the
    split named in the results, and how many examples; ValueError when it names no such data."""
    data = config.data
    if split and data.paths:  # load_rows would read the files whole, whatever the split
        raise ValueError(
            f"--split {split}: the config's data are files (data.paths), which have no splits: give the files "
            "to score as --data.validation_paths '[FILE, ...]' instead"
        )
    dataset = data.dataset if data.dataset_config is None else f"{data.dataset}/{data.dataset_config}"
    if split:
        source: str | list[str] = f"{dataset}:{split}"
    elif data.validation_paths:
        source = [str(path.resolve()) for path in data_files(data.validation_paths)]
    elif data.validation_split:
        source = f"{dataset}:{data.validation_split}"
    else:
        raise ValueError(
            "the config names no validation data (data.validation_split / validation_paths): pass --split"
        )
    limit = max_examples if max_examples is not None else config.evaluation.max_examples
    return {"source": source, "split": split or "validation", "max_examples": limit}


def task_result_name(config: FinetuneConfig, split: str | None) -> str:
    """`task:KIND` for the config's validation data, `task:KIND:SPLIT` for another split."""
    return f"task:{config.task.kind}" + (f":{split}" if split else "")


def config_task_rows(config: FinetuneConfig, split: str | None) -> Rows:
    """The rows of `split` of the config's source (default: its validation data)."""
    data = config.data
    if split:
        return load_rows(data.dataset, data.paths, split, data.dataset_config)
    return validation_rows(data.dataset, data.validation_paths, data.validation_split, data.dataset_config)


def parse_arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the config overrides, checked: a wrong combination exits 2 naming it."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--config", type=Path, help="fine-tuning config: evaluate its task")
    parser.add_argument("--split", help="the task's split to score (default: the config's validation data)")
    parser.add_argument(
        "--max-examples", type=int, help="with --config: default: the config's evaluation.max_examples"
    )
    parser.add_argument(
        "--perplexity",
        type=Path,
        action="append",
        default=[],
        help="UTF-8 text file or data file (see above)",
    )
    parser.add_argument("--lambada", type=Path, help="data file (jsonl, ...) of passages")
    parser.add_argument(
        "--text-field", help="the text column of --perplexity / --lambada data files (default: text)"
    )
    parser.add_argument("--max-length", type=int, help="perplexity window (default: the model's positions)")
    parser.add_argument("--stride", type=int, help="perplexity window step (default: --max-length)")
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        help="shard the model (default 3 when launched on several processes)",
    )
    parser.add_argument("--zero-config", help="ZeroConfig or DeepSpeed JSON for the sharded model")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="compute dtype (default: float32, or the --zero-config's bf16/fp16 when it enables one)",
    )
    harness = parser.add_argument_group("lm-evaluation-harness (--harness lm-eval)")
    harness.add_argument("--harness", choices=[HARNESS], help="run the --tasks of this harness on the model")
    harness.add_argument("--tasks", help="comma-separated task names (lm-eval's, or --include-path's)")
    harness.add_argument("--include-path", type=Path, help="a folder of lm-eval task YAML files")
    harness.add_argument("--num-fewshot", type=int, help="default: each task's own")
    harness.add_argument("--limit", type=int, help="score only the first N documents of each task")
    harness.add_argument(
        "--batch-size",
        type=int,
        help="lm-eval's batch size (default 1; a --config task's is --evaluation.batch_size)",
    )
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not (args.config or args.perplexity or args.lambada or args.harness):
        parser.error("nothing to evaluate: give --config, --perplexity, --lambada or --harness")
    if overrides and not args.config:
        parser.error(f"config overrides {overrides} need --config")
    harness = f"--harness {HARNESS}"
    refuse_flags_without(parser, args, ("tasks", "include_path", "num_fewshot", "limit"), "harness", harness)
    # A config task's batch size is its evaluation.batch_size (--evaluation.batch_size N overrides it).
    refuse_flags_without(parser, args, ("batch_size",), "harness", harness)
    refuse_flags_without(parser, args, ("max_length", "stride"), "perplexity")
    refuse_flags_without(parser, args, ("text_field",), ("perplexity", "lambada"))
    refuse_flags_without(parser, args, ("split", "max_examples"), "config")
    check_numbers(parser, args)
    check_result_names(parser, args)
    if args.harness:
        check_harness_arguments(parser, args)
    try:  # settled once, named by the flags and before anything loads
        args.sharding = sharding_asked(args)
    except ValueError as error:
        parser.error(str(error))
    args.compute_dtype = compute_dtype_asked(args)  # recorded in every entry and loaded in (`load_model`)
    return args, overrides


def sharding_asked(args: argparse.Namespace) -> ZeroConfig | None:
    """The ZeroConfig the model is sharded under (`sharding_from_flags`; stage 3 unless the flags say
    otherwise), or None for the whole model in one process: sharded when --zero-stage or --zero-config
    asks, or when launched on several processes."""
    if args.zero_stage is None and not args.zero_config and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return sharding_from_flags(args.zero_config, args.zero_stage, args.dtype, default_stage=3)


def compute_dtype_asked(args: argparse.Namespace) -> str:
    """The dtype the forward passes compute in, by its --dtype name: a sharded model's is its settled
    mixed precision (`sharding_asked`, which settled --dtype with the --zero-config's bf16 / fp16), the
    whole model's is --dtype (default float32)."""
    if args.sharding is not None:
        return DTYPE_NAMES[COMPUTE_DTYPES[args.sharding.mixed_precision]]
    return args.dtype or "float32"


def load_model(args: argparse.Namespace):
    """The model and tokenizer, computing in `args.compute_dtype`: the sharded model in its settled
    config's precision (which is that dtype), the whole model in that dtype."""
    dtype = None if args.sharding is not None else DTYPES[args.compute_dtype]
    return load_for_evaluation(args.model, args.sharding, dtype)


def refuse_flags_without(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    names: tuple[str, ...],
    needed: str | tuple[str, ...],
    shown: str | None = None,
) -> None:
    """Exit 2 when flags that only `--needed` (one of them, for several) reads are given without it
    (they would be ignored); `shown` is how the error writes the needed flag (default `--needed`)."""
    needed = (needed,) if isinstance(needed, str) else needed
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is not None]
    if given and not any(getattr(args, name) for name in needed):
        shown = shown or " or ".join(f"--{name.replace('_', '-')}" for name in needed)
        parser.error(f"{', '.join(given)}: only with {shown} (without it nothing reads them)")


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sizes and counts in the ranges their readers need (0 is never "the default")."""
    if args.max_length is not None and args.max_length < 2:
        parser.error(
            f"--max-length {args.max_length}: a window needs at least 2 tokens (a token and its context)"
        )
    if args.stride is not None and not 1 <= args.stride <= (args.max_length or args.stride):
        parser.error(
            f"--stride {args.stride}: must be at least 1 and at most --max-length ({args.max_length})"
        )
    for name in ("max_examples", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be at least 1")


def check_result_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each file's results are named by its file name: two files of one name would share one entry."""
    names = [path.name for path in args.perplexity]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        parser.error(
            f"--perplexity files share the file name(s) {repeated}, which name their results: copy or link "
            "them under distinct names (or evaluate them in separate runs)"
        )


def result_sources(args: argparse.Namespace) -> dict[str, Path]:
    """{result name: the file it measures} for the file evaluations."""
    sources = {f"perplexity:{path.name}": path for path in args.perplexity}
    if args.lambada:
        sources[f"lambada:{args.lambada.name}"] = args.lambada
    return sources


def refuse_replacing_other_files_results(target: Path | None, sources: dict[str, Path]) -> None:
    """ValueError when eval_results.json holds a result of this name measured on another file: saving
    would replace it with a different file's numbers."""
    earlier = earlier_results(target) if target is not None else {}
    for name, path in sources.items():
        source = earlier.get(name, {}).get("source") if isinstance(earlier.get(name), dict) else None
        if source is not None and Path(source).resolve() != path.resolve():
            raise ValueError(
                f"{target} already holds {name} of {source}, a different file than {path}: give this file "
                "another name, or move the earlier results away"
            )


def refuse_other_file_settings(target: Path | None, args: argparse.Namespace) -> None:
    """ValueError when eval_results.json holds a result of one of the files measured with other settings:
    a perplexity with another window (max_length / stride), either result with another --text-field (another
    column of the file). Its figure, a different measurement, would be replaced. The default window is
    the model's positions (its config.json); a setting an earlier result does not record is not compared."""
    earlier = earlier_results(target) if target is not None else {}
    measured = {name: earlier[name] for name in result_sources(args) if isinstance(earlier.get(name), dict)}
    if not measured:
        return
    text_field = {"text_field": args.text_field or "text"}
    # the window once (it may read the model's config.json), and only when a perplexity is compared
    window = _window(args) if any(name.startswith("perplexity:") for name in measured) else {}
    for name, entry in measured.items():
        settings = window | text_field if name.startswith("perplexity:") else text_field
        before = {key: entry[key] for key in settings if key in entry}
        now = {key: settings[key] for key in before}
        if before != now:
            raise ValueError(
                f"{target} already holds {name} measured with {_settings_text(before)}, not "
                f"{_settings_text(now)} as this run would: saving would replace it; move the earlier results "
                "away to replace them"
            )


def _window(args: argparse.Namespace) -> dict[str, int]:
    max_length = args.max_length if args.max_length is not None else model_positions(args.model)
    return {"max_length": max_length, "stride": args.stride or max_length}


def model_positions(model: str | Path) -> int:
    """The model's positions (max_position_embeddings), from its config.json or its preset."""
    if Path(model).is_dir():
        check_model_config(Path(model), TNLGConfig.model_type)
        return TNLGConfig.from_pretrained(model).max_position_embeddings
    return TNLGConfig.from_preset(str(model)).max_position_embeddings


def refuse_a_window_past_the_model(args: argparse.Namespace) -> None:
    """--max-length beyond the model's positions, named before the model loads: it failed at the first
    forward, naming the sequence, after the earlier files' evaluations had run for nothing."""
    if args.max_length is None or (
        Path(args.model).is_dir() and not (Path(args.model) / "config.json").exists()
    ):
        return  # a directory without its config: the load names that
    positions = model_positions(args.model)
    if args.max_length > positions:
        raise ValueError(
            f"--max-length {args.max_length} exceeds the model's {positions} positions (max_position_embeddings): "
            f"give at most {positions}, or leave it out to use them all"
        )


def _settings_text(settings: dict[str, Any]) -> str:
    if settings.keys() >= {"max_length", "stride"}:  # the window as it is usually written
        rest = {k: v for k, v in settings.items() if k not in ("max_length", "stride")}
        window = f"max_length {settings['max_length']} / stride {settings['stride']}"
        return ", ".join([window, *(f"{k} {v!r}" for k, v in rest.items())])
    return ", ".join(f"{k} {v!r}" for k, v in settings.items())


def check_harness_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--harness needs --tasks, an existing --include-path, one process and lm-eval installed."""
    if not args.tasks or not [name for name in args.tasks.split(",") if name.strip()]:
        parser.error(f"--harness {HARNESS} needs --tasks T1,T2")
    if args.include_path is not None and not args.include_path.is_dir():
        parser.error(f"--include-path {args.include_path}: no such directory of task YAML files")
    if args.zero_stage is not None or args.zero_config or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # [Note: lm-eval in process]: HFLM takes the whole model in one process, not a sharded one
        parser.error(
            f"--harness {HARNESS} runs the whole model in one process: launch it without accelerate / "
            "torchrun and without --zero-stage / --zero-config"
        )
    try:
        require_lm_eval()
    except ImportError as error:
        parser.error(str(error))


@dataclass
class Inputs:
    """Every input of the run, read and checked before the model loads (a bad one costs nothing)."""

    texts: dict[Path, str] = field(default_factory=dict)  # --perplexity files
    passages: list[str] | None = None  # --lambada
    rows: Rows | None = None  # the config's task


def read_inputs(args: argparse.Namespace, config: FinetuneConfig | None) -> Inputs:
    text_field = args.text_field or "text"
    inputs = Inputs(texts={path: read_text(path, text_field) for path in args.perplexity})
    if args.lambada:
        inputs.passages = read_passages(args.lambada, text_field)
    if config is not None:
        inputs.rows = config_task_rows(config, args.split)
    return inputs


def harness_measurement(args: argparse.Namespace) -> dict:
    """What an lm-eval result is measured on: recorded with it, and compared before it is replaced."""
    return {"num_fewshot": args.num_fewshot, "limit": args.limit}


def planned_measurements(args: argparse.Namespace, config: FinetuneConfig | None, tasks: list[str]) -> dict:
    """{result name: what it is measured on} for the task and lm-eval results (files have `source`)."""
    planned = {f"{HARNESS}:{task}": harness_measurement(args) for task in tasks}
    if config is not None:
        planned[task_result_name(config, args.split)] = task_measurement(
            config, args.split, args.max_examples
        )
    return planned


def select_task_rows(
    config: FinetuneConfig | None, args: argparse.Namespace, rows: Rows | None, tokenizer, planned: dict
) -> EvaluationRows | None:
    """The rows the config's task scores (each makes an example and a prompt), None without a config."""
    if config is None:
        return None
    max_examples = planned[task_result_name(config, args.split)]["max_examples"]
    new_tokens = config.evaluation.generation.max_new_tokens
    return evaluation_rows(rows, config.task.format(), tokenizer, new_tokens, max_examples)


def evaluate_inputs(
    args: argparse.Namespace,
    config: FinetuneConfig | None,
    inputs: Inputs,
    model,
    tokenizer,
    planned: dict,
) -> dict[str, dict]:
    """The perplexity, LAMBADA and task results. Every input is tokenized and checked first: a bad
    one stops the run before any evaluation has run."""
    positions = getattr(model, "module", model).config.max_position_embeddings
    max_length = args.max_length if args.max_length is not None else positions
    ids = {path: text_tokens(tokenizer, text, path) for path, text in inputs.texts.items()}
    passages = (
        check_passage_tokens(tokenizer, inputs.passages, args.lambada, positions)
        if inputs.passages is not None
        else None
    )
    selected = select_task_rows(config, args, inputs.rows, tokenizer, planned)
    names = {path: result for result, path in result_sources(args).items()}
    column = {"text_field": args.text_field or "text"}  # which column of the file was measured
    results = {
        names[path]: score_perplexity(
            model, tokenizer, text, ids[path], path, max_length=max_length, stride=args.stride
        )
        | column
        for path, text in inputs.texts.items()
    }
    if passages is not None:
        results[names[args.lambada]] = score_lambada(model, passages, args.lambada, positions) | column
    if config is not None:
        name, evaluation = task_result_name(config, args.split), config.evaluation
        scores = score_task(
            model,
            tokenizer,
            selected,
            config.task.format(),
            evaluation.generation,
            batch_size=evaluation.batch_size,
            split=args.split or "validation",
        )
        results[name] = scores | {"measured_on": planned[name]}
    return results


def harness_evaluation(args, model, tokenizer, manager, tasks: list[str]) -> dict[str, dict]:
    output = run_lm_eval(
        model,
        tokenizer,
        manager,
        tasks,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size if args.batch_size is not None else 1,
        limit=args.limit,
    )
    measured_on = harness_measurement(args)
    return {name: entry | {"measured_on": measured_on} for name, entry in harness_results(output).items()}


def with_dtype(results: dict[str, dict], dtype: str) -> dict[str, dict]:
    """Every entry with the dtype its forward passes computed in: a bfloat16 figure is not a float32 one."""
    return {name: entry | {"dtype": dtype} for name, entry in results.items()}


def main(argv: list[str] | None = None) -> dict:
    args, overrides = parse_arguments(argv)
    configure_logging()
    config = load_finetune_config(args.config, overrides) if args.config else None
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()] if args.harness else []
    # The task names are checked before the model loads: a misspelt one costs no evaluation.
    manager = task_manager(tasks, args.include_path) if args.harness else None
    target = results_path(args.model)  # a damaged earlier results file stops us before the evaluations
    refuse_replacing_other_files_results(target, result_sources(args))
    refuse_other_file_settings(target, args)
    refuse_a_window_past_the_model(args)
    planned = planned_measurements(args, config, tasks)
    refuse_other_measurements(target, planned)
    refuse_other_dtype(target, [*result_sources(args), *planned], args.compute_dtype)
    inputs = read_inputs(args, config)
    model, tokenizer = load_model(args)
    results = evaluate_inputs(args, config, inputs, model, tokenizer, planned)
    if manager is not None:
        results |= harness_evaluation(args, model, tokenizer, manager, tasks)
    results = with_dtype(results, args.compute_dtype)
    if rank_and_world()[0] == 0:
        print(results_table(results))  # before saving: a failed write still shows what was measured
    if target is None:
        logger.warning("not saved: --model %s is a preset name, not a checkpoint directory", args.model)
        return results
    # lm-eval names a group's tasks only once it has run them: their measurements and dtype (settled
    # before the model loaded) are checked again for those names, before anything is written
    refuse_other_measurements(target, {n: r["measured_on"] for n, r in results.items() if "measured_on" in r})
    refuse_other_dtype(target, results, args.compute_dtype)
    save_results(target, results)
    if rank_and_world()[0] == 0:
        print(f"written to {target}")
    return results


if __name__ == "__main__":
    exit_on_input_error(main)()
