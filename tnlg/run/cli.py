"""What the run scripts share: their arguments (a YAML config, `--resume`, `--section.key value`
overrides), their logging, and how a bad input ends them (`exit_on_input_error`)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# What bad input raises: a config value, a file that is missing, damaged or of the wrong kind, a
# directory a run would overwrite. The library's messages name the setting or the file, so the message
# alone is what a user needs; anything else is a bug and keeps its traceback.
INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)
TRACEBACK_VARIABLE = "TNLG_TRACEBACK"  # =1 shows the traceback of input errors too
# Launchers poll their processes every 0.1 s (torchrun's and Accelerate's default monitor interval).
OTHER_RANKS_GRACE_SECONDS = 10.0


def exit_on_input_error(main: Callable[..., T]) -> Callable[..., T]:
    """Run a script's `main`; an input error ends it with one line `error: <message>` and exit status 2.

    Under a launcher every rank reads the same configs and files (checkpoint reads agree across ranks,
    see read_on_every_rank), so every rank fails with the same message at about the same time: rank 0
    prints it at once, and the launcher stops the other ranks as soon as rank 0 exits. Another rank
    prints its message only if it is still running after a grace period, i.e. when rank 0 did not stop
    with it: a failure of that rank alone is still reported. `TNLG_TRACEBACK=1` re-raises instead.
    """

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except INPUT_ERRORS as error:
            if os.environ.get(TRACEBACK_VARIABLE) == "1":
                raise
            rank = os.environ.get("RANK", "0")
            if rank != "0":
                time.sleep(OTHER_RANKS_GRACE_SECONDS)
            message = " ".join(str(error).split()) or type(error).__name__
            prefix = "error" if rank == "0" else f"error (rank {rank})"
            # The script's one line to its user (library code logs; this is the scripts' entry point).
            sys.stderr.write(f"{prefix}: {message}\n")
            sys.stderr.flush()
            sys.exit(2)

    return guarded


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)


def run_arguments(
    description: str, default_config: Path, argv: list[str] | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """(`--config` and `--resume`, the remaining `--section.key value` overrides), logging configured."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=default_config, help="YAML run config")
    parser.add_argument("--resume", help="'latest' or a checkpoint directory")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    return args, overrides
