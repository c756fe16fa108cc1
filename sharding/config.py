"""`ZeroConfig`: every setting of the ZeRO engine, validated, and the reader of a DeepSpeed JSON's
zero_optimization / bf16 / fp16 sections (the rest of the JSON: deepspeed.py).

Sizes are in elements (as in DeepSpeed's JSON), not bytes.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STAGES = (0, 1, 2, 3)
MIXED_PRECISIONS = ("no", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu")
FUSED_ADAM_CHOICES = ("auto", "cuda", "triton", "reference", "none")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What the engine shards and how it communicates.

    stage: 0 = plain data parallel (every rank holds everything, gradients all-reduced);
        1 = fp32 master weights and optimizer state partitioned; 2 = gradients partitioned too;
        3 = 16-bit parameters partitioned too, gathered block by block around their use.
    mixed_precision: `no` (fp32 everywhere), `bf16` or `fp16` (16-bit parameters, gradients and
        communication; fp32 master weights and optimizer state).
    initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale: fp16 dynamic loss scaling:
        start at `initial_loss_scale`; an overflow skips the step and halves the scale once
        `hysteresis` overflows have been absorbed (never below `min_loss_scale`); `loss_scale_window`
        overflow-free steps double it.
    static_loss_scale: a fixed fp16 loss scale instead of the dynamic one.
    gradient_clipping: clip the global gradient norm to this value; 0 disables clipping.
    reduce_bucket_size: elements of gradients reduced in one collective: consecutive parameters
        are grouped into units of at most this size (a larger parameter gets one of its own); in
        stage 3 within each block, so a unit is also what one all-gather fills. Stages 2-3 keep at
        most two buckets' worth of reductions in flight (at least one bucket, however large).
    overlap_comm: launch each bucket's reduction asynchronously as soon as its gradients are
        ready, overlapping the rest of backward; False reduces after backward.
    prefetch_bucket_size: stage 3: elements of upcoming blocks gathered ahead of their use; 0
        disables prefetching.
    param_persistence_threshold: stage 3: parameters with at most this many elements stay
        whole on every rank (gathering them costs more in latency than it saves in memory).
    max_live_parameters: stage 3: prefetching never takes the gathered elements above this,
        counting every gathered block (the root block, with the embeddings, included); the block
        about to run is always gathered. Below the root plus the two largest neighbouring blocks,
        some blocks are never prefetched: the engine warns at initialize, naming the figure needed.
    reshard_after_forward: stage 3: free gathered blocks after their forward and gather them
        again in backward (ZeRO-3); False keeps them until their backward (more memory, less
        communication).
    offload_optimizer: `cpu` keeps fp32 master weights and optimizer state in CPU memory (stages 1-3).
        The host step (`CPUAdam`) runs on the cores of this rank's share of the machine (the CPUs
        it may run on, divided by LOCAL_WORLD_SIZE); the environment variable
        TNLG_CPU_ADAM_THREADS sets the count instead.
    offload_param: `cpu` keeps the partitioned 16-bit parameters in CPU memory (stage 3).
    fused_adam: how a torch Adam / AdamW steps the device shards. With `offload_optimizer` the step
        runs `CPUAdam` on the host: `auto` and `none` then resolve no device kernel (no CUDA extension
        is built), and a forced kernel is an error. Otherwise `auto` runs the fused kernel on CUDA (the CUDA extension, else Triton) and torch's
        own step elsewhere; `cuda`, `triton` or `reference` force that kernel (Triton on CPU tensors
        needs TRITON_INTERPRET=1; forcing one for an optimizer it cannot step, e.g. SGD, is an
        error); `none` always runs the user's optimizer. The kernel is chosen,
        and the CUDA extension built, when the engine is initialized: a kernel that cannot run on
        the engine's device is an error there, not in the first step.
    """

    stage: int = 0
    mixed_precision: str = "no"
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    static_loss_scale: float | None = None
    gradient_clipping: float = 0.0
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    reshard_after_forward: bool = True
    offload_optimizer: str = "none"
    offload_param: str = "none"
    fused_adam: str = "auto"

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_field(field.name, getattr(self, field.name))
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"ZeroConfig.min_loss_scale ({self.min_loss_scale}) exceeds initial_loss_scale "
                f"({self.initial_loss_scale})"
            )
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(
                "ZeroConfig.offload_optimizer needs stage 1, 2 or 3 (stage 0 partitions nothing)"
            )
        if self.offload_optimizer != "none" and self.fused_adam not in ("auto", "none"):
            raise ValueError(
                f"ZeroConfig.fused_adam={self.fused_adam!r} forces a device Adam kernel, but offload_optimizer="
                f"{self.offload_optimizer!r} steps the optimizer on the host (CPUAdam), where no device kernel "
                "runs; use fused_adam='auto' or 'none'"
            )
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_param needs stage 3 (parameters are partitioned only there), "
                f"got stage {self.stage}"
            )

    @property
    def partitions_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def partitions_gradients(self) -> bool:
        return self.stage >= 2

    @property
    def partitions_parameters(self) -> bool:
        return self.stage == 3

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def coerce(cls, config: ZeroConfig | Mapping[str, Any] | str | Path | None) -> ZeroConfig:
        """A `ZeroConfig` from itself, a dict (or JSON file) of its fields, or a DeepSpeed config dict or
        JSON file.

        A DeepSpeed config is read whole and checked (see `tnlg.sharding.deepspeed`); only its ZeroConfig
        part is returned: the training part (batch sizes, optimizer, scheduler) is the engine's, through
        `initialize(model, optimizer, path_or_dict)`.
        """
        if config is None:
            return cls()
        if isinstance(config, ZeroConfig):
            return config
        from .deepspeed import engine_settings

        return engine_settings(config).zero

    @classmethod
    def from_deepspeed(
        cls,
        config: Mapping[str, Any] | str | Path,
        *,
        overrides: Mapping[str, Any] | None = None,
        override_names: Mapping[str, str] | None = None,
        **auto: Any,
    ) -> ZeroConfig:
        """The ZeroConfig part of a DeepSpeed config (dict or JSON file), every key checked.

        Unknown keys are errors naming the key path; keys that cannot change training results are
        logged once at INFO (see [Note: DeepSpeed keys] in deepspeed.py). `"auto"` values take the
        matching keyword from `auto` (e.g. `mixed_precision="bf16"` from the launcher;
        `initial_scale_power` too) or else the field's default; unknown keywords raise TypeError.

        `overrides` are ZeroConfig fields set elsewhere (a run config, a command line): a field the JSON
        sets to a different value is a ValueError naming both (`override_names` gives each field's
        name in the error, e.g. {"stage": "--zero.stage"}); fields the JSON leaves unset (or "auto")
        take the override.
        """
        from .deepspeed import load_deepspeed

        return load_deepspeed(config, **auto).with_overrides(overrides or {}, override_names).zero


def mapping_kind(config: Mapping[str, Any]) -> str:
    """Whether a dict holds ZeroConfig fields ("fields") or is a DeepSpeed config ("deepspeed"); a dict
    that mixes the two, or whose keys are neither, is a ValueError naming the keys."""
    from .deepspeed import TOP_LEVEL_KEYS

    own = {f.name for f in fields(ZeroConfig)}
    keys = {str(key) for key in config}
    # `gradient_clipping` is both a field and a top-level DeepSpeed key: alone, it reads the same either way.
    field_keys = sorted(keys & own - {"gradient_clipping"})
    deepspeed_keys = sorted(keys & TOP_LEVEL_KEYS - {"gradient_clipping"})
    if field_keys and deepspeed_keys:
        raise ValueError(
            f"a config dict mixes ZeroConfig fields ({', '.join(field_keys)}) and DeepSpeed keys "
            f"({', '.join(deepspeed_keys)}): use one or the other"
        )
    if deepspeed_keys or keys <= {"gradient_clipping"}:
        return "deepspeed"
    unknown = sorted(keys - own)
    if unknown:
        known = own if field_keys else own | TOP_LEVEL_KEYS
        what = "ZeroConfig fields" if field_keys else "ZeroConfig fields or DeepSpeed keys"
        raise ValueError(f"not {what}: {', '.join(suggest(key, known) for key in unknown)}")
    return "fields"


def apply_overrides(
    zero: ZeroConfig,
    sources: Mapping[str, tuple[str, Any]],
    source: str,
    overrides: Mapping[str, Any],
    names: Mapping[str, str],
) -> ZeroConfig:
    """`zero` with `overrides` applied to the fields the DeepSpeed config leaves unset; an override of a
    field it sets (`sources`: field -> (key path, value as written)) must agree with it."""
    own = {f.name for f in fields(ZeroConfig)}
    unknown = sorted(set(overrides) - own)
    if unknown:
        raise TypeError(
            f"overrides that are not ZeroConfig fields: {', '.join(suggest(k, own) for k in unknown)}"
        )
    changes: dict[str, Any] = {}
    for field, value in overrides.items():
        name = names.get(field, field)
        try:
            _check_field(field, value)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error
        if field not in sources:
            changes[field] = value
            continue
        current = getattr(zero, field)
        if not same_value(value, current):
            path, raw = sources[field]
            written = f"{path} {raw!r}" + ("" if same_value(raw, current) else f" (= {field} {current!r})")
            raise ValueError(
                f"{name} {value!r} conflicts with {written} in {source}: change one of them to agree "
                "with the other"
            )
    try:
        return zero.replace(**changes)
    except ValueError as error:
        shown = ", ".join(f"{names.get(k, k)}={v!r}" for k, v in changes.items())
        raise ValueError(f"{source} with {shown}: {error}") from error


def same_value(a: Any, b: Any) -> bool:
    """Equal, and not only because True == 1: JSON numbers compare by value (5e8 == 500000000)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def suggest(key: str, known: Iterable[str]) -> str:
    """`key`, with the closest known key when there is one: "stgae (did you mean 'stage'?)"."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"{key} (did you mean {close[0]!r}?)" if close else key


# ---------------------------------------------------------------------------------------------------
# The DeepSpeed JSON's zero_optimization, bf16 and fp16 sections. The top level, the training keys
# (batch sizes, optimizer, scheduler) and [Note: DeepSpeed keys] are in deepspeed.py.


@dataclass(frozen=True)
class KeyRule:
    """A DeepSpeed key tnlg reads but does not act on. `accepts(value)`: ignoring it at that value
    trains exactly as DeepSpeed would; any other value is an error. `why`: what the key does, and why
    ignoring it is safe (logged) or what tnlg lacks (the error)."""

    why: str
    accepts: Callable[[Any], bool] = lambda value: True
    expected: str = ""  # the accepted values, for the error; empty: every value is accepted


def at(default: Any) -> dict[str, Any]:
    """A `KeyRule`'s arguments accepting only `default` (or "auto")."""
    return {"accepts": lambda value: value == "auto" or same_value(value, default), "expected": repr(default)}


def disabled() -> dict[str, Any]:
    """A `KeyRule`'s arguments accepting a section only when it is absent, null or not enabled."""

    def accepts(value: Any) -> bool:
        return value is None or (
            isinstance(value, Mapping) and value.get("enabled", False) in (False, "auto")
        )

    return {"accepts": accepts, "expected": '{"enabled": false}'}


_PERF = "performance only: the same result either way"
# zero_optimization keys → ZeroConfig field (DeepSpeed accepts the stage3_ keys without the prefix too).
_ZERO_KEYS = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "max_live_parameters": "max_live_parameters",
}
_ZERO_RULES = {
    "contiguous_gradients": KeyRule("gradients always live in contiguous flat buffers"),
    "reduce_scatter": KeyRule(f"how gradients are reduced; {_PERF}"),
    "allgather_partitions": KeyRule(f"how parameters are gathered; {_PERF}"),
    "allgather_bucket_size": KeyRule(f"gathers go unit by unit (reduce_bucket_size); {_PERF}"),
    "use_multi_rank_bucket_allreduce": KeyRule(_PERF),
    "round_robin_gradients": KeyRule(_PERF),
    "sub_group_size": KeyRule(
        f"the optimizer steps each rank's shard whole; sub-groups bound memory, {_PERF}"
    ),
    "stage3_max_reuse_distance": KeyRule(f"stage 3 frees a block's parameters after its use; {_PERF}"),
    "max_reuse_distance": KeyRule(f"stage 3 frees a block's parameters after its use; {_PERF}"),
    "stage3_model_persistence_threshold": KeyRule(f"memory bound on persistent parameters; {_PERF}"),
    "model_persistence_threshold": KeyRule(f"memory bound on persistent parameters; {_PERF}"),
    "stage3_module_granularity_threshold": KeyRule(f"stage 3 fetch granularity; {_PERF}"),
    "module_granularity_threshold": KeyRule(f"stage 3 fetch granularity; {_PERF}"),
    "stage3_use_all_reduce_for_fetch_params": KeyRule(f"stage 3 fetch collective; {_PERF}"),
    "use_all_reduce_for_fetch_params": KeyRule(f"stage 3 fetch collective; {_PERF}"),
    "stage3_allgather_sequential": KeyRule(f"stage 3 fetch order; {_PERF}"),
    "allgather_sequential": KeyRule(f"stage 3 fetch order; {_PERF}"),
    "leaf_module": KeyRule(f"stage 3 fetch units; {_PERF}"),
    "memory_efficient_linear": KeyRule(f"zero.Init's linear layers; {_PERF}"),
    "override_module_apply": KeyRule("zero.Init's module.apply patch: tnlg patches no torch code"),
    "stage3_gather_16bit_weights_on_model_save": KeyRule("full_state_dict() always gathers whole weights"),
    "gather_16bit_weights_on_model_save": KeyRule("full_state_dict() always gathers whole weights"),
    "stage3_gather_fp16_weights_on_model_save": KeyRule("full_state_dict() always gathers whole weights"),
    "elastic_checkpoint": KeyRule("tnlg checkpoints load at any world size and stage"),
    "ignore_unused_parameters": KeyRule(
        "unused parameters are always accepted (their gradient counts as zero)"
    ),
    "cpu_offload_use_pin_memory": KeyRule(f"host-memory pinning; {_PERF}"),
    "log_trace_cache_warnings": KeyRule("diagnostics only"),
    "enable_sanity_checks": KeyRule("diagnostics only"),
    "save_muon_momentum_buffer_in_memory": KeyRule("Muon optimizer only; tnlg builds no Muon"),
    "load_from_fp32_weights": KeyRule("checkpoints always restore the fp32 master weights", **at(True)),
    "legacy_stage1": KeyRule("DeepSpeed's legacy stage 1", **at(False)),
    "cpu_offload": KeyRule("deprecated: use offload_optimizer.device = cpu", **at(False)),
    "cpu_offload_param": KeyRule("deprecated: use offload_param.device = cpu", **at(False)),
    "zero_hpz_partition_size": KeyRule("ZeRO++ hierarchical partitioning is not implemented", **at(1)),
    "zero_quantized_weights": KeyRule("ZeRO++ quantized weights are not implemented", **at(False)),
    "zero_quantized_nontrainable_weights": KeyRule(
        "ZeRO++ quantized weights are not implemented", **at(False)
    ),
    "zero_quantized_gradients": KeyRule("ZeRO++ quantized gradients are not implemented", **at(False)),
    "zeropp_loco_param": KeyRule("ZeRO++ LoCo is not implemented", **at(None)),
    "mics_shard_size": KeyRule("MiCS sharding is not implemented", **at(-1)),
    "mics_hierarchical_params_gather": KeyRule("MiCS sharding is not implemented", **at(False)),
    "pipeline_loading_checkpoint": KeyRule("pipeline-parallel loading is not implemented", **at(False)),
    "zenflow": KeyRule("ZenFlow is not implemented", **at(None)),
}
_NVME = "NVMe offload only (tnlg offloads to CPU memory)"
_OFFLOAD_RULES = {
    "pin_memory": KeyRule(f"host-memory pinning; {_PERF}"),
    "nvme_path": KeyRule(_NVME),
    "buffer_count": KeyRule(_NVME),
    "buffer_size": KeyRule(_NVME),
    "max_in_cpu": KeyRule(_NVME),
    "pipeline_read": KeyRule(_NVME),
    "pipeline_write": KeyRule(_NVME),
    "fast_init": KeyRule(_NVME),
    "cpuadam_cores_perc": KeyRule(f"CPUAdam threads; {_PERF}"),
    "ratio": KeyRule("partial offload is not implemented: tnlg offloads all of it", **at(1.0)),
    "super_offload": KeyRule("SuperOffload is not implemented", **at(False)),
}
_FP16_KEYS = {
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
}
_FP16_RULES = {
    "consecutive_hysteresis": KeyRule("hysteresis is re-armed only when the scale grows", **at(False)),
    "auto_cast": KeyRule("tnlg casts the parameters, not the inputs", **at(False)),
    "fp16_master_weights_and_grads": KeyRule("master weights are always fp32", **at(False)),
}
_BF16_RULES = {
    "immediate_grad_update": KeyRule(
        "gradients accumulate in the 16-bit buffers until the step", **at(False)
    ),
    "check_grad_overflow": KeyRule("a non-finite gradient norm always skips the step", **at(True)),
    "bf16_master_weights_and_grads": KeyRule("master weights are always fp32", **at(False)),
    "bf16_optimizer_states": KeyRule("optimizer states are always fp32", **at(False)),
}


class SectionReader:
    """Reads the ZeroConfig part of one DeepSpeed config. It records which key set each field (for
    `apply_overrides`), the keys it reads but ignores (path, why) and every unknown key, so that one
    error can name them all."""

    def __init__(self, auto: Mapping[str, Any], extra_auto: Iterable[str] = ()):
        own = {f.name for f in fields(ZeroConfig)}
        unknown = sorted(set(auto) - own - {"initial_scale_power"} - set(extra_auto))
        if unknown:
            raise TypeError(f'unknown keywords for "auto" values: {", ".join(unknown)}')
        for name, value in auto.items():
            if name in own:
                _check_field(name, value)
        self.auto = dict(auto)
        self.values: dict[str, Any] = {}
        self.sources: dict[str, tuple[str, Any]] = {}  # field -> (key path, value as written)
        self.ignored: list[tuple[str, str]] = []
        self.unknown: list[str] = []
        self.enabled: list[str] = []  # the 16-bit sections enabled, after "auto" resolution

    # ------------------------------------------------------------------ values
    def resolve(self, raw: Any, field: str) -> Any:
        if isinstance(raw, str) and raw == "auto":
            return self.auto.get(field, _default(field))
        # JSON writers (and DeepSpeed's docs) spell sizes as 5e8: integral floats are integers.
        if isinstance(raw, float) and raw.is_integer() and type(_default(field)) is int:
            return int(raw)
        return raw

    def set(self, path: str, raw: Any, field: str, value: Any = None, resolved: bool = False) -> None:
        """Field `field` from key `path` (errors name `path`); "auto" leaves the field to the launcher."""
        value = value if resolved else self.resolve(raw, field)
        check_at(path, field, value)
        self.values[field] = value
        if not (isinstance(raw, str) and raw == "auto"):
            self.sources[field] = (path, raw)

    def rule(self, path: str, raw: Any, rule: KeyRule) -> None:
        """A key tnlg reads but does not act on: logged if ignoring it is exact, else an error."""
        if not rule.accepts(raw):
            fix = f"remove it or set it to {rule.expected}" if rule.expected else "remove it"
            raise ValueError(
                f"invalid DeepSpeed config: {path} = {json.dumps(raw, default=str)} is not supported "
                f"({rule.why}); {fix}"
            )
        self.ignored.append((path, rule.why))

    def other(
        self, path: str, key: str, raw: Any, rules: Mapping[str, KeyRule], known: Iterable[str]
    ) -> None:
        """A key the section does not apply: a known one (`rules`), else an unknown one."""
        if key in rules:
            self.rule(path, raw, rules[key])
        else:
            prefix = path[: len(path) - len(key)]
            self.unknown.append(prefix + suggest(key, set(known) | set(rules)))

    # ------------------------------------------------------------------ sections
    def read_zero(self, section: Mapping[str, Any]) -> None:
        for key, raw in section.items():
            path = f"zero_optimization.{key}"
            if key in _ZERO_KEYS:
                self.set(path, raw, _ZERO_KEYS[key])
            elif key in ("offload_optimizer", "offload_param"):
                self.read_offload(path, key, raw)
            else:
                self.other(path, key, raw, _ZERO_RULES, [*_ZERO_KEYS, "offload_optimizer", "offload_param"])

    def read_offload(self, path: str, field: str, raw: Any) -> None:
        section = {} if raw is None else _section(path, raw)  # DeepSpeed: null = no offload
        device = section.get("device", "none")
        if not isinstance(device, str) or device not in OFFLOAD_DEVICES:
            note = " (NVMe offload is not supported)" if device == "nvme" else ""
            raise ValueError(
                f"invalid DeepSpeed config: {path}.device must be one of "
                f"{list(OFFLOAD_DEVICES)}, got {device!r}{note}"
            )
        self.set(f"{path}.device", device, field)
        for key, value in section.items():
            if key != "device":
                self.other(f"{path}.{key}", key, value, _OFFLOAD_RULES, ["device"])

    def read_precision(self, kind: str, section: Mapping[str, Any]) -> None:
        """`kind`: "bf16" or "fp16" (the section's key, "bfloat16" read as "bf16")."""
        self._read_enabled(kind, section.get("enabled", False))
        for key, raw in section.items():
            path = f"{kind}.{key}"
            if key == "enabled":
                continue
            if kind == "fp16":
                self._read_fp16_key(path, key, raw)
            else:
                self.other(path, key, raw, _BF16_RULES, ["enabled"])

    def _read_enabled(self, kind: str, enabled: Any) -> None:
        if enabled == "auto":
            enabled = self.auto.get("mixed_precision", "no") == kind
        elif enabled is True:
            self.sources["mixed_precision"] = (f"{kind}.enabled", True)
        if enabled not in (True, False):
            raise ValueError(
                f'invalid DeepSpeed config: {kind}.enabled must be true, false or "auto", got {enabled!r}'
            )
        if enabled:
            self.enabled.append(kind)
            self.values["mixed_precision"] = kind

    def _read_fp16_key(self, path: str, key: str, raw: Any) -> None:
        """One key of the fp16 section other than `enabled`."""
        if key in _FP16_KEYS:
            self.set(path, raw, _FP16_KEYS[key])
        elif key == "initial_scale_power":
            power = self.resolve(raw, "initial_scale_power")
            if isinstance(power, bool) or not isinstance(power, int) or not 0 <= power <= 1023:
                raise ValueError(
                    f"invalid DeepSpeed config: {path} must be an integer in [0, 1023], got {power!r}"
                )
            self.set(path, raw, "initial_loss_scale", 2.0**power, resolved=True)
        elif key == "loss_scale":
            scale = self.resolve(raw, "static_loss_scale")
            if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == 0:
                scale = None  # DeepSpeed: 0 means dynamic loss scaling
            self.set(path, raw, "static_loss_scale", scale, resolved=True)
        else:
            self.other(
                path, key, raw, _FP16_RULES, ["enabled", "loss_scale", "initial_scale_power", *_FP16_KEYS]
            )

    def zero_config(self) -> ZeroConfig:
        if len(self.enabled) > 1:
            raise ValueError("invalid DeepSpeed config: bf16.enabled and fp16.enabled are both true")
        try:
            return ZeroConfig(**self.values)
        except ValueError as error:
            raise ValueError(f"invalid DeepSpeed config: {error}") from error


def _section(path: str, raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"invalid DeepSpeed config: {path} must be an object, got {raw!r}")
    return raw


def check_at(path: str, field: str, value: Any) -> None:
    try:
        _check_field(field, value)
    except ValueError as error:
        raise ValueError(f"invalid DeepSpeed config: {path}: {error}") from error


def _default(field: str) -> Any:
    if field == "initial_scale_power":
        return 16
    return next(f.default for f in fields(ZeroConfig) if f.name == field)


_CHOICES = {
    "stage": STAGES,
    "mixed_precision": MIXED_PRECISIONS,
    "offload_optimizer": OFFLOAD_DEVICES,
    "offload_param": OFFLOAD_DEVICES,
    "fused_adam": FUSED_ADAM_CHOICES,
}
_INT_MINIMUMS = {
    "reduce_bucket_size": 1,
    "prefetch_bucket_size": 0,
    "max_live_parameters": 1,
    "loss_scale_window": 1,
    "hysteresis": 1,
    "param_persistence_threshold": 0,
}
_BOOLS = ("overlap_comm", "reshard_after_forward")
# field → (minimum, inclusive)
_NUMBERS = {
    "gradient_clipping": (0.0, True),
    "initial_loss_scale": (0.0, False),
    "min_loss_scale": (0.0, False),
    "static_loss_scale": (0.0, False),
}


def _check_field(name: str, value: Any) -> None:
    """Raise a ValueError naming the field unless `value` is valid for it (on its own)."""
    if name in _CHOICES:
        _check_choice(name, value, _CHOICES[name])
    elif name in _INT_MINIMUMS:
        _check_int(name, value, _INT_MINIMUMS[name])
    elif name in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"ZeroConfig.{name} must be True or False, got {value!r}")
    elif name == "static_loss_scale" and value is None:
        return
    else:
        _check_number(name, value, *_NUMBERS[name])


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    # Same type as well as equal: 2.0 or True is not a stage, whatever `2.0 == 2` says.
    if isinstance(value, bool) or not any(isinstance(value, type(a)) and value == a for a in allowed):
        raise ValueError(f"ZeroConfig.{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ZeroConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float, inclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (isinstance(value, int) or math.isfinite(value))
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        raise ValueError(f"ZeroConfig.{name} must be a finite number {bound}, got {value!r}")
