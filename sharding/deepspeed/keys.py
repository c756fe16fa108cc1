"""The DeepSpeed JSON's keys, every section of it, each with what tnlg does with it: the `ZeroConfig` field
it sets, its value check, or its `KeyRule` (read and ignored, or refused unless at one value). The
readers that walk a config with these tables: sections.py (zero_optimization, bf16, fp16) and reader.py
(the top level, optimizer, scheduler).

[Note: DeepSpeed keys]
Every key of a DeepSpeed config, at every level, is one of:
- applied: `zero_optimization`, `bf16` / `fp16` and `gradient_clipping` become `ZeroConfig` fields;
  `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`, `train_batch_size`, `optimizer`
  and `scheduler` become the `TrainingConfig` that `initialize` applies as DeepSpeed's engine does;
- read and ignored, because ignoring it cannot change what is trained (logs, profilers, performance
  knobs of DeepSpeed's own implementation): each has its reason in a table (`KeyRule`), and the
  ignored ones are logged once at INFO when the config is read;
- read and refused unless at the value tnlg behaves like (features tnlg lacks, such as ZeRO++
  quantization or prescaled gradients): an error naming the key, what it does and the value to use;
- unknown (a typo such as "stgae", or a DeepSpeed feature tnlg does not know): an error naming the
  dotted key path and the closest known key. A typo used to train at stage 0 after a warning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def same_value(a: Any, b: Any) -> bool:
    """Equal, and not only because True == 1: JSON numbers compare by value (5e8 == 500000000)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


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
    return disabled_by("enabled")


def disabled_by(*switches: str) -> dict[str, Any]:
    """A `KeyRule`'s arguments accepting a section only when it is absent, null or each of its `switches`
    is off."""

    def accepts(value: Any) -> bool:
        return value is None or (
            isinstance(value, Mapping) and all(value.get(s, False) in (False, "auto") for s in switches)
        )

    return {"accepts": accepts, "expected": "{" + ", ".join(f'"{s}": false' for s in switches) + "}"}


# ---------------------------------------------------------------------------------------------------
# zero_optimization (with its offload_optimizer / offload_param objects), bf16 and fp16.
_PERF = "performance only: the same result either way"
# zero_optimization keys → ZeroConfig field (DeepSpeed accepts the stage3_ keys without the prefix too).
ZERO_KEYS = {
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
ZERO_RULES = {
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
_OFFLOAD_SHARED = {
    "pin_memory": KeyRule(f"host-memory pinning; {_PERF}"),
    "nvme_path": KeyRule(_NVME),
    "buffer_count": KeyRule(_NVME),
}
# Each offload section's own keys, as DeepSpeed's two offload configs declare them (each refuses the
# other's): {section: rules besides `device`}.
OFFLOAD_RULES = {
    "offload_param": {
        **_OFFLOAD_SHARED,
        "buffer_size": KeyRule(_NVME),
        "max_in_cpu": KeyRule(_NVME),
    },
    "offload_optimizer": {
        **_OFFLOAD_SHARED,
        "pipeline_read": KeyRule(_NVME),
        "pipeline_write": KeyRule(_NVME),
        "fast_init": KeyRule(_NVME),
        "cpuadam_cores_perc": KeyRule(f"CPUAdam threads; {_PERF}"),
        "ratio": KeyRule("partial offload is not implemented: tnlg offloads all of it", **at(1.0)),
        "super_offload": KeyRule("SuperOffload is not implemented", **at(False)),
    },
}
FP16_KEYS = {
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
    "consecutive_hysteresis": "consecutive_hysteresis",
}
FP16_RULES = {
    "auto_cast": KeyRule("tnlg casts the parameters, not the inputs", **at(False)),
    "fp16_master_weights_and_grads": KeyRule("master weights are always fp32", **at(False)),
}
BF16_RULES = {
    "immediate_grad_update": KeyRule(
        "gradients accumulate in the 16-bit buffers until the step", **at(False)
    ),
    "check_grad_overflow": KeyRule("a non-finite gradient norm always skips the step", **at(True)),
    "bf16_master_weights_and_grads": KeyRule("master weights are always fp32", **at(False)),
    "bf16_optimizer_states": KeyRule("optimizer states are always fp32", **at(False)),
}


# ---------------------------------------------------------------------------------------------------
# The top level and the training sections (batch sizes, optimizer, scheduler).
SUPPORTED_OPTIMIZERS = ("Adam", "AdamW")
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
BATCH_KEYS = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size")

_MONITOR = "DeepSpeed's own monitoring: log through the run's trackers"
TOP_RULES = {
    "steps_per_print": KeyRule("progress-log cadence"),
    "wall_clock_breakdown": KeyRule("timing logs"),
    "memory_breakdown": KeyRule("memory logs"),
    "dump_state": KeyRule("prints the config"),
    "tensorboard": KeyRule(_MONITOR),
    "wandb": KeyRule(_MONITOR),
    "csv_monitor": KeyRule(_MONITOR),
    "comet": KeyRule(_MONITOR),
    "comms_logger": KeyRule("communication logs (engine.comm_stats() counts collectives)"),
    "flops_profiler": KeyRule("profiler output"),
    "timers": KeyRule("timer logs"),
    "autotuning": KeyRule(
        "DeepSpeed's autotuner: enabled, the engine profiles its first steps, writes the autotuning metric "
        "and exits (one experiment of `deepspeed --autotuning`); tnlg does not autotune",
        **disabled(),
    ),
    "zero_force_ds_cpu_optimizer": KeyRule("a check: an offloaded Adam / AdamW always steps through CPUAdam"),
    "dataloader_drop_last": KeyRule("applies to data loaders DeepSpeed builds; the engine builds none"),
    "checkpoint": KeyRule(
        "DeepSpeed's checkpoint I/O options: tnlg writes its own format, once, to storage every node "
        "shares (each rank its shard, one process the manifest): node-local storage is not implemented; "
        "it reads DeepSpeed's ZeRO checkpoints through their `latest` tag, not the universal format",
        **disabled_by("use_node_local_storage", "load_universal"),
    ),
    "aio": KeyRule("NVMe I/O (tnlg offloads to CPU memory only)"),
    "activation_checkpointing": KeyRule(
        "configures deepspeed.checkpointing, which tnlg models do not call "
        "(use the run config's model.activation_checkpointing, or the model's activation_checkpointing_enable())"
    ),
    "seq_parallel_communication_data_type": KeyRule("sequence parallelism only; tnlg has none"),
    "prescale_gradients": KeyRule("divides gradients before the reduction instead of after", **at(False)),
    "gradient_predivide_factor": KeyRule("splits the gradient division around the reduction", **at(1.0)),
    "sparse_gradients": KeyRule("sparse embedding gradients are not implemented", **at(False)),
    "disable_allgather": KeyRule("replaces the parameter all-gather with broadcasts", **at(False)),
    "amp": KeyRule("NVIDIA Apex AMP: use bf16 or fp16", **disabled()),
    "torch_autocast": KeyRule("autocast: tnlg runs 16-bit parameters (bf16 or fp16)", **disabled()),
    "elasticity": KeyRule("elastic batch sizes are not implemented", **disabled()),
    "eigenvalue": KeyRule("eigenvalue-driven quantization is not implemented", **disabled()),
    "progressive_layer_drop": KeyRule("progressive layer dropping is not implemented", **disabled()),
    "curriculum_learning": KeyRule("curriculum learning is not implemented", **disabled()),
    "data_efficiency": KeyRule("data efficiency sampling is not implemented", **disabled()),
    "hybrid_engine": KeyRule("the RLHF hybrid engine is not implemented", **disabled()),
    "nebula": KeyRule("the Nebula checkpoint service is not implemented", **disabled()),
    "compile": KeyRule(
        "DeepCompile's settings, which DeepSpeed applies only when engine.compile() is called; its ZeRO-3 graph "
        "passes are not implemented: compile the blocks with the run config's model.compile.enabled, or "
        "initialize(compile_config=...)",
        **disabled_by("deepcompile"),
    ),
}
# Top-level keys that set a ZeroConfig field (errors name the key): DeepSpeed's permission for optimizers
# ZeRO has not been tested with is the engine's refusal of optimizers that are not element-wise (see
# [Note: element-wise optimizers] in optimizer_kinds.py); true allows them, false keeps the refusal.
TOP_ZERO_KEYS = {
    "gradient_clipping": "gradient_clipping",
    "zero_allow_untested_optimizer": "allow_untested_optimizer",
}
_APPLIED = ("zero_optimization", "bf16", "bfloat16", "fp16", *TOP_ZERO_KEYS, "optimizer", "scheduler")
TOP_LEVEL_KEYS = frozenset((*_APPLIED, *BATCH_KEYS, *TOP_RULES, "communication_data_type", "data_types"))
COMMUNICATION_DTYPES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


# ---------------------------------------------------------------------------------------------------
# Value checks: (test, what it must be). "auto" is allowed only where a launcher fills the value.
def _number(minimum: float, inclusive: bool = True) -> tuple[Callable[[Any], bool], str]:
    def test(value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return value >= minimum if inclusive else value > minimum

    return test, f"a finite number {'>=' if inclusive else '>'} {minimum}"


def integer(minimum: int) -> tuple[Callable[[Any], bool], str]:
    def test(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and value >= minimum

    return test, f"an integer >= {minimum}"


def _number_or_list(minimum: float) -> tuple[Callable[[Any], bool], str]:
    test, what = _number(minimum)
    return (lambda v: test(v) or (isinstance(v, list) and bool(v) and all(map(test, v)))), (
        f"{what}, or a list of them (one per param group)"
    )


_BOOL = (lambda value: isinstance(value, bool)), "true or false"
_BETAS = (
    lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(0.0)[0](b) and b < 1 for b in v),
    "two numbers in [0, 1), e.g. [0.9, 0.999]",
)
_WARMUP_TYPE = (lambda value: value in ("log", "linear")), '"log" or "linear"'

# Adam / AdamW params: name -> (check, "auto" allowed). FusedAdam's defaults are DeepSpeed's.
ADAM_PARAMS = {
    "lr": (_number(0.0), True),
    "betas": (_BETAS, True),
    "eps": (_number(0.0, inclusive=False), True),
    "weight_decay": (_number(0.0), True),
    "amsgrad": (_BOOL, False),
    "adam_w_mode": (_BOOL, False),
    "torch_adam": (_BOOL, False),
}
ADAM_RULES = {
    "bias_correction": KeyRule("tnlg's Adam always corrects the moments' bias", **at(True)),
    "fp32_optimizer_states": KeyRule("optimizer states are always fp32", **at(True)),
    "set_grad_none": KeyRule("the engine owns the gradient buffers"),
    "max_grad_norm": KeyRule(
        "DeepSpeed refuses it as an optimizer parameter: use the top-level gradient_clipping",
        accepts=lambda value: False,
    ),
}
FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
OPTIMIZER_RULES = {"legacy_fusion": KeyRule("DeepSpeed's fp16 optimizer fusion; performance only")}

_WARMUP_PARAMS = {
    "warmup_min_lr": (_number_or_list(0.0), True),
    "warmup_max_lr": (_number_or_list(0.0), True),
    "warmup_num_steps": (integer(1), True),
    "warmup_type": (_WARMUP_TYPE, False),
}
_TOTAL_STEPS = {"total_num_steps": (integer(1), True)}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": {**_WARMUP_PARAMS, **_TOTAL_STEPS},
    "WarmupCosineLR": {
        **_TOTAL_STEPS,
        "warmup_min_ratio": (_number(0.0), False),
        "cos_min_ratio": (_number(0.0), False),
        "warmup_num_steps": (integer(1), True),
        "warmup_type": (_WARMUP_TYPE, False),
    },
}
REQUIRED_SCHEDULER_PARAMS = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}
SCHEDULER_RULES = {
    "last_batch_iteration": KeyRule(
        "a schedule resumes from the engine checkpoint (lr_scheduler.json), not from the JSON", **at(-1)
    )
}
