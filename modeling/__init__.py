"""tnlg.modeling: the TNLG GPT decoder as a Transformers model (knows nothing about sharding)."""

from .configuration_tnlg import GPT2_VOCAB_SIZE, PADDED_GPT2_VOCAB_SIZE, PRESETS, Preset, TNLGConfig
from .loading import CheckpointFileError, CheckpointMismatchError
from .modeling_tnlg import TNLGForCausalLM, TNLGModel, TNLGPreTrainedModel

__all__ = [
    "GPT2_VOCAB_SIZE",
    "PADDED_GPT2_VOCAB_SIZE",
    "PRESETS",
    "CheckpointFileError",
    "CheckpointMismatchError",
    "Preset",
    "TNLGConfig",
    "TNLGForCausalLM",
    "TNLGModel",
    "TNLGPreTrainedModel",
]
