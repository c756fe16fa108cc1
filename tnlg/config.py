"""Typed run configurations: YAML files with dotted command-line overrides; unknown keys are errors.

    config = load_run_config("configs/pretrain/debug.yaml", ["--train.max_steps", "20", "--zero.stage", "3"])

Every section is a dataclass; a YAML key that is not a field (at any depth) raises naming its
dotted path, and values are checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


@dataclass(kw_only=True)
class ModelSection:
    """`preset` names a `TNLGConfig` preset; `overrides` change any of its fields. `init_from` starts
    from a Transformers checkpoint directory (safetensors) instead of the seeded initialization:
    its config.json is the architecture (`preset` is not used; `overrides` still apply), and each
    rank reads only its shards of the weights."""

    preset: str = "debug"
    overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None


@dataclass(kw_only=True)
class SourceSection:
    """Files (`paths`, globs allowed) or a `datasets` name (`dataset`, a hub name or a local dataset
    directory, with `dataset_config` and `split`), never both."""

    name: str
    paths: list[str] = field(default_factory=list)
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    weight: float = 1.0
    text_field: str = "text"
    pile_set_name: str | None = None


@dataclass(kw_only=True)
class PretokenizedSection:
    """A corpus written by scripts/prepare_data.py (`prefix`.bin/.idx/.json) and its mixture weight."""

    prefix: str
    weight: float = 1.0


@dataclass(kw_only=True)
class DataSection:
    """`pretokenized` corpora when given (the fast path for GPU runs), else streamed `sources`;
    neither means the embedded Python corpus. `tokenizer` "default" means a byte-level BPE trained
    on the embedded corpus with the model's vocabulary size (cached)."""

    pretokenized: list[PretokenizedSection] = field(default_factory=list)
    sources: list[SourceSection] = field(default_factory=list)
    validation_sources: list[SourceSection] = field(default_factory=list)
    tokenizer: str = "default"
    seq_len: int = 128
    shuffle_buffer: int = 256
    on_bad_record: str = "skip"


@dataclass(kw_only=True)
class OptimizerSection:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass(kw_only=True)
class TrainSection:
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = 300
    mixed_precision: str = "no"
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    seed: int = 0
    output_dir: str = "runs/pretrain"
    peak_flops: float | None = None  # per device, for MFU; detected on known GPUs
    on_nonfinite_loss: str = "stop"  # "stop": raise with the step and data position; "skip": drop the step
    resume_fallback: bool = False  # --resume latest: a damaged newest checkpoint gives way to an older one

    def __post_init__(self) -> None:
        if self.on_nonfinite_loss not in ("stop", "skip"):
            raise ValueError(
                f"train.on_nonfinite_loss must be 'stop' or 'skip', got {self.on_nonfinite_loss!r}"
            )


@dataclass(kw_only=True)
class LoggingSection:
    """How often the progress bar shows the metrics, and the Accelerate trackers that record them.

    `trackers: [auto]` means TensorBoard when it is installed, else none; `[]` means none; any
    tracker Accelerate knows (tensorboard, wandb, mlflow, ...) can be named, and one that is not
    installed is an error. Trackers write under `<train.output_dir>/logs/<project>`.
    """

    log_every: int = 10
    trackers: list[str] = field(default_factory=lambda: ["auto"])
    project: str = "tnlg"


@dataclass(kw_only=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    zero: dict[str, Any] = field(
        default_factory=lambda: {"stage": 2}
    )  # ZeroConfig fields, or deepspeed: PATH
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """A `RunConfig` from a YAML file (or the defaults) with `--section.key value` overrides applied."""
    return load_config(RunConfig, path, overrides)


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """A `cls` config (a dataclass of sections) from a YAML file (or the defaults) with overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: a run config must be a mapping of sections")
        raw = loaded or {}
    for dotted, value in _pairs(overrides or []):
        _set_dotted(raw, dotted, yaml.safe_load(value))
    return build(cls, raw, "")


def _pairs(arguments: list[str]) -> list[tuple[str, str]]:
    pairs, index = [], 0
    while index < len(arguments):
        key = arguments[index]
        if not key.startswith("--"):
            raise ValueError(f"expected an override like --train.max_steps 20, got {key!r}")
        if "=" in key:
            name, value = key[2:].split("=", 1)
            index += 1
        else:
            if index + 1 >= len(arguments):
                raise ValueError(f"override {key} has no value")
            name, value = key[2:], arguments[index + 1]
            index += 2
        pairs.append((name, value))
    return pairs


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ValueError(f"override --{dotted}: {part} is not a section")
    target[leaf] = value


def build(cls: type, raw: Any, path: str) -> Any:
    """`cls` (a dataclass) from a mapping, recursively; errors name the dotted path of the key."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(
            f"unknown config key {where}{unknown[0]}; {path or 'the config'} has: {sorted(known)}"
        )
    values = {
        name: _convert(hints[name], value, f"{path}.{name}" if path else name) for name, value in raw.items()
    }
    return cls(**values)


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML reads 1e-3 (no decimal point) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and not (
        isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    ):
        raise ValueError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value
