"""tnlg.modeling: the TNLG GPT decoder as a Transformers model (knows nothing about sharding)."""

from .configuration_tnlg import GPT2_VOCAB_SIZE, PADDED_GPT2_VOCAB_SIZE, PRESETS, Preset, TNLGConfig
from .loading import CheckpointFileError, CheckpointMismatchError
from .modeling_tnlg import TNLGForCausalLM, TNLGModel, TNLGPreTrainedModel
from .tensor_parallel import TensorSlice, apply_tensor_parallel, tensor_slices

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
    "TensorSlice",
    "apply_tensor_parallel",
    "tensor_slices",
]
