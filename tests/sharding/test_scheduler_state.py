"""The engine's DeepSpeed-JSON schedule file: a state JSON cannot hold is the checkpoint's error, a
CheckpointError naming the scheduler (as a run checkpoint's scheduler file is), and nothing is written."""

from __future__ import annotations

import pytest
import torch

from tnlg.sharding.checkpoint import CheckpointError
from tnlg.sharding.scheduler_state import SCHEDULER_FILE, read_scheduler_state, save_scheduler_state


class _TensorInState(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler that keeps a tensor in its state, which JSON cannot hold."""

    def state_dict(self):
        return {**super().state_dict(), "warmup_end": torch.tensor(10)}


def _optimizer() -> torch.optim.SGD:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)


def test_a_state_json_cannot_hold_is_refused_naming_the_scheduler(tmp_path):
    scheduler = _TensorInState(_optimizer(), lambda _: 1.0)
    with pytest.raises(
        CheckpointError, match=r"_TensorInState learning-rate scheduler cannot be saved: .*Tensor"
    ):
        save_scheduler_state(scheduler, tmp_path)
    assert not (tmp_path / SCHEDULER_FILE).exists()


def test_a_state_json_holds_is_written_and_read_back(tmp_path):
    optimizer = _optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    optimizer.step()
    scheduler.step()
    save_scheduler_state(scheduler, tmp_path)
    assert read_scheduler_state(scheduler, tmp_path) == scheduler.state_dict()
