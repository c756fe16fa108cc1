"""One tnlg training step under torch.profiler: where its time goes on the device.

    python -m benchmarks.profile_step [--stage 0] [--activation-checkpointing on|off] [--fused auto|none]
                                      [--compile on|off]

Builds side_by_side's tnlg variant (tnlg-1.3b shape, bf16, sequence 2048, the same seeded weights and
batches), runs its warm-up steps, then profiles one step and prints:

- the step's wall time, the time some kernel was running (the union of kernel intervals) and the idle
  rest, with the kernel count: idle time is launch overhead and host work the device waits for;
- the kernels that took the most time, grouped by name, with their share of the step;
- the longest gaps between one kernel's end and the next one's start, with the kernels around them;
- how much of the device's idle time it spent waiting for the host: gaps whose next kernel was launched
  only after everything queued before it had finished (the host, not the device, set the pace there;
  the profiler's own host overhead lengthens them, so read them beside the unprofiled step time);
- with `--compile on` (each block compiled by inductor, as side_by_side's compiled variants), the
  compilations the warm-up steps ran and any during the profiled step.

With `OUT` set the profiler's trace goes there (`step_trace_<tag>.json.gz`, for chrome://tracing or
Perfetto). `--smoke` runs the debug preset on the CPU (Triton under TRITON_INTERPRET=1) to check the
script; with no CUDA it has no kernels to show.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.side_by_side import Settings, make_workload, one_rank_group, synchronize, tnlg_trainer

TOP_KERNELS = 15
TOP_GAPS = 5
NAME_WIDTH = 90  # kernel names (C++ templates) are cut to this many characters
# Categories of the profiler's trace events (Kineto's chrome trace): work on the device, and the host's
# calls that launched it, paired by the `correlation` argument both carry.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


def device_kernels(prof: profile) -> list[Kernel]:
    """The device kernels (and device-side copies) the profiled step ran, in start order."""
    kernels = [
        Kernel(event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    return sorted(kernels, key=lambda kernel: kernel.start_us)


def busy_microseconds(kernels: list[Kernel]) -> float:
    """The union of the kernels' intervals: overlapping kernels (several streams) count once."""
    busy, reach = 0.0, float("-inf")
    for kernel in kernels:
        start = max(kernel.start_us, reach)
        if kernel.end_us > start:
            busy += kernel.end_us - start
        reach = max(reach, kernel.end_us)
    return busy


@dataclass(frozen=True)
class HostWait:
    idle_us: float  # between the first device activity's start and the last one's end
    waiting_us: float  # the part of it in gaps the host caused
    gaps: int  # how many such gaps


def host_wait(trace_events: Iterable[Mapping]) -> HostWait:
    """From the profiler's trace events: the device's idle time, and the part of it in gaps before an
    activity whose launch call began only once the device had finished everything before it (so the
    device had nothing to run until the host got there). A gap whose next activity was launched earlier
    is the device's own (launch latency, a wait on another stream) and is not counted as the host's, nor
    is one whose launch call began just before the device ran dry and ended after: a lower bound.
    Kernels here include the device's copies and memsets."""
    events = list(trace_events)
    launched = {
        event["args"]["correlation"]: event["ts"]
        for event in events
        if event.get("cat") in LAUNCH_CATEGORIES and "correlation" in event.get("args", {})
    }
    activities = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    idle = waiting = 0.0
    gaps = 0
    reach: float | None = None  # the latest end so far: the device is busy until then
    for activity in activities:
        start = activity["ts"]
        if reach is not None and start > reach:
            idle += start - reach
            launch = launched.get(activity.get("args", {}).get("correlation"))
            if launch is not None and launch >= reach:
                waiting += start - reach
                gaps += 1
        end = start + activity.get("dur", 0)
        reach = end if reach is None else max(reach, end)
    return HostWait(idle, waiting, gaps)


def host_wait_line(wait: HostWait) -> str:
    share = 100 * wait.waiting_us / wait.idle_us if wait.idle_us else 0.0
    return (
        f"device idle between its first and last kernel {wait.idle_us / 1e3:.1f} ms, of which at least "
        f"{wait.waiting_us / 1e3:.1f} ms ({share:.0f}%) waiting for the host to launch the next kernel "
        f"({wait.gaps} gaps)"
    )


def short(name: str) -> str:
    name = name.replace("|", "/")  # a markdown table's cells
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def report_lines(kernels: list[Kernel], wall_us: float) -> list[str]:
    if not kernels:
        return ["no device kernels recorded (no CUDA device): nothing to attribute"]
    busy = busy_microseconds(kernels)
    lines = [
        f"step wall {wall_us / 1e3:.1f} ms; kernels running {busy / 1e3:.1f} ms ({100 * busy / wall_us:.1f}%), "
        f"device idle {(wall_us - busy) / 1e3:.1f} ms; {len(kernels)} kernels",
        "",
        "| kernel | calls | total ms | share of step |",
        "|---|---|---|---|",
    ]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for kernel in kernels:
        totals[kernel.name][0] += 1
        totals[kernel.name][1] += kernel.end_us - kernel.start_us
    ranked = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)
    for name, (calls, total) in ranked[:TOP_KERNELS]:
        lines.append(f"| {short(name)} | {calls} | {total / 1e3:.2f} | {100 * total / wall_us:.1f}% |")
    gaps = sorted(
        ((after.start_us - before.end_us, before, after) for before, after in itertools.pairwise(kernels)),
        key=lambda gap: gap[0],
        reverse=True,
    )
    lines += ["", "| gap ms | after | before |", "|---|---|---|"]
    for gap, before, after in gaps[:TOP_GAPS]:
        lines.append(f"| {gap / 1e3:.2f} | {short(before.name)} | {short(after.name)} |")
    return lines


def profile_one_step(
    settings: Settings, stage: int, fused: str, trace: Path | None, compiled: bool = False
) -> list[str]:
    workload = make_workload(settings)
    if fused != "auto":  # the same weights and batches, another kernel choice
        workload = replace(workload, config=settings.config(fused_kernels=fused))
    trainer = tnlg_trainer(workload, stage, compiled=compiled)
    warmup, (ids, labels) = workload.batches[:-1], workload.batches[-1]
    for warm_ids, warm_labels in warmup:
        trainer.step(warm_ids, warm_labels)
    warm = trainer.compile_stats()  # None when eager
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if settings.cuda else [])
    synchronize(settings.device)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        trainer.step(ids, labels)
        synchronize(settings.device)
        wall_us = (time.perf_counter() - began) * 1e6
    stats = trainer.compile_stats()  # before close, which stops the engine's count
    trainer.close()
    kernels = device_kernels(prof)
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(raw))  # the launch calls' correlation with kernels is there
        # Parsed on the CPU too, so --smoke runs the parsing (its trace has no device work to count).
        wait = host_wait(json.loads(raw.read_text())["traceEvents"])
        if trace is not None:
            with raw.open("rb") as source, gzip.open(trace, "wb") as target:
                shutil.copyfileobj(source, target)
    lines = report_lines(kernels, wall_us)
    if kernels:
        lines += ["", host_wait_line(wait)]
    if warm is not None:  # compiled (the engine counts from its start to close)
        late = int(stats["compiles"] - warm["compiles"])
        lines += [
            "",
            f"compilations: {int(warm['compiles'])} in the {len(warmup)} warm-up steps "
            f"({warm['compile_seconds']:.1f} s), {late} during the profiled step"
            + (" (its wall time includes them)" if late else ""),
        ]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="the debug preset on any device")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=0)
    parser.add_argument("--activation-checkpointing", choices=("on", "off"), default="on")
    parser.add_argument("--fused", choices=("auto", "none"), default="auto", help="TNLGConfig.fused_kernels")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default 4; --smoke 2)")
    parser.add_argument(
        "--compile", choices=("on", "off"), default="off", help="each block compiled (inductor)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        parser.exit(2, "profile_step needs a CUDA device (use --smoke to check the script elsewhere)\n")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch must be at least 1, got {args.micro_batch}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    settings = Settings.create(args.smoke, device, args.micro_batch, args.activation_checkpointing == "on")
    tag = f"stage{args.stage}_ckpt-{args.activation_checkpointing}_fused-{args.fused}_compile-{args.compile}"
    out = os.environ.get("OUT")
    trace = Path(out) / f"step_trace_{tag}.json.gz" if out else None
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(
        f"# profile_step on {name}: tnlg stage {args.stage}, {settings.preset}, micro-batch "
        f"{settings.micro_batch} x {settings.seq_len}, activation checkpointing "
        f"{args.activation_checkpointing}, fused kernels {args.fused}, compile {args.compile}",
        flush=True,
    )
    with one_rank_group(device):
        lines = profile_one_step(settings, args.stage, args.fused, trace, compiled=args.compile == "on")
    print("\n".join(["", *lines, ""]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
