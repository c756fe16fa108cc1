"""benchmarks/gpu_first_contact.py's --smoke mode: every row of the first GPU session's table at tiny
sizes on this machine, so that the script keeps working between the sessions that have a GPU; the rows
printed as they come and copied into $OUT/first_contact.md with the full logs; and a comparison made
wrong on purpose must fail the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_first_contact
from benchmarks.gpu_first_contact import BUILD_CHECK, Build, Options, Report, Row, run_build, zero_settings
from tests.support import REPO
from tnlg.modeling import fused_ops


def _smoke(*flags: str, out: Path | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.pop("OUT", None)
    if out is not None:
        environment["OUT"] = str(out)
    if not torch.cuda.is_available():  # on a GPU the smoke run uses the compiled kernels
        environment.setdefault("TRITON_INTERPRET", "1")
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_first_contact", "--smoke", *flags],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _rows(stdout: str, check: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in stdout.splitlines()
        if line.startswith(f"| {check} |")
    ]


@pytest.mark.slow
@pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
def test_smoke_prints_every_row_and_passes(tmp_path):
    result = _smoke(out=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # The header before any row: a run stopped at its time limit has printed what it did so far.
    assert lines[0].startswith("# gpu_first_contact on ")
    first_row = min(index for index, line in enumerate(lines) if line.startswith("| fused"))
    assert lines.index("| check | setting | result | figure |") < first_row
    # What matters most runs first: the kernels, the side-by-side comparison, the builds, then the rest.
    checks = list(dict.fromkeys(line.split("|")[1].strip() for line in lines if line.startswith("| ")))
    assert checks[checks.index("fused Adam > 2^31 elements") :] == [
        "fused Adam > 2^31 elements", "side by side", "kernel vs torch", BUILD_CHECK, "gpu-marked tests",
        "ZeRO vs fp32 reference", "checkpoint round trip",
    ]  # fmt: skip
    for kernel in ("Triton LayerNorm", "Triton bias + GeLU", "chunked LM head + CE"):
        assert [row[1].split(",")[0] for row in _rows(result.stdout, f"fused {kernel}")] == [
            "hidden 4256",
            "hidden 20480",
        ]
    adam = _rows(result.stdout, "fused Adam > 2^31 elements")
    assert adam[0][1:3] == ["10,000 elements, backend triton (smoke)", "ok"]
    if not torch.cuda.is_available():
        assert adam[1][1:] == ["backend cuda (smoke)", "skipped", "no CUDA device"]
    builds = _rows(result.stdout, BUILD_CHECK)
    assert [row[1].split(" (")[0] for row in builds] == ["CUDA fused Adam", "CPU Adam"]
    assert all(row[2] in ("ok", "skipped") and row[3] for row in builds)  # a skip says why
    side_by_side = {row[1]: row[2:] for row in _rows(result.stdout, "side by side")}
    for variant in ("tnlg stage 0", "tnlg stage 3", "torch FSDP2", "Transformers GPT-2"):
        assert side_by_side[variant][0] == "ok" and "tokens/s" in side_by_side[variant][1]
    ratios = [name for name in side_by_side if " / " in name]
    assert ratios == ["tnlg stage 0 / Transformers GPT-2 tokens/s", "tnlg stage 3 / torch FSDP2 step time"]
    assert len(_rows(result.stdout, "kernel vs torch")) == 4  # LayerNorm, bias + GeLU, LM head + CE, Adam
    assert (tmp_path / "side_by_side.md").read_text().count("gate passed") == 1
    assert _rows(result.stdout, "gpu-marked tests")[0][2] == "ok"
    zero = _rows(result.stdout, "ZeRO vs fp32 reference")
    assert [row[1] for row in zero] == [
        f"1 rank (collectives are local copies): {s}" for s in zero_settings()
    ]
    assert len(zero) == 28  # stage 0: 2 precisions x no_sync; stages 1-3 also x optimizer offload
    checkpoint = _rows(result.stdout, "checkpoint round trip")[0]
    assert checkpoint[1].startswith("1 rank (collectives are local copies): ") and checkpoint[2] == "ok"
    assert "ERROR" not in result.stdout and "MISMATCH" not in result.stdout
    # $OUT holds the same table, written as it grew, and pytest's whole output.
    assert (tmp_path / "first_contact.md").read_text() == result.stdout
    assert "tests collected" in (tmp_path / "gpu_tests.log").read_text()
    assert not (tmp_path / "errors.log").exists()


@pytest.mark.slow
def test_an_injected_mismatch_fails_the_run():
    result = _smoke("--rows", "zero", "--inject-mismatch")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    zero = _rows(result.stdout, "ZeRO vs fp32 reference")
    assert zero[0][2] == "MISMATCH" and all(row[2] == "ok" for row in zero[1:])
    assert result.stdout.endswith("\n28 rows, 1 failed\n")


def _options(out: Path) -> Options:
    return Options(smoke=True, inject_mismatch=False, device=torch.device("cpu"), out=out)


def test_each_row_is_in_first_contact_md_as_soon_as_it_is_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    report = Report(_options(tmp_path))
    report.begin()
    report.add([Row("a check", "a setting", "ok", "a figure")])
    printed = capsys.readouterr().out
    assert printed.endswith("|---|---|---|---|\n| a check | a setting | ok | a figure |\n")
    assert (tmp_path / "first_contact.md").read_text() == printed  # before the run ends
    assert report.end() == 0


def test_a_section_that_raises_is_an_error_row_with_its_traceback_kept(tmp_path, capsys, monkeypatch):
    def broken(options):
        raise ValueError("the kernel fell over")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setitem(gpu_first_contact.SECTIONS, "kernels", broken)
    options = _options(tmp_path)
    report = Report(options)
    report.begin()
    report.add(gpu_first_contact.run_section("kernels", options, report))
    assert "ValueError: the kernel fell over" in (tmp_path / "errors.log").read_text()  # at once
    assert report.end() == 1
    printed = capsys.readouterr()
    assert "| kernels |  | ERROR | ValueError: the kernel fell over |" in printed.out
    assert 'in broken\n    raise ValueError("the kernel fell over")' in printed.err
    markdown = (tmp_path / "first_contact.md").read_text()
    assert markdown.startswith(printed.out) and "## Tracebacks" in markdown and "in broken" in markdown


def test_a_failed_build_is_an_error_row_with_its_whole_log(tmp_path):
    """The builds run as subprocesses whose whole output is the log (here stand-ins, no compiler)."""
    failing = Build(
        "a kernel", "kernel_build.log", "print('compiling'); raise SystemExit('error: the compiler said no')"
    )
    row = run_build(failing, tmp_path)
    assert (row.check, row.setting, row.result) == (BUILD_CHECK, "a kernel", "ERROR")
    assert row.figure.startswith("error: the compiler said no; ") and row.figure.endswith(
        ", log kernel_build.log"
    )
    assert (tmp_path / "kernel_build.log").read_text() == "compiling\nerror: the compiler said no\n"
    built = run_build(Build("a kernel", "kernel_build.log", "print('built')"), None)
    assert built.result == "ok" and built.figure.endswith(" s")


@pytest.mark.slow
def test_without_cuda_or_smoke_the_script_refuses():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full run would start")
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_first_contact"], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr


@pytest.mark.slow
def test_a_checkpoint_saved_by_two_ranks_resumes_on_one(tmp_path):
    """The reshape of docs/benchmarks.md's two-GPU plan, on 2 gloo processes: torchrun saves, one
    process resumes from the kept checkpoint and matches the two-rank uninterrupted run."""
    # On the CPU even on a GPU machine: two ranks on NCCL would need two GPUs.
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    flags = ["--smoke", "--rows", "checkpoint", "--checkpoint-dir", str(tmp_path)]
    script = ["-m", "benchmarks.gpu_first_contact", *flags]
    saved = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *script],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    assert "saved by 2 rank(s), resumed on 2" in saved.stdout
    resumed = subprocess.run(
        [sys.executable, *script], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    row = _rows(resumed.stdout, "checkpoint round trip")[0]
    assert "saved by 2 rank(s), resumed on 1" in row[1] and row[2] == "ok"
