"""tnlg: Turing-NLG scale GPT training and inference in the Hugging Face ecosystem.

Importing `tnlg` registers the TNLG model with Transformers' Auto classes, so
`AutoConfig`, `AutoModel` and `AutoModelForCausalLM` load `model_type: "tnlg"` checkpoints.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from tnlg.modeling import TNLGConfig, TNLGForCausalLM, TNLGModel, TNLGPreTrainedModel

__version__ = "0.1.0"


def _register_with_auto_classes() -> None:
    # exist_ok: re-importing (e.g. importlib.reload in a notebook) must not fail.
    AutoConfig.register(TNLGConfig.model_type, TNLGConfig, exist_ok=True)
    AutoModel.register(TNLGConfig, TNLGModel, exist_ok=True)
    AutoModelForCausalLM.register(TNLGConfig, TNLGForCausalLM, exist_ok=True)


_register_with_auto_classes()

# Imported on first use: Accelerate and Trainer are heavy, and `import tnlg` serves model loading too.
_LAZY = {"ZeroAccelerator": "tnlg.accelerate", "ZeroTrainer": "tnlg.trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tnlg' has no attribute {name!r}")


__all__ = [
    "TNLGConfig",
    "TNLGForCausalLM",
    "TNLGModel",
    "TNLGPreTrainedModel",
    "ZeroAccelerator",
    "ZeroTrainer",
    "__version__",
]
