"""benchmarks/cpu_adam.py compares like with like: both sides read the same gradient tensor (fp32
and bf16 cases), torch's side pays for its upcast inside its timed step, both end with the same
parameters, and each side's bytes per element are counted from the tensors it reads and writes.
No timing is asserted (speed belongs in the benchmark's own output)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from benchmarks import cpu_adam
from benchmarks.common import interleaved_medians
from tnlg.sharding.kernels.cpu_adam import THREADS_VARIABLE, adam_threads


def test_bytes_per_element_count_every_tensor_each_side_reads_and_writes():
    # tnlg, one pass: read p, g, m, v; write p, m, v, the bf16 copy
    assert cpu_adam.tnlg_traffic(4) == cpu_adam.Traffic(reads=16, writes=14)
    assert cpu_adam.tnlg_traffic(2) == cpu_adam.Traffic(reads=14, writes=14)
    # torch: fused AdamW (16 + 12), copy_ (4 + 2), and for bf16 gradients the upcast (2 + 4)
    assert cpu_adam.torch_traffic(4) == cpu_adam.Traffic(reads=20, writes=14)
    assert cpu_adam.torch_traffic(2) == cpu_adam.Traffic(reads=22, writes=18)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_both_sides_step_from_the_same_gradient_tensor(grad_dtype):
    start = torch.randn(1000)
    grad = torch.randn(1000).to(grad_dtype)
    ours, theirs = cpu_adam.tnlg_side(start, grad), cpu_adam.torch_side(start, grad)
    for _ in range(2):
        ours.step()
        theirs.step()
    torch.testing.assert_close(ours.param, theirs.param, rtol=1e-5, atol=1e-6)
    # A new gradient written into the shared tensor reaches torch's side: its upcast is in the
    # step it is timed on, not done once beforehand.
    grad.copy_(-grad.float())
    ours.step()
    theirs.step()
    cpu_adam.check_same_work(ours, theirs)


@pytest.mark.parametrize("label", list(cpu_adam.CASES))
def test_a_case_times_both_sides_and_the_streaming_kernels(label):
    case = cpu_adam.measure_case(cpu_adam.CASES[label], numel=4096, repeats=1)
    assert [side.traffic.total for side in case.sides] == ([30, 34] if label == "fp32" else [28, 40])
    assert len(case.streams) == 3
    assert all(timed.seconds > 0 for timed in (*case.sides, *case.streams))
    assert case.limit_gbps(4096) == max(stream.gbps(4096) for stream in case.streams)


def test_interleaved_rounds_rotate_the_order():
    calls: list[str] = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = interleaved_medians(steps, repeats=3, warmup=1)
    assert calls == list("abc" + "abc" + "bca" + "cab")
    assert set(medians) == set("abc")


def test_the_script_prints_both_cases(monkeypatch, capsys):
    if not cpu_adam.CPUAdam([torch.zeros(1)]).uses_extension:
        pytest.skip("the CPUAdam C++ kernel does not build here; the script refuses to run")
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["cpu_adam", "--numel", "4096", "--repeats", "1", "--threads", "1"])
    try:
        cpu_adam.main()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| fp32 | tnlg CPUAdam (+ bf16 copy in the same pass) | 16 + 14 = 30 |" in out
    assert "| fp32 | torch AdamW fused=True + copy_ to bf16 | 20 + 14 = 34 |" in out
    assert "| bf16 | tnlg CPUAdam (+ bf16 copy in the same pass) | 14 + 14 = 28 |" in out
    assert "| bf16 | torch upcast + AdamW fused=True + copy_ | 22 + 18 = 40 |" in out
    assert "fp32 gradients: tnlg" in out and "bf16 gradients: tnlg" in out


def _untimed_rounds(calls: list[dict[str, int]], threads: Callable[[], int]):
    """An `interleaved_medians` that runs each step once (so that the sides' results can be checked)
    and records the threads each side would be timed on, timing nothing."""

    def rounds(steps, repeats, warmup=2):
        for step in steps.values():
            step()
        calls.append({"torch": torch.get_num_threads(), "CPUAdam": threads()})
        return dict.fromkeys(steps, 1.0)

    return rounds


def test_threads_reach_tnlg_cpu_adam_as_well_as_torch(monkeypatch, capsys):
    if not cpu_adam.CPUAdam([torch.zeros(1)]).uses_extension:
        pytest.skip("the CPUAdam C++ kernel does not build here; the script refuses to run")
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)  # restored (unset) after the test
    # One more than CPUAdam would take by itself (its share of the cores it may run on), so that the
    # count can only come from --threads.
    wanted = adam_threads() + 1
    built: list[int] = []

    class Recording(cpu_adam.CPUAdam):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.threads)

    calls: list[dict[str, int]] = []
    monkeypatch.setattr(cpu_adam, "CPUAdam", Recording)
    monkeypatch.setattr(cpu_adam, "interleaved_medians", _untimed_rounds(calls, lambda: built[-1]))
    monkeypatch.setattr(
        sys, "argv", ["cpu_adam", "--numel", "4096", "--repeats", "1", "--threads", str(wanted)]
    )
    threads = torch.get_num_threads()
    try:
        cpu_adam.main()
    finally:
        torch.set_num_threads(threads)
    assert built and set(built) == {wanted}, f"--threads {wanted}: CPUAdam built with {built}"
    assert calls == [{"torch": wanted, "CPUAdam": wanted}] * len(cpu_adam.CASES)
    assert f"{wanted} threads on both sides" in capsys.readouterr().out


def test_a_case_refuses_to_time_sides_on_different_threads(monkeypatch):
    # CPUAdam told to take one more thread than torch's pool has: the comparison would be unequal.
    monkeypatch.setenv(THREADS_VARIABLE, str(torch.get_num_threads() + 1))

    def timing(*args, **kwargs):
        raise AssertionError("timed sides that run on different thread counts")

    monkeypatch.setattr(cpu_adam, "interleaved_medians", timing)
    with pytest.raises(SystemExit, match="threads"):
        cpu_adam.measure_case(torch.float32, numel=64, repeats=1)
