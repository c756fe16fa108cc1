"""A small harness that runs a function on N gloo processes and returns each rank's result.

- Each rank runs `fn(rank, world_size, *args)` in its own process, with the default process group
  initialised over loopback and the caller's environment as it is at the call.
- A rank that raises sends its traceback; the harness re-raises it in the test, naming the rank.
- Nothing hangs: collectives time out (`collective_timeout`) and the whole run has a deadline
  (`timeout`) after which every process is killed.

Ranks are forked from a server process that has imported torch, Transformers and tnlg once
(multiprocessing's "forkserver" start method with a preload list), rather than spawned as fresh
interpreters: on a small machine each spawned rank spent seconds importing them, longer than most
of the functions a test suite runs take. See `start_rank_server` for what a fork server changes.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing.forkserver
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports before it forks any rank. Importing them initialises no CUDA (which a
# fork cannot carry), and none of them reads, on import, a variable that callers set per run (the
# TNLG_* settings, TRITON_INTERPRET for the fused Adam kernel, TORCHINDUCTOR_CACHE_DIR are read when
# used). Ranks that need more (datasets, DeepSpeed, inductor) import it themselves.
RANK_SERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "accelerate",
    "tnlg",
    "tnlg.accelerate",
    "tnlg.trainer",
    "tnlg.run.pretrain",
    "tnlg.sharding.engine",
)


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_rank_server() -> None:
    """Start the server that `run_distributed` forks its ranks from, if it is not running yet.

    `run_distributed` starts it on its first call; call this earlier to have it import in the
    background while the caller goes on (a test session calls it while tests are collected). It
    lives until this process ends. What a forked rank differs in from a spawned one:

    - Its environment is the caller's at the `run_distributed` call, handed over and put in place
      of the server's. But a preloaded module that read a variable when it was imported keeps the
      value the server saw when it started: start it before changing such a variable.
    - A rank prints to the server's output (this process's when the server started), not to
      whatever the caller's output is at the later call. Its traceback still comes back to the
      caller in `RankFailed`.
    - A preloaded module that fails to import in the server is imported by each rank instead.
    """
    # multiprocessing keeps one fork server per process; the preload list is read when it starts.
    mp.get_context("forkserver").set_forkserver_preload(list(RANK_SERVER_PRELOAD))
    multiprocessing.forkserver.ensure_running()


def _worker(fn, rank, world_size, port, collective_timeout, results, args, environ):
    # A forked rank inherits the fork server's environment; the caller's is the one a rank must see.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),  # as torchrun sets it: CPUAdam sizes its threads by it
        WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torch.set_num_threads(1)  # several ranks share two cores
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout)
        )
        try:
            # Serialised to bytes: tensors sent through the queue by shared memory would vanish with
            # this process before the parent reads them.
            payload = io.BytesIO()
            torch.save(fn(rank, world_size, *args), payload)
            results.put((rank, "ok", payload.getvalue()))
        finally:
            if dist.is_initialized():  # the function may have ended it (Accelerator.end_training does)
                dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240.0,
    collective_timeout: float = 60.0,
) -> list[Any]:
    """`[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]`, each run in its own process."""
    start_rank_server()
    context = mp.get_context("forkserver")
    results = context.Queue()
    port = free_port()
    environ = dict(os.environ)
    processes = [
        context.Process(
            target=_worker, args=(fn, rank, world_size, port, collective_timeout, results, args, environ)
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outputs: dict[int, Any] = {}
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(outputs) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise RankFailed(
                    f"{fn.__name__} on {world_size} ranks: no result from ranks "
                    f"{sorted(set(range(world_size)) - set(outputs))} within {timeout:.0f}s"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that died without reporting (a crash in C++, a kill) fails the run now.
                dead = [
                    r for r, p in enumerate(processes) if r not in outputs and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise RankFailed(
                        f"{fn.__name__}: rank {dead[0]} of {world_size} died with exit code "
                        f"{processes[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            if status == "error":
                raise RankFailed(f"{fn.__name__} failed on rank {rank} of {world_size}:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    return [outputs[rank] for rank in range(world_size)]
