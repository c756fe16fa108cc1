"""What the tests share: model and data builders, the rank functions that spawned processes run
(module level, so that a fresh interpreter can import them), and the repository's root."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
