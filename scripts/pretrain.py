"""Pretrain a TNLG model with the ZeRO engine: the main job.

    accelerate launch --multi_gpu --num_processes 2 scripts/pretrain.py
    accelerate launch scripts/pretrain.py --config configs/pretrain/debug.yaml --train.max_steps 20 --zero.stage 3
    accelerate launch scripts/pretrain.py --config configs/pretrain/debug.yaml --resume latest

Without `--config` it runs the embedded default (configs/pretrain/debug.yaml's settings): a small
model on the embedded Python corpus, ZeRO stage 2, a few hundred steps that visibly lower the loss
on a CPU in a few minutes. Any `--section.key value` overrides the config.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tnlg.config import load_run_config
from tnlg.train import pretrain

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "debug.yaml"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML run config")
    parser.add_argument("--resume", help="'latest' or a checkpoint directory")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)
    return pretrain(load_run_config(args.config, overrides), resume=args.resume)


if __name__ == "__main__":
    main()
