"""The pretraining run under faults: a non-finite loss on one rank, ranks launched with different jobs."""

from __future__ import annotations

import math
import os

import pytest

from tests.support import REPO
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)


def _pretrain(rank, world_size, cache, output, overrides, poison_step=None):
    """The debug run for a few steps; `poison_step`: rank 1's loss at that training step is NaN."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.modeling import TNLGForCausalLM
    from tnlg.run.config import load_run_config
    from tnlg.run.launch_checks import LaunchMismatchError
    from tnlg.run.loop import NonFiniteLossError
    from tnlg.run.pretrain import pretrain

    if poison_step is not None:
        original, calls = TNLGForCausalLM.forward, [0]

        def forward(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            if self.training:
                calls[0] += 1
                if rank == 1 and calls[0] == poison_step:
                    output.loss = output.loss * math.nan
            return output

        TNLGForCausalLM.forward = forward
    arguments = [
        "--train.max_steps", "5", "--train.eval_every", "0", "--train.save_every", "0",
        "--train.output_dir", output, "--logging.trackers", "[]", *overrides,
    ]  # fmt: skip
    config = load_run_config(REPO / "configs" / "pretrain" / "debug.yaml", arguments)
    try:
        return {"losses": pretrain(config)["losses"]}
    except (NonFiniteLossError, LaunchMismatchError) as error:
        return {"error": f"{type(error).__name__}: {error}"}


def test_a_nan_loss_on_one_rank_stops_every_rank_naming_the_step_and_data(cache, tmp_path):
    results = run_distributed(_pretrain, 2, str(cache), str(tmp_path), [], 3, timeout=600)
    for result in results:
        assert "NonFiniteLossError: step 3: the mean loss over the ranks is nan" in result["error"]
        assert "data position after this step's batches" in result["error"]


def test_a_nan_loss_can_be_skipped(cache, tmp_path):
    clean = run_distributed(_pretrain, 2, str(cache), str(tmp_path / "clean"), [], timeout=600)[0]
    skipped = run_distributed(
        _pretrain,
        2,
        str(cache),
        str(tmp_path / "skip"),
        ["--train.on_nonfinite_loss", "skip"],
        3,
        timeout=600,
    )[0]
    losses = skipped["losses"]
    assert losses[:2] == clean["losses"][:2]
    assert math.isnan(losses[2])
    # The poisoned step changed nothing: step 4 starts from the weights of step 2, so it differs from
    # the clean run's (which had one more update) but is finite and the run completes.
    assert all(math.isfinite(v) for v in losses[3:]) and len(losses) == 5
    assert losses[3] != clean["losses"][3]


def _mismatched(rank, world_size, cache, output):
    overrides = ["--optimizer.lr", "1e-3"] if rank == 1 else []
    return _pretrain(rank, world_size, cache, output, overrides)


def test_ranks_started_with_different_configs_all_stop_with_a_clear_error(cache, tmp_path):
    results = run_distributed(_mismatched, 2, str(cache), str(tmp_path), timeout=600)
    for result in results:
        assert (
            "LaunchMismatchError: the ranks of this launch were started with different jobs"
            in result["error"]
        )
        assert "rank 1 has a different run config" in result["error"]
