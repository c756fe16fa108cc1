"""tnlg.sharding: the ZeRO engine on torch.distributed (knows nothing about GPT).

from tnlg.sharding import ZeroConfig, initialize
engine = initialize(model, optimizer, ZeroConfig(stage=3, mixed_precision="bf16"))
loss = engine(**batch).loss
engine.backward(loss)
engine.step()
"""

from .build import initialize
from .collectives import CommStats
from .compile import CompileConfig
from .config import ZeroConfig
from .deepspeed import (
    DeepSpeedConfig,
    OptimizerSpec,
    SchedulerSpec,
    TrainingConfig,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    load_deepspeed,
    parse_deepspeed,
    zero_config_from,
    zero_config_from_deepspeed,
)
from .engine import ZeroEngine
from .init import init_weights, materialize
from .parallel import ParallelDims
from .pretrained import PretrainedSource, SafetensorsCheckpoint, meta_from_pretrained, set_pretrained_source

__all__ = [
    "CommStats",
    "CompileConfig",
    "DeepSpeedConfig",
    "OptimizerSpec",
    "ParallelDims",
    "PretrainedSource",
    "SafetensorsCheckpoint",
    "SchedulerSpec",
    "TrainingConfig",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroEngine",
    "init_weights",
    "initialize",
    "load_deepspeed",
    "materialize",
    "meta_from_pretrained",
    "parse_deepspeed",
    "set_pretrained_source",
    "zero_config_from",
    "zero_config_from_deepspeed",
]
