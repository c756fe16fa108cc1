"""Processes killed for real: a rank killed with SIGKILL mid-run, a process killed while writing a
checkpoint. Nothing hangs, nothing is lost: the next launch resumes from the last good checkpoint
and reproduces the uninterrupted run's losses exactly (CPU, fp32)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.run.test_pretrain_script import launch_command
from tests.support import REPO
from tnlg.tools.spawn import RankFailed, run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)

STEPS = 24


def _environment(cache: Path) -> dict[str, str]:
    return {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}


def _launch(output: Path, cache: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    command = launch_command(output, ["--num_machines", "1"], "--train.max_steps", str(STEPS),
                             "--train.save_every", "2", "--train.eval_every", "0", *overrides)  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=_environment(cache), capture_output=True, text=True, timeout=600
    )
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _rank_process(output: Path, local_rank: int) -> int | None:
    """The pid of the training process of `local_rank` in the launch writing to `output`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = any(b"pretrain.py" in part for part in command) and str(output).encode() in command
        if ours and f"LOCAL_RANK={local_rank}".encode() in environment:
            return int(entry.name)
    return None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    output = tmp_path_factory.mktemp("uninterrupted")
    _launch(output, cache)
    return json.loads((output / "loss_curve.json").read_text())["losses"]


def test_a_rank_killed_mid_run_stops_the_launch_and_the_relaunch_resumes_exactly(
    uninterrupted, cache, tmp_path
):
    command = launch_command(tmp_path, ["--num_machines", "1"], "--train.max_steps", str(STEPS),
                             "--train.save_every", "2", "--train.eval_every", "0")  # fmt: skip
    launch = subprocess.Popen(command, cwd=REPO, env=_environment(cache), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    latest = tmp_path / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.is_file() and time.monotonic() < deadline and launch.poll() is None:
        time.sleep(0.02)
    victim = _rank_process(tmp_path, 1)
    assert victim is not None and launch.poll() is None, "the run ended before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = launch.communicate(timeout=120)
    assert launch.returncode != 0
    assert time.monotonic() - killed_at < 60  # the surviving rank did not hang
    assert "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output[-3000:]
    resumed_from = int(json.loads(latest.read_text())["checkpoint"].split("-")[1])
    assert 2 <= resumed_from < STEPS
    _launch(tmp_path, cache, "--resume", "latest")
    resumed = json.loads((tmp_path / "loss_curve.json").read_text())["losses"]
    assert resumed == pytest.approx(uninterrupted, rel=1e-6)  # the curve: steps saved, then retrained


def _killed_while_saving(rank, world_size, cache, output):
    """The debug run; rank 1 is SIGKILLed halfway through writing its shard of the step-4 checkpoint."""
    os.environ["TNLG_CACHE"] = cache
    from tnlg.run.config import load_run_config
    from tnlg.run.pretrain import pretrain
    from tnlg.sharding import checkpoint as engine_checkpoint

    real_save_file, saves = engine_checkpoint.save_file, [0]

    def save_file(tensors, path, *args, **kwargs):
        saves[0] += 1
        if rank == 1 and saves[0] == 2:
            Path(path).write_bytes(b"\0" * 1000)  # a partly written file, then the process dies
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save_file(tensors, path, *args, **kwargs)

    engine_checkpoint.save_file = save_file
    arguments = ["--train.max_steps", str(STEPS), "--train.save_every", "2", "--train.eval_every", "0",
                 "--train.output_dir", output, "--logging.trackers", "[]"]  # fmt: skip
    pretrain(load_run_config(REPO / "configs" / "pretrain" / "debug.yaml", arguments))


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_selected(
    uninterrupted, cache, tmp_path
):
    with pytest.raises(RankFailed):  # rank 1 died; rank 0 fails in the next collective or is stopped
        run_distributed(
            _killed_while_saving, 2, str(cache), str(tmp_path), timeout=300, collective_timeout=30
        )
    latest = tmp_path / "checkpoints" / "latest"
    assert json.loads(latest.read_text()) == {"checkpoint": "step-00000002"}
    _launch(tmp_path, cache, "--resume", "latest")
    resumed = json.loads((tmp_path / "loss_curve.json").read_text())["losses"]
    assert resumed == pytest.approx(uninterrupted, rel=1e-6)


def test_a_damaged_latest_checkpoint_is_named_and_can_fall_back_to_the_previous_one(cache, tmp_path):
    steps = ["--train.max_steps", "6", "--train.keep_last", "3"]
    _launch(tmp_path, cache, *steps)
    finished = json.loads((tmp_path / "loss_curve.json").read_text())["losses"]
    damaged = tmp_path / "checkpoints" / "step-00000006" / "engine" / "rank-00001.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x01
    damaged.write_bytes(bytes(data))
    refused = _launch(tmp_path, cache, *steps, "--resume", "latest", check=False)
    assert refused.returncode != 0
    assert "step-00000006/engine/rank-00001.safetensors: sha256 differs" in refused.stdout + refused.stderr
    _launch(tmp_path, cache, *steps, "--resume", "latest", "--train.resume_fallback", "true")
    resumed = json.loads((tmp_path / "loss_curve.json").read_text())["losses"]
    assert resumed == pytest.approx(finished, rel=1e-6)  # steps 5 and 6 again, from step 4
