"""ZeroAccelerator keeps Accelerate's public behaviour around the engine: save_state / load_state restore
numpy's generator, `accelerator.step` and the state pre-hooks, and registered objects holding tensors;
a save that cannot complete fails on every rank before anything is written; backward refuses what the
engine cannot pass on; gather_for_metrics returns the dataset once under tensor slicing."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.accelerate_cases import Unsaveable, WarningRecords, prepared, train_loop
from tests.support.zero_tnlg_cases import debug_model
from tnlg.sharding import ZeroConfig
from tnlg.sharding.checkpoint import CheckpointError
from tnlg.tools.spawn import run_distributed


def _numpy_masked(batch: dict) -> dict:
    """A data augmentation drawn from numpy's global generator, as many pipelines do: some labels masked."""
    keep = torch.from_numpy(np.random.rand(*batch["labels"].shape) > 0.3)
    return {**batch, "labels": torch.where(keep, batch["labels"], torch.full_like(batch["labels"], -100))}


def _without(path: Path, drop) -> None:
    state = json.loads(path.read_text())
    drop(state)
    path.write_text(json.dumps(state))


def _resumed(rank: int, world_size: int, directory: str) -> dict:
    np.random.seed(123 + rank)
    whole = train_loop(*prepared(2), augment=_numpy_masked)
    np.random.seed(123 + rank)
    accelerator, model, optimizer, loader, scheduler = prepared(2)
    calls = []
    accelerator.register_save_state_pre_hook(
        lambda models, weights, out: calls.append(("save", [type(m).__name__ for m in models], weights, out))
    )
    half = len(loader) // 2
    train_loop(accelerator, model, optimizer, itertools.islice(loader, half), scheduler, _numpy_masked)
    saved_step = accelerator.step
    accelerator.save_state(directory)
    np.random.seed(999)  # a relaunched process starts from other states
    accelerator, model, optimizer, loader, scheduler = prepared(2)
    accelerator.register_load_state_pre_hook(lambda models, in_dir: calls.append(("load", models, in_dir)))
    accelerator.load_state(directory)
    restored_step = accelerator.step
    rest = train_loop(
        accelerator, model, optimizer, accelerator.skip_first_batches(loader, half), scheduler, _numpy_masked
    )
    # A directory saved before numpy's state and the step were kept still loads, saying what it lacks.
    accelerator.wait_for_everyone()
    _without(
        Path(directory) / f"rank-{rank:05d}.json",
        lambda s: (s.pop("accelerator_step", None), s["rng"].pop("numpy", None)),
    )
    accelerator.step = 5  # whatever it is, a file without the step leaves it so
    records = WarningRecords()
    logging.getLogger("tnlg").addHandler(records)
    accelerator.load_state(directory)
    logging.getLogger("tnlg").removeHandler(records)
    return {
        "whole": whole, "rest": rest, "half": half, "calls": calls, "saved_step": saved_step,
        "restored_step": restored_step, "old": records.messages, "step_after_old": accelerator.step,
    }  # fmt: skip


@pytest.mark.slow
def test_save_state_restores_numpy_the_step_and_runs_the_hooks_as_accelerate(tmp_path):
    results = run_distributed(_resumed, 2, str(tmp_path / "state"), timeout=600)
    for result in results:
        # numpy's generator came back: the masks, and so the losses, are the uninterrupted run's
        assert result["rest"] == pytest.approx(result["whole"][result["half"] :], rel=1e-6)
        assert result["restored_step"] == result["saved_step"] == result["half"]
        # Accelerate's hooks, given what it gives them under DeepSpeed: no weights, no models to load
        loaded = ("load", [], str(tmp_path / "state"))  # once per load_state: the resume, then the old files
        assert result["calls"] == [("save", ["ZeroEngine"], [], str(tmp_path / "state")), loaded, loaded]
        assert any("holds no accelerator step" in m for m in result["old"]), result["old"]
        assert any("hold no numpy state" in m for m in result["old"]), result["old"]
        assert result["step_after_old"] == 5


class _Counter:
    def __init__(self):
        self.count = 3

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _registered(rank: int, world_size: int, directory: str) -> dict:
    accelerator, *_ = prepared(2)
    torch.manual_seed(0)
    ema, counter = torch.nn.Linear(4, 4), _Counter()  # an EMA copy as a module: its state_dict is tensors
    accelerator.register_for_checkpointing(ema, counter)
    saved = {name: tensor.clone() for name, tensor in ema.state_dict().items()}
    accelerator.save_state(f"{directory}/good")
    with torch.no_grad():
        ema.weight.zero_()
    counter.count = 0
    accelerator.load_state(f"{directory}/good")
    restored = all(torch.equal(ema.state_dict()[name], tensor) for name, tensor in saved.items())
    accelerator.register_for_checkpointing(Unsaveable())
    try:
        accelerator.save_state(f"{directory}/bad")
        refused = None
    except CheckpointError as error:
        refused = str(error)
    return {
        "restored": restored and counter.count == 3,
        "refused": refused,
        "good": sorted(p.name for p in Path(f"{directory}/good").iterdir()),
        "bad": sorted(p.name for p in Path(f"{directory}/bad").iterdir()),
    }


@pytest.mark.slow
def test_registered_objects_with_tensors_round_trip_and_an_unsaveable_one_fails_everywhere_first(tmp_path):
    # A short collective timeout: a rank left waiting for one that failed would fail the test, not hang it.
    results = run_distributed(_registered, 2, str(tmp_path), timeout=300, collective_timeout=30)
    for result in results:
        assert result["restored"]
        assert {"custom-0.json", "custom-0.safetensors", "custom-1.json"} <= set(result["good"])
        assert "custom-1.safetensors" not in result["good"]  # a JSON-only state needs no tensor file
        assert "object registered for checkpointing #2 (Unsaveable)" in result["refused"]
        assert result["bad"] == []  # refused before the engine or any state file was written


def _backward_keywords(rank: int, world_size: int) -> dict:
    accelerator, model, _, loader, _ = prepared(2)
    batch = next(iter(loader))
    found = {}
    first = next(p for p in model.parameters() if p.requires_grad)
    for name, value in (("retain_graph", True), ("create_graph", True), ("inputs", [first])):
        try:
            accelerator.backward(model(**batch).loss, **{name: value})
            found[name] = "passed"
        except ValueError as error:
            found[name] = str(error)
    accelerator.backward(model(**batch).loss, retain_graph=False)  # the default, spelled out: fine
    return found


def test_backward_refuses_by_name_what_the_engine_cannot_pass_on():
    found = run_distributed(_backward_keywords, 1, timeout=300)[0]
    for name in ("retain_graph", "create_graph", "inputs"):
        assert f"ZeroAccelerator.backward(loss, {name}=...)" in found[name], found
        assert f"cannot pass {name} on" in found[name]


def _gathered(rank: int, world_size: int) -> dict:
    from accelerate.parallelism_config import ParallelismConfig

    from tnlg.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(
        zero_config=ZeroConfig(stage=1), parallelism_config=ParallelismConfig(tp_size=2)
    )
    model = debug_model()
    model, _, loader = accelerator.prepare(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.DataLoader(list(range(5)), batch_size=2),
    )
    return {
        "tensors": [accelerator.gather_for_metrics(batch).tolist() for batch in loader],
        "objects": [accelerator.gather_for_metrics([f"s{int(i)}" for i in batch]) for batch in loader],
    }


@pytest.mark.slow
def test_gather_for_metrics_returns_the_dataset_once_under_tensor_slicing():
    # 4 ranks: tensor 2 x data 2, tensor innermost; the two ranks of a tensor group read the same batches.
    for result in run_distributed(_gathered, 4, timeout=600):
        assert sorted(i for batch in result["tensors"] for i in batch) == [0, 1, 2, 3, 4]
        assert sorted(s for batch in result["objects"] for s in batch) == ["s0", "s1", "s2", "s3", "s4"]
