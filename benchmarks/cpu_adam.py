"""The CPU Adam step that ZeRO-Offload runs, tnlg's kernel against torch's, like for like.

    python -m benchmarks.cpu_adam [--numel 50000000] [--threads N] [--repeats 21]

One AdamW step of `numel` fp32 parameters that ends with the updated parameters also in a bf16
buffer (the copy that goes back to the device), in two cases: fp32 gradients and bf16 gradients
(what the offloaded engine hands over). In each case both sides get the same starting parameters
and the same gradient tensor, and do the same work:

- tnlg CPUAdam: one pass reads the gradient as it is and writes the moments, the parameter and its
  bf16 copy;
- torch: `torch.optim.AdamW(fused=True)`, then `copy_` into the bf16 buffer; with bf16 gradients it
  first upcasts them into a preallocated fp32 `.grad` (its Adam takes gradients only in the
  parameter's dtype), and that pass is part of its cost.

Each side's traffic is counted per element from the tensors it must read and write (see `Traffic`),
and its achieved GB/s is compared with this machine's streaming limit, measured in the same run
with the same threads: the fastest of three large fp32 kernels (copy, add, in-place triad) whose
bytes are counted the same way. The Adam steps and the streaming kernels are timed in interleaved
rounds (`benchmarks.common.interleaved_medians`), medians reported. When both sides are
memory-bound, the ratio of their byte counts is the speed-up to expect; the table prints it next
to the measured one.

Both sides run on `--threads` threads: torch's pool through `torch.set_num_threads`, tnlg's kernel
through TNLG_CPU_ADAM_THREADS (CPUAdam does not use torch's pool, see [Note: CPUAdam threads] in
sharding/kernels/cpu_adam.py). A case whose two sides would run on different counts is refused
before anything is timed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import interleaved_medians
from tnlg.sharding.kernels import CPUAdam
from tnlg.sharding.kernels.cpu_adam import THREADS_VARIABLE

FP32, BF16 = 4, 2  # bytes per element
LR, WEIGHT_DECAY = 1e-4, 0.1
CASES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the gradients' dtype


@dataclass(frozen=True)
class Traffic:
    """Bytes per element one step reads and writes (each tensor counted once per pass over it)."""

    reads: int
    writes: int

    @property
    def total(self) -> int:
        return self.reads + self.writes


def tnlg_traffic(grad_bytes: int) -> Traffic:
    # one pass: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq, bf16 copy
    return Traffic(reads=FP32 + grad_bytes + FP32 + FP32, writes=FP32 + FP32 + FP32 + BF16)


def torch_traffic(grad_bytes: int) -> Traffic:
    # fused AdamW: read param, fp32 grad, both moments; write param, both moments
    adam = Traffic(reads=4 * FP32, writes=3 * FP32)
    # copy_: read param again, write the bf16 copy
    copy = Traffic(reads=FP32, writes=BF16)
    # bf16 gradients: read them, write the fp32 .grad that Adam then reads
    upcast = Traffic(reads=grad_bytes, writes=FP32) if grad_bytes != FP32 else Traffic(0, 0)
    return Traffic(
        reads=adam.reads + copy.reads + upcast.reads, writes=adam.writes + copy.writes + upcast.writes
    )


@dataclass(frozen=True)
class Side:
    name: str
    traffic: Traffic
    step: Callable[[], None]
    param: torch.Tensor  # the fp32 parameter it updates, to check both sides computed the same
    out: torch.Tensor  # its bf16 copy
    threads: int  # the threads its step runs on


def tnlg_side(start: torch.Tensor, grad: torch.Tensor) -> Side:
    param = start.clone()
    out = torch.empty_like(param, dtype=torch.bfloat16)
    optimizer = CPUAdam([param], lr=LR, weight_decay=WEIGHT_DECAY)

    def step() -> None:
        optimizer.step(out16=[out], grads=[grad])  # the gradient read as it is, any dtype

    name = "tnlg CPUAdam (+ bf16 copy in the same pass)"
    return Side(name, tnlg_traffic(grad.element_size()), step, param, out, optimizer.threads)


def torch_side(start: torch.Tensor, grad: torch.Tensor) -> Side:
    param = start.clone()
    out = torch.empty_like(param, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([param], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    upcast = grad.dtype != torch.float32
    # fp32: the very tensor tnlg reads. bf16: a buffer allocated once, as an engine would keep it
    # (a fresh 4-byte-per-element tensor each step would add page faults to torch's time).
    param.grad = torch.empty_like(param) if upcast else grad

    def step() -> None:
        if upcast:
            param.grad.copy_(grad)
        optimizer.step()
        out.copy_(param)

    name = (
        "torch AdamW fused=True + copy_ to bf16" if not upcast else "torch upcast + AdamW fused=True + copy_"
    )
    return Side(name, torch_traffic(grad.element_size()), step, param, out, torch.get_num_threads())


def streaming_kernels(numel: int) -> dict[str, tuple[Traffic, Callable[[], object]]]:
    """name -> (traffic, step): large fp32 kernels with nothing to compute, as STREAM's copy / add /
    triad. The in-place triad reads every line it writes, as Adam's in-place updates do, so
    write-allocate traffic (a line read before it is written) does not handicap it."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    return {
        "copy: c = a": (Traffic(FP32, FP32), lambda: c.copy_(a)),
        "add: c = a + b": (Traffic(2 * FP32, FP32), lambda: torch.add(a, b, out=c)),
        "triad in place: a += s * b": (Traffic(2 * FP32, FP32), lambda: a.add_(b, alpha=1e-6)),
    }


@dataclass(frozen=True)
class Timed:
    name: str
    traffic: Traffic
    seconds: float

    def gbps(self, numel: int) -> float:
        return self.traffic.total * numel / self.seconds / 1e9


@dataclass(frozen=True)
class Case:
    sides: tuple[Timed, Timed]  # tnlg's, torch's
    streams: list[Timed]

    def limit_gbps(self, numel: int) -> float:
        """The streaming limit: the fastest streaming kernel of this case's rounds."""
        return max(stream.gbps(numel) for stream in self.streams)


def use_threads(threads: int) -> None:
    """Both sides on `threads` threads. CPUAdam sizes its kernel's threads from TNLG_CPU_ADAM_THREADS,
    or else from its share of the cores, never from torch's pool (see [Note: CPUAdam threads]): set
    only torch's and `--threads 1` would time torch on one thread against tnlg on all of them."""
    torch.set_num_threads(threads)
    os.environ[THREADS_VARIABLE] = str(threads)


def check_same_threads(ours: Side, theirs: Side) -> None:
    """Refuse to time two sides that run on different thread counts: their ratio would measure the
    threads, not the kernels."""
    if ours.threads != theirs.threads:
        raise SystemExit(
            f"{ours.name} runs on {ours.threads} threads, {theirs.name} on {theirs.threads}: "
            f"not timed (set both with --threads, or {THREADS_VARIABLE} to torch's thread count)"
        )


def check_same_work(ours: Side, theirs: Side) -> None:
    """After the same steps on the same inputs the parameters agree, and each side's bf16 buffer is
    its parameter rounded: otherwise one side did other work than the one timed. (The two bf16
    copies are not compared with each other: parameters 1 ulp apart in fp32 can round apart.)"""
    torch.testing.assert_close(ours.param, theirs.param, rtol=1e-5, atol=1e-6)
    for side in (ours, theirs):
        torch.testing.assert_close(side.out, side.param.to(torch.bfloat16), rtol=0.0, atol=0.0)


def measure_case(grad_dtype: torch.dtype, numel: int, repeats: int) -> Case:
    """Both sides and the streaming kernels, timed in interleaved rounds; the sides' results are
    checked against each other after the same number of steps. Only timings are returned, so the
    case's tensors are freed before the next case allocates its own."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator).to(grad_dtype)
    ours, theirs = tnlg_side(start, grad), torch_side(start, grad)
    check_same_threads(ours, theirs)
    streams = streaming_kernels(numel)
    steps = {ours.name: ours.step, theirs.name: theirs.step} | {
        name: step for name, (_, step) in streams.items()
    }
    seconds = interleaved_medians(steps, repeats)
    check_same_work(ours, theirs)
    return Case(
        sides=(
            Timed(ours.name, ours.traffic, seconds[ours.name]),
            Timed(theirs.name, theirs.traffic, seconds[theirs.name]),
        ),
        streams=[Timed(name, traffic, seconds[name]) for name, (traffic, _) in streams.items()],
    )


def bytes_column(traffic: Traffic) -> str:
    return f"{traffic.reads} + {traffic.writes} = {traffic.total}"


def report(numel: int, cases: dict[str, Case]) -> None:
    print("| gradients | streaming kernel | bytes/element (read + write) | ms | GB/s |")
    print("|---|---|---|---|---|")
    for label, case in cases.items():
        for stream in case.streams:
            print(
                f"| {label} | {stream.name} | {bytes_column(stream.traffic)} | {stream.seconds * 1e3:.1f} "
                f"| {stream.gbps(numel):.1f} |"
            )
    print()
    print(
        "| gradients | side | bytes/element (read + write) | step (ms) | GB/s | of streaming limit | time / tnlg's |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, case in cases.items():
        for side in case.sides:
            print(
                f"| {label} | {side.name} | {bytes_column(side.traffic)} | {side.seconds * 1e3:.1f} "
                f"| {side.gbps(numel):.1f} | {side.gbps(numel) / case.limit_gbps(numel):.0%} "
                f"| {side.seconds / case.sides[0].seconds:.2f}x |"
            )
    print()
    for label, case in cases.items():
        ours, theirs = case.sides
        print(
            f"{label} gradients: tnlg {theirs.seconds / ours.seconds:.2f}x torch's speed; moving the bytes "
            f"alone would give {theirs.traffic.total / ours.traffic.total:.2f}x ({theirs.traffic.total} / "
            f"{ours.traffic.total} bytes per element); streaming limit {case.limit_gbps(numel):.1f} GB/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if args.numel < 1 or args.threads < 1 or args.repeats < 1:
        parser.error("--numel, --threads and --repeats must be positive")
    use_threads(args.threads)
    if not CPUAdam([torch.zeros(1)]).uses_extension:
        raise SystemExit("the CPUAdam C++ kernel could not be built here: nothing to compare")
    load = os.getloadavg()
    print(
        f"{args.numel:,} parameters, {args.threads} threads on both sides (torch.set_num_threads, "
        f"{THREADS_VARIABLE}; checked equal before timing), median of {args.repeats} interleaved rounds "
        f"after 2 warm-up rounds; load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
    )
    # One case after the other: each holds ~1.7 GB at 50M parameters, freed before the next.
    cases = {label: measure_case(dtype, args.numel, args.repeats) for label, dtype in CASES.items()}
    report(args.numel, cases)
    load = os.getloadavg()
    print(f"\nload average after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
