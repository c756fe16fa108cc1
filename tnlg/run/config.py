"""Typed run configurations: YAML files with dotted command-line overrides; unknown keys are errors.

    config = load_run_config("configs/pretrain/debug.yaml", ["--train.max_steps", "20", "--zero.stage", "3"])

Every section is a dataclass; a YAML key that is not a field (at any depth) raises naming its
dotted path, and values are checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tnlg.data.blend import check_weight
from tnlg.data.sources import BAD_RECORD_POLICIES
from tnlg.modeling import PRESETS, TNLGConfig
from tnlg.run.config_reader import choose, load_config, require
from tnlg.sharding import CompileConfig, DeepSpeedConfig, ParallelDims, ZeroConfig, load_deepspeed
from tnlg.sharding.compile import dotted_options
from tnlg.sharding.config import MIXED_PRECISIONS
from tnlg.sharding.pipeline import schedule_count_problem


@dataclass(kw_only=True)
class ActivationCheckpointingSection:
    """`enabled` recomputes each decoder block's forward during backward instead of keeping its
    activations (forward keeps only every block's input: what the 17B and 530B configs are sized for);
    `cpu_offload` also moves the activations forward keeps, those block inputs first, to host memory
    until backward needs them (tnlg.run.activations)."""

    enabled: bool = False
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        # Without recomputation, offloading would copy every activation of every block across PCIe:
        # not what the option is for, and a setting that is more likely a typo than a choice.
        if self.cpu_offload and not self.enabled:
            raise ValueError(
                "model.activation_checkpointing.cpu_offload needs model.activation_checkpointing.enabled: "
                "true (it offloads the activations that checkpointing keeps)"
            )


@dataclass(kw_only=True)
class CompileSection:
    """`enabled` compiles each decoder block with torch.compile inside the engine (never the whole model;
    see [Note: compiled blocks] in tnlg/sharding/compile.py), with torch.compile's `backend`, `mode`,
    `fullgraph`, `dynamic` and `options` (inductor's settings, `torch._inductor.list_options()`, by their
    dotted names or nested: `triton: {cudagraphs: true}`; a mode or options, not both; a mode only with
    backend inductor, and no options with the debugging backends, which ignore them). `cache_dir` is
    where inductor keeps the compiled graphs, so that a resumed run reads them and skips most of the
    compiling; by default `compile_cache` in the run's output directory. It is set for the whole process, as inductor's cache is (its `TORCHINDUCTOR_CACHE_DIR`)."""

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.enabled:
            self.settings(Path("."))  # an unknown backend, mode or option is named when the config is read
            return
        given = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "enabled" and getattr(self, f.name) != _default(f)
        ]
        if given:
            # A setting that would not be applied is more likely a forgotten `enabled` than a choice.
            raise ValueError(
                f"model.compile.{given[0]} is set but model.compile.enabled is false: set it to true to compile"
            )

    def settings(self, output_dir: Path) -> CompileConfig | None:
        """The engine's CompileConfig (None when off), the cache under `output_dir` unless given."""
        if not self.enabled:
            return None
        cache_dir = self.cache_dir if self.cache_dir is not None else str(output_dir / "compile_cache")
        return CompileConfig(
            backend=self.backend,
            mode=self.mode,
            fullgraph=self.fullgraph,
            dynamic=self.dynamic,
            options=dotted_options(self.options),
            cache_dir=cache_dir,
        )


def _default(field_: dataclasses.Field) -> Any:
    """A dataclass field's default value, whether given as a value or made by a factory."""
    if field_.default_factory is not dataclasses.MISSING:
        return field_.default_factory()
    return field_.default


@dataclass(kw_only=True)
class ModelSection:
    """`preset` names a `TNLGConfig` preset; `overrides` change any of its fields. `init_from` starts
    from a Transformers checkpoint directory (safetensors) instead of the seeded initialization:
    its config.json is the architecture (`preset` is not used; `overrides` still apply), and each
    rank reads only its shards of the weights. `activation_checkpointing` trades recomputation for
    activation memory, `compile` compiles each decoder block (see their sections)."""

    preset: str = "debug"
    overrides: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    activation_checkpointing: ActivationCheckpointingSection = field(
        default_factory=ActivationCheckpointingSection
    )
    compile: CompileSection = field(default_factory=CompileSection)

    def __post_init__(self) -> None:
        choose("model.preset", self.preset, tuple(sorted(PRESETS)))
        check_model_overrides(self.overrides)


def check_model_overrides(overrides: dict[str, Any]) -> None:
    """Every `model.overrides` key must be a TNLGConfig attribute: Transformers' config keeps an unknown
    keyword as an extra attribute, so a misspelt field would be written to config.json and never used."""
    known = sorted(TNLGConfig().to_dict())
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = (
                f"did you mean model.overrides.{close[0]}?" if close else "TNLGConfig().to_dict() lists them"
            )
            raise ValueError(f"model.overrides.{key} is not a TNLGConfig field ({hint})")


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

    def __post_init__(self) -> None:
        check_weight(f"source {self.name!r}", self.weight)
        if not self.paths:
            return
        # Files have no splits or builder configs: a value here would be silently not applied.
        if self.split != "train":
            raise ValueError(
                f"source {self.name!r}: split {self.split!r} names a split of a dataset, but the source reads "
                "files (paths): remove split, or give the split's files as the paths"
            )
        if self.dataset_config is not None:
            raise ValueError(
                f"source {self.name!r}: dataset_config {self.dataset_config!r} configures a dataset, but the "
                "source reads files (paths): remove it"
            )


@dataclass(kw_only=True)
class PretokenizedSection:
    """A corpus written by scripts/prepare_data.py (`prefix`.bin/.idx/.json) and its mixture weight."""

    prefix: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        check_weight(f"data.pretokenized {self.prefix!r}", self.weight)


@dataclass(kw_only=True)
class DataSection:
    """`pretokenized` corpora when given (the fast path for GPU runs), else streamed `sources`;
    neither means the embedded Python corpus. `tokenizer` "default" means `model.init_from`'s own
    tokenizer when it has one, else a byte-level BPE trained on the embedded corpus with the model's
    vocabulary size (cached; tnlg.run.build)."""

    pretokenized: list[PretokenizedSection] = field(default_factory=list)
    sources: list[SourceSection] = field(default_factory=list)
    validation_sources: list[SourceSection] = field(default_factory=list)
    tokenizer: str = "default"
    seq_len: int = 128
    shuffle_buffer: int = 256
    on_bad_record: str = "skip"

    def __post_init__(self) -> None:
        require("data.seq_len", self.seq_len, self.seq_len >= 1, ">= 1")
        require("data.shuffle_buffer", self.shuffle_buffer, self.shuffle_buffer >= 1, ">= 1")
        choose("data.on_bad_record", self.on_bad_record, BAD_RECORD_POLICIES)
        for name, sources in (
            ("data.sources", self.sources),
            ("data.validation_sources", self.validation_sources),
        ):
            # a data position is saved per source name: checked here, not once the engine is built
            names = [source.name for source in sources]
            twice = sorted({n for n in names if names.count(n) > 1})
            require(f"{name} names", names, not twice, f"unique (named more than once: {twice})")
        if self.pretokenized:
            self._check_pretokenized_alone()

    @property
    def has_validation_text(self) -> bool:
        """Whether a run evaluates on validation text: the configured validation sources, or the embedded
        corpus's when no corpus is configured (a configured corpus without validation sources is not
        evaluated on unrelated text)."""
        return bool(self.validation_sources) or not (self.sources or self.pretokenized)

    def _check_pretokenized_alone(self) -> None:
        """With `pretokenized`, what only streamed sources use would be silently not applied. A setting
        equal to its default cannot be told from an unset one (and changes nothing): it is let through."""
        if self.sources:
            raise ValueError(
                "data.sources and data.pretokenized are both given, but a run reads one or the other: remove "
                "data.sources, or prepare them with scripts/prepare_data.py and list them in data.pretokenized"
            )
        if self.shuffle_buffer != DataSection.shuffle_buffer:
            raise ValueError(
                f"data.shuffle_buffer {self.shuffle_buffer} shuffles streamed data.sources; data.pretokenized "
                "corpora are sampled by their own shuffled index: remove it"
            )
        if self.on_bad_record != DataSection.on_bad_record and not self.validation_sources:
            raise ValueError(
                f"data.on_bad_record {self.on_bad_record!r} applies to streamed sources, and with "
                "data.pretokenized and no data.validation_sources none is streamed: remove it"
            )


@dataclass(kw_only=True)
class OptimizerSection:
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`."""

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        # math.isfinite first: every comparison with nan is False, and inf passes `>= 0`
        lr, decay = self.lr, self.weight_decay
        require("optimizer.lr", lr, math.isfinite(lr) and lr >= 0, ">= 0 and finite (0 freezes the weights)")
        require("optimizer.weight_decay", decay, math.isfinite(decay) and decay >= 0, ">= 0 and finite")
        require(
            "optimizer.betas",
            self.betas,
            len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas),
            "two numbers in [0, 1), e.g. [0.9, 0.95]",
        )
        require("optimizer.eps", self.eps, math.isfinite(self.eps) and self.eps > 0, "> 0 and finite")
        require("optimizer.warmup_steps", self.warmup_steps, self.warmup_steps >= 0, ">= 0")
        require("optimizer.min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]")


@dataclass(kw_only=True)
class TrainSection:
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = 300
    mixed_precision: str = "no"
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 0  # checkpoint cadence in steps; 0: none (the final model is still written to model/)
    keep_last: int = 2
    seed: int = 0
    output_dir: str = "runs/pretrain"
    peak_flops: float | None = None  # per device, for MFU; detected on known GPUs
    on_nonfinite_loss: str = "stop"  # "stop": raise with the step and data position; "skip": drop the step
    resume_fallback: bool = False  # --resume latest: a damaged newest checkpoint gives way to an older one
    # A new run refuses an output_dir that already holds a run's files (checkpoints, model, loss
    # curve) unless it resumes (--resume) or this is true, which deletes them first.
    overwrite: bool = False
    # Also write the final model as a plain GPT2LMHeadModel directory (model-gpt2/, see
    # tnlg.tools.convert.to_gpt2): what lm-eval, vLLM, TGI and llama.cpp load with no tnlg installed.
    export_gpt2: bool = False
    # How long a collective may wait for the other ranks before the run is aborted (the world process
    # group's timeout, which every group the engine opens takes too): raise it when one rank can be much
    # later than the others, as while a large checkpoint is written or a first compiled step compiles.
    # None: torch's default for the backend (10 minutes on NCCL, 30 on gloo).
    collective_timeout_minutes: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "micro_batch_size",
            "gradient_accumulation_steps",
            "max_steps",
            "eval_batches",
            "keep_last",
        ):
            value = getattr(self, name)
            require(f"train.{name}", value, value >= 1, ">= 1")
        for name in ("eval_every", "save_every"):
            value = getattr(self, name)
            require(f"train.{name}", value, value >= 0, ">= 0 (0: never)")
        # Checked here, not where numpy or torch would refuse it after the model is built; below 2**32 so
        # that every generator the run seeds takes it, and the fine-tuning shuffle's derived seed
        # (seed * 1_000_003 + epoch, tnlg/data/finetune.py) fits torch's 64 bits.
        require("train.seed", self.seed, 0 <= self.seed < 2**32, "an integer in [0, 2**32)")
        choose("train.mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        choose("train.on_nonfinite_loss", self.on_nonfinite_loss, ("stop", "skip"))
        if self.peak_flops is not None:
            require("train.peak_flops", self.peak_flops, self.peak_flops > 0, "> 0")
        if self.collective_timeout_minutes is not None:
            minutes = self.collective_timeout_minutes
            require(
                "train.collective_timeout_minutes",
                minutes,
                math.isfinite(minutes) and minutes > 0,
                "a finite number > 0",
            )


@dataclass(kw_only=True)
class ParallelSection:
    """The layout beyond data parallelism (see [Note: parallel layout] in sharding/parallel.py): `tensor`
    slices every layer across that many consecutive ranks, `pipeline` cuts the layers into stages; the data
    degree is what is left of the world (`--parallel.tensor 2` on 4 processes: 2 data replicas).
    `virtual_stages` > 1 gives each pipeline rank that many stages, run by the interleaved 1F1B schedule
    (fewer idle steps at the start and end of each step, for more messages between the ranks)."""

    tensor: int = 1
    pipeline: int = 1
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        self._checked_dims()  # ParallelDims checks the degrees, here and for the engine alike

    def _checked_dims(self) -> ParallelDims:
        try:
            return ParallelDims(
                tensor=self.tensor, pipeline=self.pipeline, virtual_stages=self.virtual_stages
            )
        except ValueError as error:  # named as this section's keys
            raise ValueError(str(error).replace("ParallelDims.", "parallel.")) from None

    def dims(self) -> ParallelDims | None:
        """The engine's layout, or None for data parallelism alone."""
        if self.tensor == 1 and self.pipeline == 1:
            return None
        return self._checked_dims()

    def check_schedule(self, key: str, batches: int, rows: int) -> None:
        """Under pipeline stages, that `batches` batches of `rows` rows (`key`: a step's batches or an
        evaluation's) make micro-batches the schedule runs, once `pipeline_parts` has cut them: rows the cut
        divides, and a count torch's schedule takes. Checked when the config is read, since a step's
        schedule is built at step 1 and an evaluation's only at the first evaluation, after steps that may
        not have been saved."""
        if self.pipeline == 1:
            return
        parts = pipeline_parts(batches, self.pipeline)
        if rows % parts:
            raise ValueError(
                f"{key} {batches} with parallel.pipeline {self.pipeline}: each batch is cut into {parts} equal parts "
                f"to give the schedule {self.pipeline} micro-batches, but train.micro_batch_size {rows} is not a "
                f"multiple of {parts}: make it one, or {key} at least {self.pipeline}"
            )
        problem = schedule_count_problem(batches * parts, self.pipeline, self.virtual_stages)
        if problem is not None:  # only with virtual_stages > 1: the cut gives 1F1B at least `pipeline`
            raise ValueError(
                f"parallel.virtual_stages {self.virtual_stages} with {key} {batches}: {problem}; set {key} to such "
                "a count"
            )


def pipeline_parts(batches: int, pipeline: int) -> int:
    """Into how many equal parts each of `batches` batches is cut so that one pipeline schedule gets at
    least `pipeline` micro-batches (1: none is cut). `tnlg.run.loop.pipeline_micro_batches` cuts so, and
    `ParallelSection.check_schedule` checks what the cut gives when the config is read: the one place of
    the arithmetic for both."""
    return -(-pipeline // batches)  # ceil


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

    def __post_init__(self) -> None:
        require("logging.log_every", self.log_every, self.log_every >= 1, ">= 1")


# A run's ZeRO stage when neither its config nor a DeepSpeed JSON names one: stage 2 shards gradients
# and optimizer state at no extra communication over data parallelism (ZeroConfig's own default, 0, is
# the engine's "shard nothing" starting point, not a sensible run).
RUN_DEFAULT_STAGE = 2


class _ZeroSectionBase:
    """The run's `zero` section: `ZeroConfig`'s fields (see tnlg.sharding.config), each unset (None) unless
    the YAML or an override gives it, plus `deepspeed: PATH` for a DeepSpeed-style JSON.

    Unset fields take ZeroConfig's defaults, except `stage` (RUN_DEFAULT_STAGE). With `deepspeed`, the
    JSON gives the settings and a field set here as well must agree with it: a disagreement is an error
    naming both, never a silent winner. `mixed_precision` is not a field: it is `train.mixed_precision`.
    """

    deepspeed: str | None
    moved_keys = {"mixed_precision": "train.mixed_precision"}

    def __post_init__(self) -> None:
        # every value checked when the config is read, not mid-run; the dtype keys against the run's
        # precision once train.mixed_precision is known (TrainingConfig)
        self.engine_settings(None)

    def explicit(self) -> dict[str, Any]:
        """The ZeroConfig fields this section sets."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if f.name != "deepspeed" and getattr(self, f.name) is not None
        }

    def to_zero_config(self, mixed_precision: str) -> ZeroConfig:
        """The engine's config for a run at `mixed_precision` (train.mixed_precision)."""
        return self.engine_settings(mixed_precision).zero

    def engine_settings(self, mixed_precision: str | None) -> DeepSpeedConfig:
        """What `ZeroAccelerator(zero_config=...)` takes: the ZeroConfig and, with `deepspeed`, the JSON's
        training keys (its gradient accumulation and batch sizes, which the accelerator checks against
        train.gradient_accumulation_steps and the world size). `mixed_precision` None: the section alone,
        before the run's precision is known (the JSON's dtype keys then wait for it)."""
        explicit = self.explicit()
        if self.deepspeed is None:
            try:
                zero = ZeroConfig(
                    **{"stage": RUN_DEFAULT_STAGE, **explicit, "mixed_precision": mixed_precision or "no"}
                )
            except ValueError as error:
                raise ValueError(f"zero: {error}") from error
            return DeepSpeedConfig(zero, source="the run config's zero section")
        # A JSON that names no stage means DeepSpeed's 0 to DeepSpeed; to a run, the run's stage (its
        # own default unless zero.stage says), applied before the JSON's fields are checked together.
        defaults = {"stage": explicit.get("stage", RUN_DEFAULT_STAGE)}
        auto = {"mixed_precision": mixed_precision} if mixed_precision else {}
        settings = load_deepspeed(self.deepspeed, defaults=defaults, **auto).with_overrides(
            explicit, {name: f"zero.{name}" for name in explicit}
        )
        if mixed_precision is not None:
            given = f"train.mixed_precision {mixed_precision}"
            settings = settings.with_mixed_precision(mixed_precision, given).with_checked_dtypes(given)
        # A run builds its AdamW and warmup-cosine schedule from the optimizer section; a second one from
        # the JSON would be ignored or would fight it.
        for section in ("optimizer", "scheduler"):
            if getattr(settings.training, section) is not None:
                raise ValueError(
                    f"{self.deepspeed} has a {section!r} section, but a run builds its optimizer and schedule "
                    f"from the run config's optimizer section: remove it from the JSON"
                )
        return settings


ZeroSection = dataclasses.make_dataclass(
    "ZeroSection",
    [("deepspeed", str | None, field(default=None))]
    + [
        (f.name, hint | None, field(default=None))
        for f in dataclasses.fields(ZeroConfig)
        if f.name != "mixed_precision"
        for hint in [typing.get_type_hints(ZeroConfig)[f.name]]
    ],
    bases=(_ZeroSectionBase,),
    kw_only=True,
)
ZeroSection.__module__ = __name__  # make_dataclass's `module` argument needs Python 3.12


@dataclass(kw_only=True)
class TrainingConfig:
    """The sections every training run has (tnlg.run.loop reads only these); `RunConfig` (pretraining)
    and `FinetuneConfig` (tnlg.run.finetune_config) add their data and what else their job needs."""

    model: ModelSection = field(default_factory=ModelSection)
    zero: ZeroSection = field(default_factory=ZeroSection)  # type: ignore[valid-type]
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        train = self.train
        self.parallel.check_schedule(
            "train.gradient_accumulation_steps", train.gradient_accumulation_steps, train.micro_batch_size
        )
        self.zero.engine_settings(train.mixed_precision)  # the DeepSpeed JSON's dtypes at the run's precision

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class RunConfig(TrainingConfig):
    """A pretraining run: the shared sections plus the corpus (`data`)."""

    data: DataSection = field(default_factory=DataSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train.eval_every and self.data.has_validation_text:
            self.parallel.check_schedule(
                "train.eval_batches", self.train.eval_batches, self.train.micro_batch_size
            )


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """A `RunConfig` from a YAML file (or the defaults) with `--section.key value` overrides applied."""
    return load_config(RunConfig, path, overrides)
