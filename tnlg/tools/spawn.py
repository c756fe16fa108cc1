"""A small harness that runs a function on N gloo processes and returns each rank's result.

- Each rank runs `fn(rank, world_size, *args)` in its own process, with the default process group
  initialised over loopback and the caller's environment as it is at the call.
- A rank that raises sends its traceback; the harness re-raises it in the test, naming the rank.
- Nothing hangs: collectives time out (`collective_timeout`) and the whole run has a deadline
  (`timeout`) after which every process is killed.

By default ranks are forked from a server process that has imported torch, Transformers and tnlg
once (multiprocessing's "forkserver" start method with a preload list), rather than spawned as fresh
interpreters: on a small machine each spawned rank spent seconds importing them, longer than most
of the functions a test suite runs take. See `start_rank_server` for what a fork server changes;
`start_method="spawn"` gives fresh interpreters still.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import multiprocessing.forkserver
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports before it forks any rank (with what they import in turn: triton,
# Dynamo's and inductor's configs, huggingface_hub, numpy). Importing them queries no CUDA device (a
# fork cannot carry CUDA's state; checked on the CPU build, where no torch.cuda function runs). The
# settings tnlg's callers change per run are read when used (TNLG_*, TRITON_INTERPRET for the fused
# Adam kernel, inductor's cache directory); a few variables are read once on import and keep the
# server's value in every rank (huggingface_hub's HF_HOME and HF_HUB_OFFLINE, Dynamo's package-cache
# path from TORCHINDUCTOR_CACHE_DIR). The Trainer (which brings datasets and pyarrow, with its
# allocator thread) and DeepSpeed are left to the ranks.
RANK_SERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "accelerate",
    "tnlg",
    "tnlg.accelerate",
    "tnlg.run.pretrain",
    "tnlg.sharding.engine",
)
START_METHODS = ("forkserver", "spawn")


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
      of the server's before the function's module is imported. But a preloaded module that read a
      variable when it was imported keeps the value the server saw when it started: start it before
      changing such a variable.
    - torch's and numpy's random generators are seeded afresh in each rank, as in a new interpreter
      (Python's `random` reseeds itself after a fork). Python's string hashes are not: every rank
      has the server's hash seed, so sets of strings iterate in the same order on all ranks, where
      separately launched processes may differ. `start_method="spawn"` tests that case.
    - A rank prints to the server's output (this process's when the server started), not to
      whatever the caller's output is at the later call. Its traceback still comes back to the
      caller in `RankFailed`.
    - Arguments reach a rank through the server, which passes at most 256 file descriptors: more
      than that many tensors (each shared by a descriptor) in `args` is refused; pass fewer, or
      bytes.
    - A preloaded module that fails to import in the server is imported by each rank instead.
    """
    # multiprocessing keeps one fork server per process; the preload list is read when it starts.
    mp.get_context("forkserver").set_forkserver_preload(list(RANK_SERVER_PRELOAD))
    multiprocessing.forkserver.ensure_running()


def _function_reference(fn: Callable[..., Any]) -> tuple[str, str]:
    """Where a rank finds `fn`: its module and qualified name (it must be defined at module level)."""
    qualname = getattr(fn, "__qualname__", "")
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"run_distributed runs a function its ranks can import: one defined at a module's top level, "
            f"got {fn!r}"
        )
    return fn.__module__, qualname


def _resolve(reference: tuple[str, str]) -> Callable[..., Any]:
    module_name, qualname = reference
    found: Any = importlib.import_module(module_name)
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


def _wait_for_the_other_ranks() -> None:
    """Rank 0 hosts the store every rank reads while it builds a process group: a rank that returns
    first must not take the store with it while another is still reading it (the other then fails
    with "Connection reset by peer", naming nothing of the test). Its result is already sent, so a
    barrier a failed rank never reaches does not hide that rank's error."""
    if not dist.is_initialized():  # the function may have ended it (Accelerator.end_training does)
        return
    with contextlib.suppress(RuntimeError):  # a rank that failed or ended its group: its report says why
        dist.barrier()


def _worker(function, rank, world_size, port, collective_timeout, results, args, environ):
    # A forked rank inherits the fork server's environment; the caller's is the one a rank must see,
    # from the import of the function's module on (which is why the function comes by name).
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
    # A fork copies the server's generators: without a new seed every rank would draw the same numbers.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        fn = _resolve(function)
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
            _wait_for_the_other_ranks()
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
    start_method: str = "forkserver",
) -> list[Any]:
    """`[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]`, each run in its own process:
    forked from the preloaded server (`start_rank_server`), or with `start_method="spawn"` a fresh
    interpreter."""
    if start_method not in START_METHODS:
        raise ValueError(f"run_distributed's start_method is one of {START_METHODS}, got {start_method!r}")
    function = _function_reference(fn)
    if start_method == "forkserver":
        start_rank_server()
    context = mp.get_context(start_method)
    results = context.Queue()
    port = free_port()
    environ = dict(os.environ)
    processes = [
        context.Process(
            target=_worker,
            args=(function, rank, world_size, port, collective_timeout, results, args, environ),
        )
        for rank in range(world_size)
    ]
    outputs: dict[int, Any] = {}
    try:
        for process in processes:
            process.start()
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
            if process.pid is None:  # never started: an earlier start failed
                continue
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    return [outputs[rank] for rank in range(world_size)]
