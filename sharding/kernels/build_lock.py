"""Where tnlg's C++ and CUDA extensions are built, and the lock that keeps a killed build from leaving
every later process waiting.

[Note: stale build locks]
cpp_extension.load lets one process build while the others wait for its `lock` file in the build
directory to go; a build killed midway (Ctrl-C, the OOM killer, a launcher stopping its ranks) leaves
that file behind, and every later process then waits for it forever, printing nothing (DeepSpeed's JIT
builds are known for the same hang). So tnlg builds each extension in a directory of its own and holds
an flock on `tnlg-build.lock` there around the load, recording in it the host and process that hold it.
The kernel frees an flock when its holder dies, so a process that holds it finds a `lock` of torch's
left by the previous holder, and removes it, with a warning, only when all of these show that the
build stopped:
- the previous holder was a process of this host that is gone: flock may lock within one node only
  (NFS mounted `nolock` or `local_lock=flock`, Lustre's `localflock`), so a holder on another node may
  be building still;
- no process of this host works in the directory (its cwd there: ninja, the compilers it runs), since
  those outlive a builder killed alone (`subprocess.run(timeout=)` kills only its child).
Otherwise the load waits for torch's lock as before, with a warning naming the file and what to do.
Where flock is unavailable (no fcntl, a file system without locks) the load runs under torch's lock alone.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

BUILD_LOCK = "tnlg-build.lock"
TORCH_BATON = "lock"  # the file cpp_extension.load's FileBaton creates while a process builds


def build_directory(name: str) -> Path:
    """Where extension `name` is built and cached: under TORCH_EXTENSIONS_DIR (else torch's default
    root), one directory per Python, torch release and accelerator build, so that a venv of another
    torch never waits for or reuses another's."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda}"
    else:
        accelerator = "cpu"
    release = torch.__version__.split("+")[0]
    return Path(root) / f"{name}-{python}-torch{release}-{accelerator}"


def load_extension(name: str, **options: Any) -> ModuleType:
    """`cpp_extension.load(name=name, **options)` built in `build_directory(name)` (quietly unless
    `verbose=True`), under the build lock that a killed build does not leave held (see [Note: stale build
    locks])."""
    from torch.utils import cpp_extension

    if "build_directory" in options:
        raise TypeError("load_extension builds in build_directory(name): do not pass build_directory")
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    options = {"verbose": False, **options}

    def load() -> ModuleType:
        return cpp_extension.load(name=name, build_directory=str(directory), **options)

    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        return load()
    with open(directory / BUILD_LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds; freed if it dies
        except OSError as error:  # a file system without locks
            logger.warning("cannot lock %s (%s): building under torch's lock alone", handle.name, error)
            return load()
        try:
            handle.seek(0)
            previous = handle.read().split()
            handle.seek(0)
            handle.truncate()
            handle.write(f"{socket.gethostname()} {os.getpid()}\n")
            handle.flush()
            _clear_stale_baton(directory, name, previous)
            return load()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clear_stale_baton(directory: Path, name: str, previous: list[str]) -> None:
    """Remove torch's `lock` in `directory` when the build that left it has stopped (see [Note: stale
    build locks]); else warn that the load waits for it. `previous`: the last holder's [host, pid]."""
    baton = directory / TORCH_BATON
    if not baton.exists():
        return
    stopped = _stopped(previous)
    working = _processes_working_in(directory)
    if stopped and working is not None and not working:
        logger.warning(
            "removing %s: the build of %s by process %s was stopped before it finished, and torch would "
            "wait for that file forever",
            baton, name, previous[1],
        )  # fmt: skip
        baton.unlink(missing_ok=True)
        return
    if not stopped:
        holder = f"process {previous[1]} on {previous[0]}" if len(previous) == 2 else "an unknown process"
        why = f"it was left by {holder}, which may still be building"
    elif working is None:
        why = "this system cannot list the processes working in it"
    else:
        why = f"processes {', '.join(map(str, working))} still work in that directory"
    logger.warning(
        "waiting for %s, torch's build lock of %s: %s. If no process is building %s, remove that file",
        baton, name, why, name,
    )  # fmt: skip


def _stopped(previous: list[str]) -> bool:
    """Whether the last holder of the build lock, [host, pid], was a process of this host that is gone."""
    if len(previous) != 2 or previous[0] != socket.gethostname() or not previous[1].isdigit():
        return False
    try:
        os.kill(int(previous[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, another user's
        return False
    return int(previous[1]) == os.getpid()  # the pid reused by this very process: the holder is gone


def _processes_working_in(directory: Path) -> list[int] | None:
    """The processes of this host whose working directory is in `directory` (ninja and the compilers it
    runs work there), or None where /proc cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return None
    target = str(directory.resolve())
    working = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile, or another user's
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            working.append(int(entry.name))
    return working
