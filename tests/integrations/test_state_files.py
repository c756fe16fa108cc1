"""The state files that run checkpoints, `ZeroAccelerator.save_state` and `ZeroTrainer` share: written and
read back, damaged ones named, and `save_state` directories from before the one layout still read."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tnlg.sharding.checkpoint import CheckpointError
from tnlg.state_files import (
    read_rank_state,
    read_scheduler_states,
    restore_rng,
    rng_state,
    write_rank_state,
    write_scheduler_states,
)


class Scheduler:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_rank_states_and_schedulers_round_trip_and_restore_the_generators(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    write_rank_state(tmp_path, 3, step=7)
    write_scheduler_states(tmp_path, [Scheduler({"a": 1}), Scheduler({"b": 2})])
    expected = (torch.rand(3), random.random())
    state = read_rank_state(tmp_path, 3)
    assert state["step"] == 7
    restore_rng(state["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert read_scheduler_states(tmp_path, 2) == [{"a": 1}, {"b": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank-00003.json",
        "scheduler-1.json",
        "scheduler.json",
    ]


def test_a_save_state_directory_of_the_earlier_layout_is_read(tmp_path):
    (tmp_path / "rng-rank-00001.json").write_text(json.dumps(rng_state()))
    (tmp_path / "scheduler-0.json").write_text(json.dumps({"last_epoch": 4}))
    assert read_rank_state(tmp_path, 1)["rng"]["torch"] == rng_state()["torch"]
    assert read_scheduler_states(tmp_path, 1) == [{"last_epoch": 4}]


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "is missing"), ("{", "not valid JSON"), ('{"step": 1}', "holds no RNG states")],
)
def test_a_missing_or_damaged_rank_file_is_named(tmp_path, content, message):
    if content is not None:
        (tmp_path / "rank-00000.json").write_text(content)
    with pytest.raises(CheckpointError, match=message) as raised:
        read_rank_state(tmp_path, 0)
    assert "rank-00000.json" in str(raised.value)
