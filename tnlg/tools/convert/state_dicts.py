"""Reading foreign checkpoints without pickles, and loading converted tensors into a TNLG model.

Everything here is format-agnostic: the GPT-2 and Megatron converters map names and layouts, then
hand a TNLG-named state dict to `build_model`, which checks it against the model's own
parameter set before anything is assigned.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.loading import (
    CheckpointMismatchError,
    check_weight_files,
    inert_globals,
    open_safetensors,
    read_index,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint file or directory, pickle-free.

    Directories: a sharded safetensors index, single `*.safetensors` files, else a
    `pytorch_model.bin`. `.bin`/`.pt` files go through `torch.load(weights_only=True)`.
    """
    path = Path(path)
    if path.is_file():
        return _load_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint file or directory at {path}")
    index_files = sorted(path.glob("*.safetensors.index.json"))
    if index_files:
        return _load_safetensors(path, sorted(set(read_index(index_files[0]).values())))
    safetensors_files = sorted(path.glob("*.safetensors"))
    if safetensors_files:
        return _load_safetensors(path, [file.name for file in safetensors_files])
    for name in ("pytorch_model.bin", "model.pt"):
        if (path / name).is_file():
            return _load_file(path / name)
    raise FileNotFoundError(f"{path} holds no *.safetensors, pytorch_model.bin or model.pt")


def _load_safetensors(directory: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of `files`, each file checked first: it must open as safetensors and match the
    directory's checksum record when it has one ([Note: checksums] in tnlg/modeling/loading.py)."""
    check_weight_files(directory, files)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with open_safetensors(directory / name) as reader:
            tensors.update({key: reader.get_tensor(key) for key in reader.keys()})  # noqa: SIM118
    return tensors


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return _load_safetensors(path.parent, [path.name])
    loaded = load_torch_file(path)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
    return dict(loaded)


def load_torch_file(path: str | Path) -> object:
    """`torch.load` with `weights_only=True`, allowing only the plain containers checkpoints carry.

    Megatron checkpoints store their arguments as an `argparse.Namespace` and RNG states as numpy
    arrays; those types are allow-listed, and the enums, paths and namespaces inside the args are
    rebuilt as inert stubs (`_megatron_enum_stubs`). Anything else (arbitrary classes) is refused
    with the list of globals the file wants, never executed.
    """
    if Path(path).is_file() and Path(path).stat().st_size == 0:  # torch's own message is empty then
        raise ValueError(f"{path} is empty (0 bytes): a checkpoint file cut short, or never written")
    safe = [argparse.Namespace, *_numpy_safe_globals(), *_megatron_enum_stubs(path)]
    try:
        with torch.serialization.safe_globals(safe):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError with the blocked global's name
        try:
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:
            wanted = []
        raise ValueError(
            f"{path} cannot be read safely with torch.load(weights_only=True): {error}. "
            f"Globals it needs beyond plain tensors: {wanted or 'unknown'}. Re-save the state dict "
            "alone (e.g. torch.save(model.state_dict(), ...)) or as safetensors."
        ) from error


# Standard-library types Megatron-LM's saved `args` hold as plain data (megatron-core 0.19: the
# `exit_signal` enum, paths, namespaces). They are rebuilt as inert stubs too, not as themselves: the
# converter reads a few numbers and flags of the args, never these values.
INERT_ARG_TYPES = frozenset(
    {
        "signal.Signals",
        "pathlib.Path",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "pathlib.WindowsPath",
        "pathlib.PureWindowsPath",
        "types.SimpleNamespace",
    }
)


def _megatron_enum_stubs(path: Path) -> list[tuple[type, str]]:
    """Inert stand-ins (`inert_globals`) for the Megatron enums its saved `args` hold (e.g.
    `ModelType`), and for the standard-library types of INERT_ARG_TYPES: loading them must not
    import (or execute) Megatron."""
    return inert_globals(path, lambda name: name.startswith("megatron.") or name in INERT_ARG_TYPES)


def _numpy_safe_globals() -> list[object]:
    try:
        import numpy as np
    except ImportError:
        return []
    reconstruct = getattr(np, "_core", np.core).multiarray._reconstruct  # numpy 2 / 1
    dtype_classes = [type(np.dtype(name)) for name in ("uint32", "float64", "int64", "float32")]
    return [reconstruct, np.ndarray, np.dtype, *dtype_classes]


def build_model(
    config: TNLGConfig, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint"
) -> TNLGForCausalLM:
    """A `TNLGForCausalLM` holding exactly `state_dict`'s tensors (no random init, no extra copy).

    The model is built on the meta device, the state dict is checked name by name and shape by
    shape against it, and only then are the tensors assigned. With tied embeddings the output
    layer may be absent (it is the token embedding); if present it must equal it.
    """
    with torch.device("meta"):
        model = TNLGForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    provided = dict(state_dict)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        head = provided.pop("lm_head.weight", None)
        embedding = provided.get("model.embed_tokens.weight")
        if head is not None and embedding is not None and not torch.equal(head, embedding):
            raise ValueError(
                f"{source} has an output layer that differs from its token embedding, but the config "
                "ties them; convert with tie_word_embeddings=False"
            )
    missing = sorted(set(expected) - set(provided))
    unexpected = sorted(set(provided) - set(expected))
    mis_shaped = [
        (name, tuple(provided[name].shape), shape)
        for name, shape in expected.items()
        if name in provided and tuple(provided[name].shape) != shape
    ]
    if missing or unexpected or mis_shaped:
        raise CheckpointMismatchError(missing, unexpected, mis_shaped, source)
    model.load_state_dict(provided, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def copy_tokenizer_files(source_dir: str | Path, output_dir: str | Path) -> list[str]:
    """Copy the tokenizer files found in `source_dir` (if it is a directory); returns their names."""
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    if not source_dir.is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, output_dir / name)
            copied.append(name)
    return copied
