"""Fine-tune a TNLG checkpoint for summarization or question answering with the ZeRO engine.

    accelerate launch --multi_gpu --num_processes 2 scripts/finetune.py --config configs/finetune/summarization.yaml
    accelerate launch scripts/finetune.py --config configs/finetune/qa.yaml --zero.stage 2 --lora.enabled true
    accelerate launch scripts/finetune.py --config configs/finetune/summarization.yaml --resume latest

The configs start from the embedded default pretraining run's model (run scripts/pretrain.py
first, or set --model.init_from to any TNLG checkpoint directory). Any `--section.key value`
overrides the config; see tnlg/run/finetune_config.py for every key.
"""

from __future__ import annotations

from pathlib import Path

from tnlg.run.cli import exit_on_input_error, run_arguments
from tnlg.run.finetune import finetune
from tnlg.run.finetune_config import load_finetune_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "summarization.yaml"


def main(argv: list[str] | None = None) -> dict:
    args, overrides = run_arguments(__doc__, DEFAULT_CONFIG, argv)
    return finetune(load_finetune_config(args.config, overrides), resume=args.resume)


if __name__ == "__main__":
    exit_on_input_error(main)()
