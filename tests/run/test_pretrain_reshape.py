"""A pretraining run resumed on another number of processes: the engine reshards its checkpoint, the
pre-tokenized data continues at the next global sample, and with the same global batch the losses
continue as the uninterrupted run's. A streamed run, whose position is per rank, refuses by name."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.run.test_pretrain_script import REPO, launch_command
from tnlg.data.corpus import embedded_corpus
from tnlg.data.pretokenized import read_texts, write_pretokenized
from tnlg.run.build import default_tokenizer

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)

STEPS = 8


def _launch(output: Path, cache: Path, processes: int, *overrides: str, check: bool = True):
    environment = {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    command = launch_command(
        output, ["--num_machines", "1"], "--train.max_steps", str(STEPS), "--zero.stage", "3", *overrides,
        processes=processes,
    )  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _losses(output: Path) -> list[float]:
    return json.loads((output / "loss_curve.json").read_text())["losses"]


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory, cache):
    """The embedded corpus, tokenized with the default run's tokenizer."""
    prefix = tmp_path_factory.mktemp("corpus") / "embedded"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TNLG_CACHE", str(cache))
        write_pretokenized(read_texts(embedded_corpus().files()), default_tokenizer(2048), prefix)
    return ["--data.pretokenized", f"[{{prefix: {prefix}, weight: 1}}]"]


def test_a_two_process_checkpoint_resumes_on_one_process_with_the_same_losses(pretokenized, cache, tmp_path):
    _launch(tmp_path / "two", cache, 2, *pretokenized)
    uninterrupted = _losses(tmp_path / "two")
    checkpoint = tmp_path / "two" / "checkpoints" / "step-00000004"
    assert checkpoint.is_dir()
    # One process with twice the accumulation: the same 16 sequences per step, the same global order.
    result = _launch(
        tmp_path / "one", cache, 1, *pretokenized, "--train.gradient_accumulation_steps", "2",
        "--resume", str(checkpoint),
    )  # fmt: skip
    assert "saved by 2 processes and resumes on 1" in result.stderr
    assert _losses(tmp_path / "one") == pytest.approx(uninterrupted, rel=1e-5)  # steps 1-4 as saved


def test_a_streamed_run_refuses_another_world_size_by_name(cache, tmp_path):
    _launch(
        tmp_path, cache, 2, "--train.max_steps", "2", "--train.save_every", "2", "--train.eval_every", "0"
    )
    result = _launch(tmp_path, cache, 1, "--resume", "latest", "--train.max_steps", "4", check=False)
    assert result.returncode != 0
    assert "saved at world size 2 and is per rank" in result.stderr


def test_a_tensor_sliced_run_resumes_without_slicing_on_its_data_replicas(cache, tmp_path):
    # Streamed data, whose position is per data replica: tensor 2 x data 2 (4 processes) resumes at data 2
    # (2 processes), each replica from its own position, and continues as the uninterrupted run.
    _launch(tmp_path / "sliced", cache, 4, "--parallel.tensor", "2", "--train.eval_every", "0")
    uninterrupted = _losses(tmp_path / "sliced")
    checkpoint = tmp_path / "sliced" / "checkpoints" / "step-00000004"
    result = _launch(tmp_path / "plain", cache, 2, "--train.eval_every", "0", "--resume", str(checkpoint))
    assert "saved by 4 processes and resumes on 2" in result.stderr
    assert "continues from each data replica's position" in result.stderr
    assert _losses(tmp_path / "plain") == pytest.approx(uninterrupted, rel=1e-5)


def test_a_pipeline_run_resumes_tensor_sliced_on_its_data_replicas(cache, tmp_path):
    # Pipeline 2 x data 2 (its layers in 2 stages) resumes as tensor 2 x data 2 (every layer cut in 2), on
    # the same data replicas: the engine maps every parameter across the layouts, the runs their data
    # positions, and the losses continue as the uninterrupted run's.
    _launch(tmp_path / "staged", cache, 4, "--parallel.pipeline", "2", "--train.eval_every", "0")
    uninterrupted = _losses(tmp_path / "staged")
    checkpoint = tmp_path / "staged" / "checkpoints" / "step-00000004"
    overrides = ["--parallel.tensor", "2", "--train.eval_every", "0", "--resume", str(checkpoint)]
    _launch(tmp_path / "sliced", cache, 4, *overrides)
    assert _losses(tmp_path / "sliced") == pytest.approx(uninterrupted, rel=1e-5)
