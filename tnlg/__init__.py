"""tnlg: Turing-NLG scale GPT training and inference in the Hugging Face ecosystem.

Importing `tnlg` registers the TNLG model with Transformers' Auto classes, so
`AutoConfig`, `AutoModel` and `AutoModelForCausalLM` load `model_type: "tnlg"` checkpoints.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto import modeling_auto

from tnlg.modeling import TNLGConfig, TNLGForCausalLM, TNLGModel, TNLGPreTrainedModel

__version__ = "0.1.0"


def _register_with_auto_classes() -> None:
    # exist_ok: re-importing (e.g. importlib.reload in a notebook) must not fail.
    AutoConfig.register(TNLGConfig.model_type, TNLGConfig, exist_ok=True)
    AutoModel.register(TNLGConfig, TNLGModel, exist_ok=True)
    AutoModelForCausalLM.register(TNLGConfig, TNLGForCausalLM, exist_ok=True)
    # register() does not list a model among the causal LMs by name, and that list is how Transformers
    # tells one: the Trainer's label smoothing shifts the labels only for the classes it names (without
    # it, label_smoothing_factor trained TNLG to repeat each token, not predict the next), as do the
    # text-generation pipeline's model check and `transformers serve`. Listed as GPT-2 is.
    names = getattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", None)
    if names is not None:
        names.setdefault(TNLGConfig.model_type, TNLGForCausalLM.__name__)


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
