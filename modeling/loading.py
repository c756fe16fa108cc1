"""Strict checkpoint loading: a checkpoint that does not fit the model is an error, not a warning.

Transformers' `from_pretrained` initialises missing tensors randomly and drops unexpected ones with
a warning; for a training run that silently corrupts a resumed or converted model. TNLG raises
`CheckpointMismatchError` listing every offending tensor instead (`strict=False` restores the
Transformers behaviour).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit the model: lists every missing, unexpected and mis-shaped tensor."""

    def __init__(
        self,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mis_shaped: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
        source: str = "checkpoint",
    ):
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        self.mis_shaped = sorted(mis_shaped)
        lines = [f"{source} does not match the TNLG model:"]
        if self.missing:
            lines.append(f"  missing ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        for name, got, want in self.mis_shaped:
            lines.append(f"  mis-shaped: {name} has shape {list(got)}, the model expects {list(want)}")
        super().__init__("\n".join(lines))


def raise_on_mismatch(loading_info: dict, source: str) -> None:
    """Raise `CheckpointMismatchError` if Transformers' loading info reports any mismatch."""
    missing = loading_info.get("missing_keys") or ()
    unexpected = loading_info.get("unexpected_keys") or ()
    mis_shaped = [
        (str(entry[0]), tuple(entry[1]), tuple(entry[2]))
        if isinstance(entry, tuple) and len(entry) == 3
        else (str(entry), (), ())
        for entry in loading_info.get("mismatched_keys") or ()
    ]
    if missing or unexpected or mis_shaped:
        raise CheckpointMismatchError(missing, unexpected, mis_shaped, source)


def check_tied_output_layer(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Refuse a local checkpoint whose saved output layer differs from the embedding it is tied to.

    Transformers ties the weights after loading and silently drops the saved `lm_head.weight`;
    if that tensor differs, the checkpoint came from an untied model and loading it tied
    computes a different function. Only `lm_head.weight` is read, and only when it was saved.
    """
    if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return
    directory = Path(checkpoint)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text())["weight_map"].get("lm_head.weight")
        files = [directory / shard] if shard else []
    else:
        files = [directory / "model.safetensors"] if (directory / "model.safetensors").is_file() else []
    for file in files:
        with safe_open(file, framework="pt") as reader:
            if "lm_head.weight" not in reader.keys():  # noqa: SIM118 (safe_open has no __contains__)
                continue
            saved = reader.get_tensor("lm_head.weight")
        embedding = model.get_input_embeddings().weight
        if saved.shape != embedding.shape or not torch.equal(
            saved.to(embedding.dtype), embedding.detach().cpu()
        ):
            raise CheckpointMismatchError(
                mis_shaped=[],
                source=f"{checkpoint} (its lm_head.weight differs from the token embedding, but the config ties "
                "them; load it with tie_word_embeddings=False)",
            )
