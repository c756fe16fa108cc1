"""What the run scripts share: their arguments (a YAML config, `--resume`, `--section.key value`
overrides) and their logging."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


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
