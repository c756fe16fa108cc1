"""The debug pretraining run built by `tnlg.run.loop.build_run` inside a spawned rank, for the tests
that drive `train_step` themselves."""

from __future__ import annotations

import os

from tests.support import REPO

DEBUG = REPO / "configs" / "pretrain" / "debug.yaml"


def build_debug_run(cache: str, overrides: list[str]):
    """configs/pretrain/debug.yaml with `overrides`, built (tokenizer cached under `cache`); its `Run`."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.config import load_run_config
    from tnlg.run.loop import TrainingJob, build_run
    from tnlg.run.pretrain import training_stream

    config = load_run_config(DEBUG, overrides)
    job = TrainingJob(
        name="test",
        seq_len=config.data.seq_len,
        tokenizer=config.data.tokenizer,
        batches=lambda tokenizer, rank, world: training_stream(config, tokenizer, rank, world),
    )
    return build_run(config, job)
