"""What each rank runs in the engine lifecycle tests: spawned by tnlg/tools/spawn.py, or launched as
`python -m tests.support.zero_lifecycle_cases DIRECTORY save|load` with torchrun's environment variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that a test sees the process exit as a user's does."""

from __future__ import annotations

import contextlib
import datetime
import sys

import torch
import torch.distributed as dist

from tests.support.zero_cases import SMALL
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.params import BlockState

LAUNCH_STEPS = 3


def _engine(stage: int, **config):
    model = make_model()
    return initialize(model, make_optimizer(model), ZeroConfig(stage=stage, **SMALL, **config))


def train_then_exit(directory: str, mode: str) -> None:
    """The reported exit abort: a stage 3 engine, a checkpoint loaded ("load") or written ("save", to
    make one), three steps, destroy_process_group, and the interpreter's exit. No close(): the engine is
    still alive when the process group goes, as in a user's script."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine = _engine(3)
    if mode == "load":
        engine.load_checkpoint(directory)
    for batch in batches(LAUNCH_STEPS):
        loss = engine(*local(batch, rank, world_size))
        engine.backward(loss)
        engine.step()
    if mode == "save":
        engine.save_checkpoint(directory)
    dist.destroy_process_group()


class _Interrupted(RuntimeError):
    pass


def close_drains_interrupted_work(rank: int, world_size: int, stage: int) -> dict:
    """Work left in flight by an error, then close(): a backward that raises midway (stage 2: bucket
    reduce-scatters launched, never waited) or a stage 3 forward whose second block never runs (its
    prefetched gather never waited). close() must wait for all of it, on every rank alike."""
    engine = _engine(stage)
    batch = local(batches(1)[0], rank, world_size)
    model = engine.module
    if stage == 3:
        # The model stops calling its second block, which block 0's forward has already prefetched.
        model.blocks = torch.nn.ModuleList([model.blocks[0]])
        engine(*batch)
        in_flight = sum(b.state is BlockState.GATHERING for b in engine.scheduler.blocks)
    else:

        def interrupt(grad: torch.Tensor) -> None:
            raise _Interrupted("interrupted")

        def hook_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            output.register_hook(interrupt)

        # Backward reaches block 0's output after the later units' reductions were launched.
        model.blocks[0].register_forward_hook(hook_output)
        with contextlib.suppress(_Interrupted):
            engine.backward(engine(*batch))
        in_flight = len(engine.reducer._in_flight)
    engine.close()
    left = len(engine.reducer._in_flight)
    if engine.scheduler is not None:
        left += sum(b.state is not BlockState.SHARDED for b in engine.scheduler.blocks)
    return {"in_flight_before_close": in_flight, "left_after_close": left, "closed": engine.closed}


if __name__ == "__main__":
    train_then_exit(sys.argv[1], sys.argv[2])
