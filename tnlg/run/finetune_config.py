"""The fine-tuning run config: the pretraining sections (model, zero, optimizer, train, logging) plus
the task, its data, LoRA and the generation-based evaluation. Same YAML + `--section.key value`
overrides as pretraining (tnlg.run.config), with unknown keys refused by their dotted path.

    config = load_finetune_config("configs/finetune/summarization.yaml", ["--train.max_steps", "50"])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tnlg.data.finetune import BUILDERS, EMBEDDED_PREFIX, is_saved_dataset
from tnlg.data.tasks import TaskFormat
from tnlg.inference.settings import GenerationSettings, setting_problems
from tnlg.run.config import LoggingSection, TrainingConfig, TrainSection
from tnlg.run.config_reader import load_config, require

# The projections LoRA adapts by default: every Linear of the attention and MLP blocks (the output
# layer is tied to the embedding and left alone).
DEFAULT_LORA_TARGETS = ("qkv_proj", "out_proj", "fc_in", "fc_out")
EMBEDDED_DEFAULT = "embedded:docstrings"

FILE_BUILDERS = frozenset(BUILDERS.values())  # the datasets builders that read data files by format


@dataclass(kw_only=True)
class TaskSection:
    """A `tnlg.data.tasks.TaskFormat`: the task kind, the dataset's column names for its fields,
    prompt / target templates (default: the kind's), and how a long example is cut."""

    kind: str = "summarization"
    columns: dict[str, str] = field(default_factory=dict)
    prompt_template: str | None = None
    target_template: str | None = None
    max_length: int = 512
    truncation_side: str = "right"
    add_eos: bool = True

    def format(self) -> TaskFormat:
        return TaskFormat(**dataclasses.asdict(self))

    def __post_init__(self) -> None:
        # validates the kind, the columns, the truncation side and a prompt without the target now, not mid-run
        self.format()


@dataclass(kw_only=True)
class FinetuneDataSection:
    """Where the examples come from: `dataset` (a hub name when reachable, a local `save_to_disk`
    directory, a `datasets` builder such as json/csv/parquet used with `paths`, or an embedded set:
    "embedded:docstrings", "embedded:qa") or local `paths` alone (the builder from their extension);
    neither means the embedded docstring set with its validation split. `validation_split` names the
    held-out split of the same source; `validation_paths` are files.

    `packing` puts several examples in each `task.max_length` row, each attending only to itself
    (positions restart per example); otherwise batches are padded to their longest example.
    `on_long_example`: "stop" refuses the first row that cannot make an example (its target does not
    fit; a field that is null, not text or empty; a SQuAD row without answers; an extractive-QA answer
    that cannot fit the room left for its context), naming its file and row; "skip" drops such rows,
    counted by reason in the log.
    """

    dataset: str | None = None
    dataset_config: str | None = None
    paths: list[str] = field(default_factory=list)
    split: str = "train"
    validation_split: str | None = None
    validation_paths: list[str] = field(default_factory=list)
    max_examples: int | None = None
    tokenizer: str = "default"
    packing: bool = False
    on_long_example: str = "stop"

    def __post_init__(self) -> None:
        if self.dataset is None and not self.paths:  # neither: the embedded docstring set
            self.dataset = EMBEDDED_DEFAULT
            if self.validation_split is None and not self.validation_paths:
                self.validation_split = "validation"
        if self.validation_split and self.validation_paths:
            raise ValueError(
                f"data.validation_split {self.validation_split!r} and data.validation_paths are both given, and "
                "the files would be read in place of the split: give one of them (--data.validation_split null "
                "to hold out the files instead of a config's split)"
            )
        if self.paths:
            self._check_paths_alone()
        if self.dataset_config is not None:
            self._check_dataset_config()
        if self.on_long_example not in ("stop", "skip"):
            raise ValueError(f"data.on_long_example must be 'stop' or 'skip', got {self.on_long_example!r}")
        if self.max_examples is not None:
            require(
                "data.max_examples", self.max_examples, self.max_examples >= 1, ">= 1 (or null: every row)"
            )

    def _check_paths_alone(self) -> None:
        """Files have no splits, and an embedded set is read instead of them: such a setting would be
        silently not applied."""
        if self.validation_split:
            raise ValueError(
                "data.validation_split names a split of data.dataset; files in data.paths have none: give "
                "the held-out files as data.validation_paths"
            )
        if self.split != FinetuneDataSection.split:
            raise ValueError(
                f"data.split {self.split!r} names a split of data.dataset; files in data.paths have none, so "
                "all of them are read: remove data.split, or give that split's files as data.paths"
            )
        if self.dataset is not None and self.dataset.startswith(EMBEDDED_PREFIX):
            raise ValueError(
                f"data.dataset {self.dataset!r} is an embedded set, read instead of data.paths: give one or the other"
            )

    def _check_dataset_config(self) -> None:
        """A `dataset_config` names a configuration of a `datasets` dataset (cnn_dailymail's "3.0.0");
        files read by their format's builder and the embedded sets have none, so it would be ignored."""
        if self.dataset is None:  # data.paths alone
            reader = "data files read by their format's builder have"
        elif self.dataset.startswith(EMBEDDED_PREFIX):
            reader = f"the embedded set {self.dataset!r} has"
        elif self.dataset in FILE_BUILDERS:
            reader = f"data files read by the {self.dataset} builder have"
        elif is_saved_dataset(self.dataset):
            reader = f"{self.dataset}, a dataset saved with save_to_disk (read whole by load_from_disk), has"
        else:
            return
        raise ValueError(
            f"data.dataset_config {self.dataset_config!r} names a configuration of a datasets dataset, and "
            f"{reader} none: remove data.dataset_config"
        )


@dataclass(kw_only=True)
class LoraSection:
    """LoRA through peft: low-rank adapters on `target_modules`, the model's own weights frozen."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))

    def __post_init__(self) -> None:
        if not self.enabled:
            _refuse_settings_while_off(self, "lora")
            return
        require("lora.r", self.r, self.r >= 1, ">= 1")
        require("lora.alpha", self.alpha, self.alpha > 0, "> 0")
        require("lora.dropout", self.dropout, 0 <= self.dropout < 1, "in [0, 1)")
        require("lora.target_modules", self.target_modules, bool(self.target_modules), "a non-empty list")


def _refuse_settings_while_off(section: Any, name: str) -> None:
    """A setting of a section that is not enabled would not be applied: more likely a forgotten
    `enabled` than a choice (as model.compile refuses)."""
    for f in dataclasses.fields(section):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name != "enabled" and getattr(section, f.name) != default:
            raise ValueError(f"{name}.{f.name} is set but {name}.enabled is false: set it to true to use it")


@dataclass(kw_only=True)
class EvaluationSection:
    """The task metric (ROUGE for summarization, SQuAD EM/F1 for QA) on up to `max_examples`
    validation examples, generated `batch_size` at a time on each rank; `before_training` scores
    the starting model too."""

    max_examples: int = 64
    batch_size: int = 8
    before_training: bool = False
    after_training: bool = True
    generation: GenerationSettings = field(default_factory=GenerationSettings)  # greedy, beams, sampling

    def __post_init__(self) -> None:
        # checked when the config is read: a bad value found only after training would waste the run
        require("evaluation.max_examples", self.max_examples, self.max_examples >= 1, ">= 1")
        require("evaluation.batch_size", self.batch_size, self.batch_size >= 1, ">= 1")
        check_generation(self.generation, "evaluation.generation")


def check_generation(settings: GenerationSettings, name: str) -> None:
    """The decoding settings' ranges, as Transformers' GenerationConfig would refuse them mid-run, and
    no sampling setting without do_sample (one list: `setting_problems` in tnlg/inference/settings.py)."""
    for field_name, value, expected in setting_problems(settings):
        require(f"{name}.{field_name}", value, False, expected)


@dataclass(kw_only=True)
class FinetuneConfig(TrainingConfig):
    """A fine-tuning run: the shared sections plus the task, its data, LoRA and the evaluation."""

    task: TaskSection = field(default_factory=TaskSection)
    data: FinetuneDataSection = field(default_factory=FinetuneDataSection)
    lora: LoraSection = field(default_factory=LoraSection)
    train: TrainSection = field(default_factory=lambda: TrainSection(output_dir="runs/finetune"))
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(project="finetune"))

    def __post_init__(self) -> None:
        self._check_generation_room()
        if self.lora.enabled and self.parallel.tensor > 1:
            # peft wraps the whole model's Linear layers; tensor slicing cuts them afterwards, and the
            # adapters of the sliced layers are left out of the graph on some ranks (backward fails)
            raise ValueError(
                f"lora.enabled with parallel.tensor {self.parallel.tensor}: LoRA adapters are not tensor-sliced; "
                "fine-tune with LoRA on data parallelism (parallel.tensor 1, a ZeRO stage to save memory), or "
                "without LoRA under tensor slicing"
            )
        if self.parallel.pipeline > 1:
            # Task examples are padded (an attention mask the stages cannot carry), and the evaluation
            # generates with the whole model, which no rank holds under pipeline stages.
            raise ValueError(
                f"parallel.pipeline {self.parallel.pipeline}: fine-tuning runs with data parallelism and tensor "
                "slicing only (padded examples and generation need the whole model); pipeline stages are for "
                "pretraining. Use parallel.tensor to cut a model too large for one rank"
            )

    def _check_generation_room(self) -> None:
        """A generation prompt is cut to leave `max_new_tokens` of `task.max_length`: with less than a
        2-token prompt left, the evaluation after training would fail (here, before training)."""
        new_tokens, max_length = self.evaluation.generation.max_new_tokens, self.task.max_length
        room = max(max_length - new_tokens, 0)
        if room < 2:
            raise ValueError(
                f"evaluation.generation.max_new_tokens {new_tokens} leaves {room} token{'' if room == 1 else 's'} "
                f"of task.max_length {max_length} for the prompt, which needs at least 2 (and room for the "
                "prompt template and some of the document or context): lower evaluation.generation.max_new_tokens "
                "or raise task.max_length"
            )


def load_finetune_config(path: str | Path | None, overrides: list[str] | None = None) -> FinetuneConfig:
    return load_config(FinetuneConfig, path, overrides)
