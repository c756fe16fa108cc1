"""`ZeroConfig`: every setting of the ZeRO engine, and the check of each field on its own
(`check_field`, which the DeepSpeed reader applies to the values it reads too).

Sizes are in elements (as in DeepSpeed's JSON), not bytes. Reading a ZeroConfig from other forms (a dict,
a DeepSpeed JSON) is the DeepSpeed side's job (`tnlg.sharding.deepspeed`: `zero_config_from`,
`zero_config_from_deepspeed`): this module imports nothing from it, so the reader may build on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

STAGES = (0, 1, 2, 3)
MIXED_PRECISIONS = ("no", "bf16", "fp16")
OFFLOAD_DEVICES = ("none", "cpu")
FUSED_ADAM_CHOICES = ("auto", "cuda", "triton", "reference", "none")
LOSS_SCALE_COUNTINGS = ("torch", "deepspeed")


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
        `hysteresis` overflows have been absorbed (never below `min_loss_scale`: an overflow that would
        halve it there raises `LossScaleError`, as DeepSpeed's scaler does); `loss_scale_window`
        overflow-free steps double it, counted as `loss_scale_counting` says.
    loss_scale_counting: where the window's count starts. "torch": the window's clean steps in a row
        double the scale (torch's GradScaler counts its `growth_interval` so, and Megatron-LM). "deepspeed":
        DeepSpeed's DynamicLossScaler, which doubles at the window's + 1st clean step after the start
        and after each overflow, then every window. A DeepSpeed JSON sets "deepspeed" (a ZeroConfig
        stated in fields, or a run config without a JSON, keeps "torch"), so that the same JSON gives
        the same scale path as DeepSpeed's ZeRO stages 1-3 (docs/zero.md says where stage 0 differs).
    consecutive_hysteresis: re-arm the hysteresis at every clean step, not only when the scale grows
        (DeepSpeed's fp16.consecutive_hysteresis).
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
    allow_untested_optimizer: train with an optimizer not known to update each element on its own
        (DeepSpeed's `zero_allow_untested_optimizer`). The engine steps each param group as one flat
        1-D shard, which changes the update of optimizers that use tensor shapes or whole-tensor
        statistics (Adafactor, LAMB); False refuses them at initialize (see
        [Note: element-wise optimizers] in optimizer_kinds.py).
    """

    stage: int = 0
    mixed_precision: str = "no"
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    loss_scale_counting: str = "torch"
    consecutive_hysteresis: bool = False
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
    allow_untested_optimizer: bool = False

    def __post_init__(self) -> None:
        for field in fields(self):
            check_field(field.name, getattr(self, field.name))
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


# Each field checked on its own (`check_field`): ZeroConfig's __post_init__ adds the checks across fields,
# and the DeepSpeed reader checks each value where it reads it, so that its error names the key.
_CHOICES = {
    "stage": STAGES,
    "mixed_precision": MIXED_PRECISIONS,
    "offload_optimizer": OFFLOAD_DEVICES,
    "offload_param": OFFLOAD_DEVICES,
    "fused_adam": FUSED_ADAM_CHOICES,
    "loss_scale_counting": LOSS_SCALE_COUNTINGS,
}
_INT_MINIMUMS = {
    "reduce_bucket_size": 1,
    "prefetch_bucket_size": 0,
    "max_live_parameters": 1,
    "loss_scale_window": 1,
    "hysteresis": 1,
    "param_persistence_threshold": 0,
}
_BOOLS = ("overlap_comm", "reshard_after_forward", "allow_untested_optimizer", "consecutive_hysteresis")
# field → (minimum, inclusive)
_NUMBERS = {
    "gradient_clipping": (0.0, True),
    "initial_loss_scale": (0.0, False),
    "min_loss_scale": (0.0, False),
    "static_loss_scale": (0.0, False),
}


def check_field(name: str, value: Any) -> None:
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
