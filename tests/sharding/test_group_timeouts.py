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
