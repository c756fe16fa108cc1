"""The state files that run checkpoints, `ZeroAccelerator.save_state` and `ZeroTrainer` share: written and
read back, damaged ones named, and `save_state` directories from before the one layout still read."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch

from tnlg.sharding.checkpoint import CheckpointError
from tnlg.state_files import (
    custom_state_files,
    read_custom_states,
    read_rank_state,
    read_scheduler_states,
    restore_rng,
    rng_state,
    write_rank_state,
    write_scheduler_states,
    write_state_files,
)


class HasState:
    """A scheduler or a registered object: what saving reads of it."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_rank_states_and_schedulers_round_trip_and_restore_the_generators(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    np.random.randn()  # numpy's state includes a cached Gaussian after an odd number of normal draws
    write_rank_state(tmp_path, 3, step=7)
    write_scheduler_states(tmp_path, [HasState({"a": 1}), HasState({"b": 2})])
    expected = (torch.rand(3), random.random(), np.random.randn(3))
    state = read_rank_state(tmp_path, 3)
    assert state["step"] == 7
    restore_rng(state["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.array_equal(np.random.randn(3), expected[2])
    assert read_scheduler_states(tmp_path, 2) == [{"a": 1}, {"b": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank-00003.json",
        "scheduler-1.json",
        "scheduler.json",
    ]


def test_rng_states_without_numpys_load_and_say_so(caplog):
    state = rng_state()
    del state["numpy"]  # written before numpy's state was saved
    np.random.seed(5)
    expected = np.random.rand()
    np.random.seed(5)
    with caplog.at_level(logging.WARNING, logger="tnlg.state_files"):
        restore_rng(state)
    assert "hold no numpy state" in caplog.text
    assert np.random.rand() == expected  # left as it was


def test_registered_objects_keep_their_tensors_in_safetensors(tmp_path):
    shared = torch.arange(6.0).reshape(2, 3)
    state = {"decay": 0.99, "shadow": {"w": shared, "w_view": shared[0]}, "history": [torch.ones(2), 3]}
    write_state_files(tmp_path, custom_state_files([HasState(state), HasState({"count": 3})]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "custom-0.json",
        "custom-0.safetensors",
        "custom-1.json",
    ]
    first, second = read_custom_states(tmp_path, 2)
    assert first["decay"] == 0.99 and first["history"][1] == 3 and second == {"count": 3}
    torch.testing.assert_close(first["shadow"]["w"], shared, rtol=0, atol=0)
    torch.testing.assert_close(first["shadow"]["w_view"], shared[0], rtol=0, atol=0)
    torch.testing.assert_close(first["history"][0], torch.ones(2), rtol=0, atol=0)


def test_a_state_dict_neither_format_holds_is_named_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match=r"registered for checkpointing #1 \(HasState\)"):
        custom_state_files([HasState({"ok": 1}), HasState({"handle": object()})])
    (tmp_path / "custom-0.safetensors").write_bytes(b"\x00\x01")  # damaged
    (tmp_path / "custom-0.json").write_text('{"w": {"__tensor__": "0"}}')
    with pytest.raises(CheckpointError, match=r"custom-0\.safetensors cannot be read"):
        read_custom_states(tmp_path, 1)


def test_a_registered_optimizer_keeps_its_moments_under_their_integer_keys(tmp_path):
    # JSON alone turned the parameter indices of `state` into "0", "1": the optimizer loaded its moments
    # under keys it never reads again and restarted Adam without a word.
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    write_state_files(tmp_path, custom_state_files([optimizer]))
    (state,) = read_custom_states(tmp_path, 1)
    assert sorted(state["state"]) == [0, 1] and state["param_groups"][0]["betas"] == (0.8, 0.9)
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    fresh.load_state_dict(state)
    for parameter in model.parameters():
        torch.testing.assert_close(
            fresh.state[parameter]["exp_avg"], optimizer.state[parameter]["exp_avg"], rtol=0, atol=0
        )


def test_tuples_and_keys_json_cannot_hold_read_back_as_they_were(tmp_path):
    state = {"pair": (1, (2.5, None)), "by_index": {0: "a", 2.5: "b", (1, 2): [torch.ones(2)], None: True}}
    write_state_files(tmp_path, custom_state_files([HasState(state)]))
    (read,) = read_custom_states(tmp_path, 1)
    assert read["pair"] == (1, (2.5, None))
    assert list(read["by_index"]) == [0, 2.5, (1, 2), None]
    torch.testing.assert_close(read["by_index"][(1, 2)][0], torch.ones(2), rtol=0, atol=0)
    # A dict that would read back as a marker is refused, not turned into a tensor or a tuple.
    with pytest.raises(CheckpointError, match="whose only key is '__tuple__'"):
        custom_state_files([HasState({"odd": {"__tuple__": [1]}})])
    with pytest.raises(CheckpointError, match="dict key"):
        custom_state_files([HasState({frozenset([1]): 0})])


def test_a_save_state_directory_of_the_earlier_layout_is_read(tmp_path):
    (tmp_path / "rng-rank-00001.json").write_text(json.dumps(rng_state()))
    (tmp_path / "scheduler-0.json").write_text(json.dumps({"last_epoch": 4}))
    assert read_rank_state(tmp_path, 1)["rng"]["torch"] == rng_state()["torch"]
    assert read_scheduler_states(tmp_path, 1) == [{"last_epoch": 4}]
    (tmp_path / "custom-0.json").write_text(json.dumps({"count": 2}))  # JSON only, no tensor file
    assert read_custom_states(tmp_path, 1) == [{"count": 2}]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "is missing"),
        ("{", "not valid JSON"),
        ('{"step": 1}', "holds no RNG states"),
        ('{"step": 1, "rng": {"python": [3, [0], null]}}', "lacks the torch RNG state"),
        ("a directory", "cannot be read .*IsADirectoryError"),  # an OSError other than a missing file
    ],
)
def test_a_missing_or_damaged_rank_file_is_named(tmp_path, content, message):
    if content == "a directory":
        (tmp_path / "rank-00000.json").mkdir()
    elif content is not None:
        (tmp_path / "rank-00000.json").write_text(content)
    with pytest.raises(CheckpointError, match=message) as raised:
        read_rank_state(tmp_path, 0)
    assert "rank-00000.json" in str(raised.value)


class FakeCuda:
    """Two visible GPUs' generators, this process on the second: torch.cuda's RNG calls, on CPU."""

    def __init__(self, monkeypatch):
        self.states = {
            0: torch.full((16,), 10, dtype=torch.uint8),
            1: torch.full((16,), 11, dtype=torch.uint8),
        }
        self.device = 1
        for name in ("is_available", "current_device", "get_rng_state", "set_rng_state", "get_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return True

    def current_device(self):
        return self.device

    def get_rng_state(self, device="cuda"):
        return self.states[self.device].clone()

    def set_rng_state(self, state, device="cuda"):
        self.states[self.device] = state.clone()

    def get_rng_state_all(self):
        return [self.states[i].clone() for i in sorted(self.states)]


def test_only_the_current_devices_cuda_state_is_saved_and_restored(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    state = rng_state()
    assert state["cuda"] == [11] * 16  # one state: the current device's
    cuda.states = {0: torch.zeros(16, dtype=torch.uint8), 1: torch.zeros(16, dtype=torch.uint8)}
    restore_rng(json.loads(json.dumps(state)))
    assert cuda.states[1].tolist() == [11] * 16
    assert cuda.states[0].tolist() == [0] * 16  # another rank's device is left alone


@pytest.mark.parametrize(("device", "expected"), [(1, [21] * 16), (2, [0] * 16)])
def test_a_file_with_every_devices_cuda_state_restores_the_current_ones(monkeypatch, device, expected):
    """Files written before held one state per visible device: the current device's entry is taken,
    and none is set where the file has no entry for it (written on a machine with fewer GPUs)."""
    cuda = FakeCuda(monkeypatch)
    cuda.states = {i: torch.zeros(16, dtype=torch.uint8) for i in range(3)}
    cuda.device = device
    state = rng_state()
    state["cuda"] = [[20] * 16, [21] * 16]
    restore_rng(state)
    assert cuda.states[device].tolist() == expected
    assert cuda.states[0].tolist() == [0] * 16
