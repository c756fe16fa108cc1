"""Checkpoint conversion into TNLG: Transformers GPT-2 and Megatron-LM GPT.

from tnlg.tools.convert import from_gpt2, from_megatron
model = from_gpt2("path/to/gpt2")                # or a GPT2LMHeadModel instance
model = from_megatron("path/to/megatron_ckpt", vocab_size=50257)
"""

from tnlg.modeling import CheckpointMismatchError

from .gpt2 import from_gpt2, gpt2_state_dict_to_tnlg, tnlg_config_from_gpt2
from .megatron import from_megatron, megatron_state_dict_to_tnlg, read_megatron_checkpoint
from .state_dicts import build_model, copy_tokenizer_files, load_tensors

__all__ = [
    "CheckpointMismatchError",
    "build_model",
    "copy_tokenizer_files",
    "from_gpt2",
    "from_megatron",
    "gpt2_state_dict_to_tnlg",
    "load_tensors",
    "megatron_state_dict_to_tnlg",
    "read_megatron_checkpoint",
    "tnlg_config_from_gpt2",
]
