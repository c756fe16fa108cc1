"""A small harness that runs a function on N gloo processes and returns each rank's result.

- Each rank runs `fn(rank, world_size, *args)` in a fresh (spawned) interpreter, with the default
  process group initialised over loopback.
- A rank that raises sends its traceback; the harness re-raises it in the test, naming the rank.
- Nothing hangs: collectives time out (`collective_timeout`) and the whole run has a deadline
  (`timeout`) after which every process is killed.
- A caller that runs many of these (a test suite) can call `preload_workers` once: ranks are then forked
  from a server that has imported the heavy modules, instead of each importing torch and Transformers
  afresh (seconds per rank on a small machine, more than most of the functions take).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How ranks start: "spawn" (a fresh interpreter each) until `preload_workers` picks "forkserver".
_start_method = "spawn"


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def preload_workers(modules: Sequence[str]) -> None:
    """Start the ranks of every later `run_distributed` by forking a server that imported `modules` once.

    This is multiprocessing's "forkserver" start method with a preload list. The server is started
    now, in the background (it imports while the caller goes on), and lives until this process ends.

    - Each rank still begins with the caller's environment as it is at the `run_distributed` call,
      as a spawned rank would: it is handed over and replaces the server's.
    - A preloaded module that reads a variable when it is imported keeps the value the server saw
      when it started. So call this before changing such variables, and preload no module whose
      import should depend on them. The modules must not initialise CUDA, whose state does not
      survive a fork.
    - A module that fails to import in the server is imported by each rank instead, as before.
    - Ranks print to the server's output (this process's when the server started), not to whatever
      the caller's output is at the later call.

    The first call's list stands for the life of the server: call it once, early.
    """
    global _start_method
    import multiprocessing.forkserver

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(modules))
    multiprocessing.forkserver.ensure_running()
    _start_method = "forkserver"


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
    context = mp.get_context(_start_method)
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
