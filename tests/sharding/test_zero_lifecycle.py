"""The engine's lifetime and the numbers it reports: a dropped or closed engine frees everything it
held; close() drains the work an error left in flight; ranks exit cleanly after destroy_process_group;
the gradient norm is exact to float64 at 64M elements; torch.nn.utils.clip_grad_norm_ over the engine's
parameters refuses (it used to return 0.0) instead of computing on gradients the engine does not keep there.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support import REPO
from tests.support.zero_cases import SMALL
from tests.support.zero_lifecycle_cases import close_drains_interrupted_work
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.optimizer import NORM_BLOCK, NORM_ROW, squared_norm
from tnlg.tools.spawn import free_port, run_distributed

CONFIGS = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage1-offload": {"stage": 1, "offload_optimizer": "cpu"},
    "stage2-offload": {"stage": 2, "offload_optimizer": "cpu"},
    "stage3-offload": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "stage3-bf16": {"stage": 3, "mixed_precision": "bf16"},
}


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage behind a tensor object the interpreter holds, after a full
    collection: what a leak keeps alive. (Tensors only C++ holds, such as a collective's buffers, are
    not seen; none outlive a finished step in one process.) Storages on the meta device hold no memory
    and are left out: Dynamo's fake tensors, which an earlier test's compilation leaves to be released
    at some later point (a test run after tests/sharding/test_compile.py saw 52 KB of them go during
    the engine's life, and fewer bytes after than before it)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: that reads __class__ of every object
            storage = obj.untyped_storage()
            if storage.device.type != "meta":
                storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def _train(engine, steps: int = 2) -> torch.Tensor:
    """`steps` steps, then a forward whose loss (and graph, with the engine's hooks on it) is kept."""
    for batch in batches(steps):
        loss = engine(*local(batch, 0, 1))
        engine.backward(loss)
        engine.step()
    return engine(*local(batches(1)[0], 0, 1))


def _engine(config: dict, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
    model = model if model is not None else make_model()
    optimizer = optimizer if optimizer is not None else make_optimizer(model)
    return initialize(model, optimizer, ZeroConfig(**SMALL, **config))


def _trained_engine(config: dict):
    engine = _engine(config)
    return engine, _train(engine)


def _engine_buffers(engine) -> list[torch.Tensor]:
    """What the engine itself owns: gradients, fp32 master, stage 3 shard, optimizer state."""
    tensors = [
        t
        for group in engine.groups
        for t in (group.master, group.full_grad, group.shard_grad, group.shard)
        if t is not None
    ]
    return tensors + engine.optimizer.state_tensors() + engine.optimizer.host_copies()


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.slow
@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_dropped_engine_frees_everything_it_held(name, close):
    baseline = live_tensor_bytes()
    engine, loss = _trained_engine(CONFIGS[name])
    assert live_tensor_bytes() > baseline
    if close:
        engine.close()
    del engine, loss
    assert live_tensor_bytes() == baseline


@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_model_and_optimizer_kept_by_the_user_hold_nothing_of_the_engine(stage, close):
    """The notebook case: `model` and `optimizer` stay in scope after the engine goes."""
    model = make_model()
    optimizer = make_optimizer(model)
    engine = _engine({"stage": stage}, model, optimizer)
    loss = _train(engine)
    buffers = [weakref.ref(t) for t in _engine_buffers(engine)]
    if close:
        engine.close()
    del engine, loss
    gc.collect()
    assert [ref() for ref in buffers] == [None] * len(buffers)
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state and all(group["params"] == [] for group in optimizer.param_groups)
    with pytest.raises(RuntimeError, match="closed"):
        optimizer.step()
    if stage < 3:  # the module keeps its trained 16-bit parameters: evaluation after training works
        assert torch.isfinite(model(*local(batches(1)[0], 0, 1)))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_close_is_idempotent_and_the_closed_engine_refuses_to_run(stage, tmp_path):
    engine, loss = _trained_engine({"stage": stage})
    batch = local(batches(1)[0], 0, 1)
    with torch.no_grad():
        before = engine(*batch)
    engine.close()
    engine.close()
    assert engine.closed
    assert engine.memory_stats()["total"] == 0
    calls = {
        "forward": lambda: engine(*batch),
        "backward": lambda: engine.backward(loss),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "clip_grad_norm_": lambda: engine.clip_grad_norm_(1.0),
        "full_state_dict": engine.full_state_dict,
        "save_checkpoint": lambda: engine.save_checkpoint(tmp_path),
        "no_sync": lambda: engine.no_sync().__enter__(),
    }
    for action, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{action} on a closed ZeroEngine"):
            call()
    if stage < 3:
        with torch.no_grad():
            assert engine.module(*batch) == before


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_close_waits_for_the_work_an_error_left_in_flight(stage):
    """Stage 2: a backward interrupted after bucket reductions were launched; stage 3: a prefetched
    block the forward never ran. Both ranks then close() and destroy the process group."""
    results = run_distributed(close_drains_interrupted_work, 2, stage)
    for result in results:
        assert result["in_flight_before_close"] >= 1
        assert result["left_after_close"] == 0 and result["closed"]


def _launch(directory: Path, mode: str) -> list[subprocess.CompletedProcess]:
    """Two ranks of tests.support.zero_lifecycle_cases as torchrun would start them; their exits as they are."""
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                   "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, "-m", "tests.support.zero_lifecycle_cases", str(directory), mode]
    ranks = [
        subprocess.Popen(
            command, cwd=REPO, env={**environment, "RANK": str(rank)}, stderr=subprocess.PIPE, text=True
        )
        for rank in range(2)
    ]
    finished = []
    for rank in ranks:
        _, stderr = rank.communicate(timeout=300)
        finished.append(subprocess.CompletedProcess(command, rank.returncode, "", stderr))
    return finished


@pytest.mark.slow
def test_stage3_ranks_exit_cleanly_after_loading_training_and_destroying_the_group(tmp_path):
    """The reported abort at exit (`terminate called without an active exception`, SIGABRT) after a
    stage 3 load + 3 steps + destroy_process_group, launched ten times."""
    directory = tmp_path / "checkpoint"
    for rank in _launch(directory, "save"):
        assert rank.returncode == 0, rank.stderr[-3000:]
    for launch in range(10):
        for rank in _launch(directory, "load"):
            assert rank.returncode == 0 and "terminate called" not in rank.stderr, (
                launch,
                rank.stderr[-3000:],
            )


# ---------------------------------------------------------------------------------------------- numerics
NORM_NUMEL = 64 * 2**20 + 4093  # squared_norm's last block is short and ends in a partial row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_squared_norm_of_64m_elements_is_exact_to_float64(dtype):
    values = torch.randn(NORM_NUMEL, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = values.double().square().sum().item()
    assert squared_norm(values).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_squared_norm_in_one_pass_as_cuda_takes_it_equals_the_blocked_walk(dtype):
    # CUDA reduces each piece at once (no block split); the rows and their fp64 sum are the same.
    values = torch.randn(3 * NORM_BLOCK + 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    blocked = squared_norm(values)
    assert squared_norm(values, block=values.numel()).item() == pytest.approx(blocked.item(), rel=1e-12)
    # Blocks that end mid-row regroup the rows: still exact to float64 within the note's bound.
    expected = values.double().square().sum().item()
    assert squared_norm(values, block=NORM_BLOCK + NORM_ROW // 2).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("block", [None, 4096 + 3])
def test_a_non_finite_gradient_gives_a_non_finite_norm(bad, block):
    values = torch.ones(3 * 4096 + 5)
    values[4096 + 7] = bad
    assert not torch.isfinite(squared_norm(values, block=block))


class _Dot(nn.Module):
    """loss = weight · x: the gradient of the weight is x itself."""

    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def test_the_engine_gradient_norm_of_16m_elements_is_exact_to_float64():
    """torch._foreach_norm over the whole piece, as the step used to, was off by 6e-4 here."""
    x = torch.randn(16 * 2**20, generator=torch.Generator().manual_seed(0))
    model = _Dot(x.numel())
    engine = initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), ZeroConfig(stage=2))
    engine.backward(engine(x))
    assert engine.clip_grad_norm_(1e30) == pytest.approx(x.double().norm().item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3", "stage2-offload", "stage3-bf16"])
def test_torch_clip_grad_norm_over_the_engine_parameters_refuses(name):
    engine = _engine(CONFIGS[name])
    batch = local(batches(1)[0], 0, 1)
    for _ in range(2):  # before the first step, and after one
        engine.backward(engine(*batch))
        with pytest.raises(RuntimeError, match=r"engine\.clip_grad_norm_\(max_norm\)"):
            torch.nn.utils.clip_grad_norm_(engine.parameters(), 1.0)
        norm = engine.clip_grad_norm_(1.0)
        assert norm > 0
        engine.step()
        assert engine.get_global_grad_norm() == norm
