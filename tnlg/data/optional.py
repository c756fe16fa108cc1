"""The optional `datasets` and `zstandard` packages, imported only where data is read through them.

[Note: optional datasets]
`datasets` reads parquet corpus files, `dataset=` corpus sources (hub or local) and every fine-tuning
split (files, builders, `save_to_disk` directories, the embedded sets). Pretraining on jsonl /
jsonl.zst / jsonl.gz files, the embedded corpus or pre-tokenized data never needs it. `zstandard` is
needed only where `.zst` bytes are read or written (`.jsonl.zst` corpus files, the embedded corpus);
plain and `.gz` files never need it. The GPU image has neither (it installs tnlg with
`pip install --no-deps -e .`): no module imports them at module level, and a feature that needs one
asks for it here, at the point of use, so that its absence is an ImportError that names the feature
and the install command. An `except` clause that names one of their error types must not import the
package just to name it (see `loaded_error_types`).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

INSTALL_HINT = "pip install datasets"
ZSTANDARD_INSTALL_HINT = "pip install zstandard"


def require_datasets(feature: str) -> ModuleType:
    """The `datasets` module; ImportError naming `feature` and the install command when it cannot be
    imported (absent, or broken: the cause is kept in the message and chained)."""
    return _require("datasets", feature, INSTALL_HINT)


def require_zstandard(feature: str) -> ModuleType:
    """The `zstandard` module; ImportError naming `feature` and the install command when it cannot be
    imported (absent, or broken: the cause is kept in the message and chained)."""
    return _require("zstandard", feature, ZSTANDARD_INSTALL_HINT)


def loaded_error_types(*names: tuple[str, str]) -> tuple[type[BaseException], ...]:
    """The error classes `(module, attribute)` of the optional modules that are already imported.

    For an `except` clause: a module that was never imported cannot have raised its error, so its
    class is left out rather than imported (which would need the package where nothing else does).
    """
    found = (getattr(sys.modules.get(module), attribute, None) for module, attribute in names)
    return tuple(kind for kind in found if isinstance(kind, type) and issubclass(kind, BaseException))


def _require(module: str, feature: str, hint: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{feature} needs the `{module}` package ({error}): {hint}") from error
