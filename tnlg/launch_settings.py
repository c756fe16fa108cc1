"""What a launch tells tnlg's engine, read as Accelerate reads it: the `TNLG_ZERO_*` environment that
selects the engine, the accumulation steps and mixed precision the Accelerator will run at, a
`GradScalerKwargs` handler's loss scale, Accelerate's `ParallelismConfig` and its dynamo settings, each
turned into the engine's typed settings (or refused, naming both sides) before the engine is built.
`ZeroAccelerator` (tnlg/accelerate.py) and `ZeroTrainer` settle their inputs here."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from accelerate.utils import DynamoBackend, GradScalerKwargs, TorchDynamoPlugin, parse_choice_from_env

from tnlg.sharding import CompileConfig, DeepSpeedConfig, ParallelDims, ZeroConfig
from tnlg.sharding.deepspeed import engine_settings

ENV_CONFIG, ENV_STAGE = "TNLG_ZERO_CONFIG", "TNLG_ZERO_STAGE"


def zero_config_from_environment(mixed_precision: str | None = None) -> ZeroConfig | None:
    """The ZeroConfig a launch selected through `TNLG_ZERO_*` variables, or None."""
    settings = settings_from_environment({"mixed_precision": mixed_precision} if mixed_precision else {})
    return settings.with_checked_dtypes().zero if settings is not None else None


# Variables that shape the engine TNLG_ZERO_STAGE selects; a TNLG_ZERO_CONFIG JSON states these itself.
STAGE_VARIABLES = (
    "TNLG_ZERO_GRADIENT_CLIPPING",
    "TNLG_ZERO_OVERLAP_COMM",
    "TNLG_ZERO_OFFLOAD_OPTIMIZER",
    "TNLG_ZERO_OFFLOAD_PARAM",
)


def _set_variables() -> dict[str, str]:
    """The `TNLG_ZERO_*` variables set to something (a stage of "none" selects nothing)."""
    found = {}
    for name in (ENV_CONFIG, ENV_STAGE, *STAGE_VARIABLES):
        value = os.environ.get(name)
        if (
            value is not None
            and value.strip()
            and not (name == ENV_STAGE and value.strip().lower() == "none")
        ):
            found[name] = value
    return found


def environment_selection() -> str | None:
    """`NAME=value` of the first `TNLG_ZERO_*` variable set (the config, the stage, then the variables
    that shape the stage), or None."""
    found = _set_variables()
    return next((f"{name}={value}" for name, value in found.items()), None)


def from_environment(settings: Any) -> bool:
    """Whether `settings` (a DeepSpeedConfig) are what the `TNLG_ZERO_*` variables selected, as a front
    door (ZeroTrainer) that read them passes them on."""
    return isinstance(settings, DeepSpeedConfig) and settings.source in (
        ENV_STAGE,
        os.environ.get(ENV_CONFIG),
    )


def refuse_environment_beside(given: str, remedy: str) -> None:
    """ValueError when a `TNLG_ZERO_*` variable is set while `given` (how the caller names its own
    settings) states the engine's settings: the variable would be silently ignored. `remedy`: the
    caller's other way on, after "unset the variable"."""
    selected = environment_selection()
    if selected is not None:
        raise ValueError(
            f"{selected} is set, but {given} states the ZeRO engine's settings and the variable would be "
            f"ignored: unset {selected.split('=', 1)[0]}, or {remedy}"
        )


def settings_from_environment(auto: dict[str, Any]) -> DeepSpeedConfig | None:
    """The engine settings a launch selected through `TNLG_ZERO_*` variables (with a JSON's training
    part), or None; `auto` fills a DeepSpeed JSON's "auto" values. A variable that the others would
    leave unread (a stage beside a JSON, an offload without a stage) is an error naming it."""
    found = _set_variables()
    path = found.get(ENV_CONFIG)
    if path:
        ignored = [name for name in found if name != ENV_CONFIG]
        if ignored:
            raise ValueError(
                f"{ENV_CONFIG}={path} gives the engine's settings whole, so {', '.join(ignored)} would be "
                "ignored: state them in the JSON, and unset them"
            )
        return engine_settings(path, **auto)
    if ENV_STAGE not in found and found:
        raise ValueError(
            f"{', '.join(found)} shape the engine {ENV_STAGE} selects, and it is not set: set it too "
            "(e.g. TNLG_ZERO_STAGE=2), or unset them"
        )
    if ENV_STAGE not in found:
        return None
    fields: dict[str, Any] = {"stage": _parse_int(ENV_STAGE, found[ENV_STAGE])}
    if "TNLG_ZERO_GRADIENT_CLIPPING" in found:
        fields["gradient_clipping"] = float(found["TNLG_ZERO_GRADIENT_CLIPPING"])
    if "TNLG_ZERO_OVERLAP_COMM" in found:
        fields["overlap_comm"] = found["TNLG_ZERO_OVERLAP_COMM"].lower() in ("1", "true", "yes")
    for name in ("offload_optimizer", "offload_param"):
        if f"TNLG_ZERO_{name.upper()}" in found:
            fields[name] = found[f"TNLG_ZERO_{name.upper()}"].lower()
    if auto.get("mixed_precision"):
        fields["mixed_precision"] = auto["mixed_precision"]
    return DeepSpeedConfig(ZeroConfig(**fields), source=ENV_STAGE)


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def refuse_launch_accumulation_beside(steps: int, given: str) -> None:
    """ValueError when `accelerate launch --gradient_accumulation_steps` (its environment variable, which
    beats the Accelerator's argument) differs from `steps`, which `given` states: the Accelerator would
    sync at one count while the caller feeds micro-batches at the other."""
    launched = given_accumulation({"gradient_accumulation_steps": steps})
    if launched != steps:
        raise ValueError(
            f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={launched} (accelerate launch --gradient_accumulation_steps) "
            f"conflicts with {given} {steps}: make them agree, or launch without the flag"
        )


def given_accumulation(given: Mapping[str, Any]) -> int | None:
    """The accumulation steps the Accelerator was given (as it reads them), or None if none were."""
    plugin = given.get("gradient_accumulation_plugin")
    if plugin is not None:
        return plugin.num_steps
    if os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):  # `accelerate launch`; beats the argument
        return _parse_int(
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]
        )
    return given.get("gradient_accumulation_steps")


def accumulation_taken_over(
    settings: DeepSpeedConfig, given: int | None, running: int, replicas: int
) -> tuple[DeepSpeedConfig, int]:
    """The Accelerator accumulates (see tnlg/accelerate.py): it adopts the steps the config sets or implies,
    refuses different ones it was `given`, checks the batch keys against the `replicas` (the data-parallel
    size: tensor slices and pipeline stages of one replica read the same samples), and leaves the engine an
    accumulation of 1 (no double accumulation). Returns the engine's settings and the Accelerator's steps
    (the config's, else the `running` ones)."""
    training = settings.training
    implied = training.implied_accumulation(replicas)
    steps = implied if implied is not None else running
    dataclasses.replace(settings, training=training.replace(gradient_accumulation_steps=steps)).batch_sizes(
        replicas
    )
    if implied is not None and given is not None and implied != given:
        raise ValueError(
            f"gradient accumulation: {settings.source} sets {implied} steps but the Accelerator was given "
            f"gradient_accumulation_steps={given}: change one of them to agree with the other"
        )
    engine = training.replace(gradient_accumulation_steps=1, train_batch_size=None)
    return dataclasses.replace(settings, training=engine), steps


def launch_mixed_precision(given: Mapping[str, Any]) -> tuple[str, str]:
    """The mixed precision Accelerate itself will run at (the keyword, else `ACCELERATE_MIXED_PRECISION`,
    which `accelerate launch --mixed_precision` and `accelerate config` set), and how to name it in errors.
    Read before the engine settings are made, so that the launcher's value fills and checks them."""
    keyword = given.get("mixed_precision")
    if keyword is not None:
        value = keyword.lower()
        return value, f"the Accelerator's mixed_precision={value!r}"
    value = parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "no").lower()
    return (
        value,
        f"ACCELERATE_MIXED_PRECISION={value} (accelerate launch --mixed_precision / accelerate config)",
    )


def refuse_another_state_precision(running: Any, resolved: str) -> None:
    """Accelerate's shared state, made by an earlier Accelerator, keeps that one's mixed precision: the
    engine was set up for `resolved`, so a different one would autocast around an engine of another dtype."""
    running = str(getattr(running, "value", running)).lower()
    if running != resolved:
        raise ValueError(
            f"Accelerate's state already runs at mixed_precision={running!r} (an earlier Accelerator set it) but "
            f"this ZeroAccelerator was set up for {resolved!r}: pass mixed_precision={running!r} or reset "
            "Accelerate's state first"
        )


# The loss-scale fields a GradScalerKwargs handler sets, as ZeroConfig fields and the DeepSpeed keys for them.
_SCALER_FIELDS = {"init_scale": "initial_loss_scale", "growth_interval": "loss_scale_window"}
_SCALER_FIXED = {"growth_factor": 2.0, "backoff_factor": 0.5, "enabled": True}
_LOSS_SCALE_KEYS = (
    "ZeroConfig initial_loss_scale / loss_scale_window (DeepSpeed JSON fp16.initial_scale_power / "
    "fp16.loss_scale_window)"
)


def with_grad_scaler_kwargs(settings: DeepSpeedConfig, given: Mapping[str, Any]) -> DeepSpeedConfig:
    """`settings` with a `GradScalerKwargs` handler applied to the engine's fp16 loss scaler, which plays
    the GradScaler's part: init_scale is its initial scale, growth_interval its window (counted as the
    config counts it: GradScaler's count, except under a DeepSpeed JSON, whose count is DeepSpeed's; see
    [Note: loss-scale counting]). Its scaler doubles and halves, so another growth / backoff factor (or
    enabled=False) is refused; so is a value that differs from a loss-scale setting the config states
    itself."""
    handler = next((h for h in given.get("kwargs_handlers") or () if isinstance(h, GradScalerKwargs)), None)
    if handler is None or settings.zero.mixed_precision != "fp16":
        return settings  # Accelerate applies the handler only to an fp16 GradScaler too
    changed = handler.to_kwargs()  # the values that differ from the handler's defaults
    fixed = {name: changed[name] for name in _SCALER_FIXED if name in changed}
    if fixed:
        shown = ", ".join(f"{name}={value}" for name, value in fixed.items())
        raise ValueError(
            f"GradScalerKwargs({shown}): the ZeRO engine's fp16 loss scaler doubles and halves its scale and "
            f"cannot be disabled under fp16; set {_LOSS_SCALE_KEYS}, hysteresis and min_loss_scale instead"
        )
    changes = {_SCALER_FIELDS[name]: value for name, value in changed.items() if name in _SCALER_FIELDS}
    if not changes:
        return settings
    if settings.zero.static_loss_scale is not None:
        raise ValueError(
            f"GradScalerKwargs asks for a dynamic loss scale but {settings.source} sets a static one "
            f"({settings.zero.static_loss_scale}): keep one of them"
        )
    for field, value in changes.items():
        current = getattr(settings.zero, field)
        if _states_field(settings, field) and current != value:
            raise ValueError(
                f"GradScalerKwargs sets {field} {value} but {settings.source} sets {current}: give the loss "
                f"scale in one place ({_LOSS_SCALE_KEYS})"
            )
    return dataclasses.replace(settings, zero=settings.zero.replace(**changes))


def _states_field(settings: DeepSpeedConfig, field: str) -> bool:
    """Whether the config states `field` itself: a JSON key set it, or a ZeroConfig holds a non-default."""
    if field in settings.zero_sources:
        return True
    default = next(f.default for f in dataclasses.fields(ZeroConfig) if f.name == field)
    return getattr(settings.zero, field) != default


@contextlib.contextmanager
def accelerate_parallelism_hidden(hide: bool):
    """Accelerate's own reading of its launcher's parallelism environment switched off (the engine took it)."""
    name = "ACCELERATE_USE_PARALLELISM_CONFIG"
    saved = os.environ.get(name)
    if hide and saved is not None:
        os.environ[name] = "false"
    try:
        yield
    finally:
        if hide and saved is not None:
            os.environ[name] = saved


def parallel_dims_for(parallel: ParallelDims | None, config: Any) -> ParallelDims | None:
    """The engine's layout from `parallel=` or Accelerate's `ParallelismConfig` (also the one its launcher's
    `--use_parallelism_config` environment describes); None for plain data parallelism. Both given, or a
    context / sequence parallel degree (which the engine does not apply), is a ValueError. Pipeline stages
    come from `parallel=` only: Accelerate's ParallelismConfig has no pipeline dimension (1.15, 1.16)."""
    if config is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        from accelerate.parallelism_config import ParallelismConfig

        config = ParallelismConfig()
    if config is None:
        return parallel
    if parallel is not None:
        raise ValueError("give parallel= or Accelerate's parallelism_config, not both")
    unsupported = {name: getattr(config, name, 1) for name in ("cp_size", "sp_size")}
    unsupported = {name: size for name, size in unsupported.items() if size != 1}
    if unsupported:
        raise ValueError(
            f"ParallelismConfig {unsupported}: the ZeRO engine applies tensor slicing and data parallelism "
            "(tp_size, dp_shard_size, dp_replicate_size), not context or sequence parallelism"
        )
    data = config.dp_replicate_size * config.dp_shard_size
    # ZeRO shards over every data-parallel rank: replicate x shard is one data dimension here. All ones
    # (Accelerate's default) leaves the data degree to the world size.
    return ParallelDims(tensor=config.tp_size, data=data if data > 1 else None)


def compile_config_for(given: CompileConfig | None, plugin: TorchDynamoPlugin) -> CompileConfig | None:
    """The engine's `CompileConfig`: the one `given`, else Accelerate's dynamo settings turned into one
    (None when its backend is "no" or the plugin is disabled); both is an error, since neither would be
    the one setting. Mode and options go through as given (CompileConfig refuses both at once)."""
    if plugin.backend == DynamoBackend.NO or getattr(plugin, "disable", False):
        return given
    if given is not None:
        raise ValueError(
            f"compile_config and Accelerate's dynamo_backend={plugin.backend.value.lower()!r} both ask for "
            "torch.compile: give one (launch with --dynamo_backend no to keep compile_config's)"
        )
    backend = plugin.backend.value.lower()
    try:
        return CompileConfig(
            backend=backend,
            mode=plugin.mode if plugin.mode not in (None, "default") else None,
            fullgraph=bool(plugin.fullgraph),
            dynamic=plugin.dynamic,
            options=dict(plugin.options or {}),
        )
    except ValueError as error:  # named by where it was set: accelerate launch / accelerate config
        raise ValueError(
            f"Accelerate's dynamo settings (dynamo_backend {backend}, dynamo_mode {plugin.mode}): {error}"
        ) from error
