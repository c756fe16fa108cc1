"""The optional `datasets` package, imported only where data is read through it.

[Note: optional datasets]
`datasets` reads parquet corpus files, `dataset=` corpus sources (hub or local) and every fine-tuning
split (files, builders, `save_to_disk` directories, the embedded sets). Pretraining on jsonl /
jsonl.zst / jsonl.gz files, the embedded corpus or pre-tokenized data never needs it, and the GPU
image has none (it installs tnlg with `pip install --no-deps -e .`): no module imports `datasets`
at module level, and a feature that needs it asks for it here, at the point of use, so that its
absence is an ImportError that names the feature and the install command.
"""

from __future__ import annotations

from types import ModuleType

INSTALL_HINT = "pip install datasets"


def require_datasets(feature: str) -> ModuleType:
    """The `datasets` module; ImportError naming `feature` and the install command when it cannot be
    imported (absent, or broken: the cause is kept in the message and chained)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(f"{feature} needs the `datasets` package ({error}): {INSTALL_HINT}") from error
    return datasets
