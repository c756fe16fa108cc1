"""Checkpoint conversion into TNLG (Transformers GPT-2, Megatron-LM GPT, DeepSpeed ZeRO), and out to GPT-2.

from tnlg.tools.convert import export_gpt2, from_gpt2, from_megatron
model = from_gpt2("path/to/gpt2")                # or a GPT2LMHeadModel instance
model = from_megatron("path/to/megatron_ckpt", vocab_size=50257)
model = from_deepspeed("path/to/checkpoint-N")  # a DeepSpeed ZeRO checkpoint (Trainer layout or not)
export_gpt2(model, "out/gpt2")                   # or a saved model / engine checkpoint directory
"""

from tnlg.modeling import CheckpointMismatchError

from .deepspeed import from_deepspeed
from .gpt2 import from_gpt2, gpt2_state_dict_to_tnlg, tnlg_config_from_gpt2
from .megatron import from_megatron, megatron_state_dict_to_tnlg, read_megatron_checkpoint
from .state_dicts import build_model, copy_tokenizer_files, load_tensors
from .to_gpt2 import export_gpt2, gpt2_config, tnlg_state_to_gpt2

__all__ = [
    "CheckpointMismatchError",
    "build_model",
    "copy_tokenizer_files",
    "export_gpt2",
    "from_deepspeed",
    "from_gpt2",
    "from_megatron",
    "gpt2_config",
    "gpt2_state_dict_to_tnlg",
    "load_tensors",
    "megatron_state_dict_to_tnlg",
    "read_megatron_checkpoint",
    "tnlg_config_from_gpt2",
    "tnlg_state_to_gpt2",
]
