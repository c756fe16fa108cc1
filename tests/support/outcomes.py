"""How a rank function reports what it tried: the text of what it raised, so that the test compares every
rank's error by type and message (a rank left waiting until a timeout raises something else)."""

from __future__ import annotations

from collections.abc import Callable


def raised_or(attempt: Callable[[], object], done: str) -> str:
    """`done` when `attempt()` returns, else what it raised as "TypeName: message"."""
    try:
        attempt()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return done
