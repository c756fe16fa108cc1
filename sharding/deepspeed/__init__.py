"""A DeepSpeed JSON read whole: the engine's `ZeroConfig`, and the training part DeepSpeed's engine also
applies (batch sizes, gradient accumulation, optimizer, learning-rate scheduler).

keys.py          every key of every section and what tnlg does with it ([Note: DeepSpeed keys])
sections.py      the ZeroConfig part: zero_optimization, bf16, fp16 (`SectionReader`), `apply_overrides`
reader.py        the rest of the JSON, and the front doors: `engine_settings`, `zero_config_from`,
                 `zero_config_from_deepspeed`, `load_deepspeed`
settings.py      the typed result (`DeepSpeedConfig`, `TrainingConfig`, ...), `engine_optimizer`
lr_schedules.py  DeepSpeed's learning-rate schedules as torch LRSchedulers

`ZeroConfig` itself (sharding/config.py) knows nothing of DeepSpeed: the imports run from here to it.
"""

from .lr_schedules import DeepSpeedSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from .reader import (
    engine_settings,
    load_deepspeed,
    parse_deepspeed,
    zero_config_from,
    zero_config_from_deepspeed,
)
from .settings import (
    BatchSizes,
    DeepSpeedConfig,
    OptimizerSpec,
    SchedulerSpec,
    TrainingConfig,
    engine_optimizer,
)

__all__ = [
    "BatchSizes",
    "DeepSpeedConfig",
    "DeepSpeedSchedule",
    "OptimizerSpec",
    "SchedulerSpec",
    "TrainingConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "engine_optimizer",
    "engine_settings",
    "load_deepspeed",
    "parse_deepspeed",
    "zero_config_from",
    "zero_config_from_deepspeed",
]
