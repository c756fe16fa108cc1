"""tnlg.sharding: the ZeRO engine on torch.distributed (knows nothing about GPT).

from tnlg.sharding import ZeroConfig, initialize
engine = initialize(model, optimizer, ZeroConfig(stage=3, mixed_precision="bf16"))
loss = engine(**batch).loss
engine.backward(loss)
engine.step()
"""

from .collectives import CommStats
from .config import ZeroConfig, parse_deepspeed
from .engine import ZeroEngine, initialize
from .init import init_weights, materialize
from .pretrained import PretrainedSource, SafetensorsCheckpoint, meta_from_pretrained, set_pretrained_source

__all__ = [
    "CommStats",
    "PretrainedSource",
    "SafetensorsCheckpoint",
    "ZeroConfig",
    "ZeroEngine",
    "init_weights",
    "initialize",
    "materialize",
    "meta_from_pretrained",
    "parse_deepspeed",
    "set_pretrained_source",
]
