"""The engine's own process groups wait as long as the world's ([Note: group timeouts] in
sharding/timeouts.py): torch gives every new group the backend's default (30 minutes on gloo, 10 on
NCCL), not the timeout the world was created with, so a user's longer timeout would not reach stage 3's
gathers, the tensor, data and pipeline groups, or the checkpoint barriers on them."""

from __future__ import annotations

import datetime

import pytest

from tnlg.tools.spawn import run_distributed

WORLD_TIMEOUT = 123.0  # seconds: neither backend's default


def _timeout(group) -> float:
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _engine_group_timeouts(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from tests.support.parallel_cases import tnlg_optimizer
    from tests.support.tensor_parallel_cases import make_model
    from tnlg.sharding import ParallelDims, ZeroConfig, initialize
    from tnlg.sharding.timeouts import world_timeout

    found = {"world": _timeout(dist.group.WORLD), "read": world_timeout().total_seconds()}
    found["plain new_group"] = _timeout(dist.new_group(list(range(world_size))))  # what torch gives
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    engine = initialize(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
    found["stage 3 gather group"] = _timeout(engine.collectives.gather_group)
    engine.close()
    for name, dims in {
        "tensor 2 x data 2": ParallelDims(tensor=2),
        "pipeline 2 x data 2": ParallelDims(pipeline=2),
    }.items():
        model = make_model()
        engine = initialize(model, tnlg_optimizer(model), ZeroConfig(stage=2), parallel=dims)
        for dimension in ("tensor", "data", "pipeline"):
            found[f"{name}: {dimension}"] = _timeout(engine.parallel.group(dimension))
        for parameter, group in engine.pipeline.shared.items() if engine.pipeline is not None else ():
            found[f"{name}: shared {parameter}"] = _timeout(group)
        engine.close()
    return found


@pytest.mark.slow
def test_every_group_the_engine_creates_takes_the_worlds_timeout():
    found = run_distributed(_engine_group_timeouts, 4, collective_timeout=WORLD_TIMEOUT)
    for ranks in found:
        assert ranks.pop("world") == ranks.pop("read") == WORLD_TIMEOUT
        # The default the engine must not take (if torch made new groups inherit, this test says so).
        assert ranks.pop("plain new_group") == datetime.timedelta(minutes=30).total_seconds()
        assert any("shared" in name for name in ranks)  # the tied embedding's group was reached
        assert ranks == dict.fromkeys(ranks, WORLD_TIMEOUT)


def _nccl_timeouts(rank: int, world_size: int, store: str) -> dict:
    """On one GPU: an NCCL world made with a 123 s timeout in place of the harness's gloo one; what
    world_timeout reads, and the timeouts of a group the engine's way makes and of one it adopts."""
    import torch
    import torch.distributed as dist

    from tnlg.sharding.timeouts import adopt_world_timeout, world_timeout

    dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=WORLD_TIMEOUT)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)
    torch.cuda.set_device(0)

    def nccl_timeout(group) -> float:
        return group._get_backend(torch.device("cuda")).options._timeout.total_seconds()

    made = dist.new_group([0], timeout=world_timeout())
    adopted = dist.new_group([0])
    adopt_world_timeout(adopted, world_timeout())
    found = {
        "read": world_timeout().total_seconds(),
        "made": nccl_timeout(made),
        "adopted": nccl_timeout(adopted),
    }
    dist.destroy_process_group()
    return found


@pytest.mark.gpu
def test_nccl_groups_take_the_worlds_timeout(tmp_path):
    # NCCL's default is 10 minutes: the world's 123 s must reach the groups the engine creates.
    (found,) = run_distributed(_nccl_timeouts, 1, str(tmp_path / "store"))
    assert found == {"read": WORLD_TIMEOUT, "made": WORLD_TIMEOUT, "adopted": WORLD_TIMEOUT}
