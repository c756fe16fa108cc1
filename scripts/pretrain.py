"""Pretrain a TNLG model with the ZeRO engine: the main job.

    accelerate launch --multi_gpu --num_processes 2 scripts/pretrain.py
    accelerate launch scripts/pretrain.py --config configs/pretrain/debug.yaml --train.max_steps 20 --zero.stage 3
    accelerate launch scripts/pretrain.py --config configs/pretrain/debug.yaml --resume latest

Without `--config` it runs the embedded default (configs/pretrain/debug.yaml's settings): a small
model on the embedded Python corpus, ZeRO stage 2, a few hundred steps that visibly lower the loss
on a CPU in a few minutes. Any `--section.key value` overrides the config.
"""

from __future__ import annotations

from pathlib import Path

from tnlg.run.cli import exit_on_input_error, run_arguments
from tnlg.run.config import load_run_config
from tnlg.run.pretrain import pretrain

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "pretrain" / "debug.yaml"


def main(argv: list[str] | None = None) -> dict:
    args, overrides = run_arguments(__doc__, DEFAULT_CONFIG, argv)
    return pretrain(load_run_config(args.config, overrides), resume=args.resume)


if __name__ == "__main__":
    exit_on_input_error(main)()
