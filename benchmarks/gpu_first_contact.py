"""The first GPU session in one command: every check that needs a GPU, in one table.

    python -m benchmarks.gpu_first_contact              # on one CUDA device, offline image; < 10 minutes
    python -m benchmarks.gpu_first_contact --smoke      # tiny sizes on any device (CPU: TRITON_INTERPRET=1)

Rows, in the order they run (`--rows` picks some; see SECTIONS for why this order): `kernels` (the
fused kernels at T-NLG and MT-NLG widths, fused Adam past 2^31 elements on the Triton and the CUDA
backend), `side-by-side` (benchmarks/side_by_side.py: tnlg stage 0 and 3, torch FSDP2 and Transformers
GPT-2 on the same tnlg-1.3b weights and batches, gated on first-step losses, ABBA-timed: step time,
tokens/s, MFU, peak memory; then tnlg's kernels timed against torch's), `builds` (the CUDA fused Adam
and the CPU Adam extensions, built in the background from the start), `gpu-tests` (pytest -m gpu), `zero` (stages 0-3
x bf16/fp16 x optimizer offload x no_sync against the unsharded fp32 reference), `checkpoint` (save,
load into a fresh engine, one more step).

Each row is printed (and flushed) as soon as its section ends, so that a run stopped at its time limit
still shows what it did. With the environment variable OUT set, the full logs go there too (a GPU
machine sends $OUT back): `first_contact.md` (the table as it grows, then the tracebacks),
`errors.log` (each ERROR row's traceback, when it happens), `side_by_side.md` (that report whole),
`gpu_tests.log` (pytest's whole output), `cuda_adam_build.log` and `cpu_adam_build.log`.

Each check that fails prints its row as MISMATCH (or ERROR, with the exception) and the others still
run: the first session should see every problem at once. The exit status is 1 if any row failed.
`--inject-mismatch` shifts one ZeRO comparison on purpose, to show that a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu_bench import (
    bias_gelu_case,
    cross_entropy_case,
    layer_norm_case,
    relative_error,
)
from benchmarks.side_by_side import VARIANTS, is_failure, side_by_side_lines
from tests.support import REPO
from tests.support.zero_cases import SMALL
from tests.support.zero_models import batches, local, make_model, make_optimizer, train_reference
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.kernels.build import KernelUnavailable
from tnlg.sharding.kernels.cuda_adam import require_cuda_extension
from tnlg.sharding.kernels.fused_adam import AdamHyper, adam_reference, fused_adam

DISTRIBUTED_ROWS = ("zero", "checkpoint")  # what runs under torchrun on several ranks
# Loss tolerance against the fp32 reference after a few steps, relative: bf16 keeps 8 significant bits
# (one ulp of this model's loss, about 14, is 4.5e-3 relative) and its weights drift from the fp32 ones
# step by step; fp16 keeps 11. The CPU equivalence tests hold bf16 to 2e-2 as well.
LOSS_TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2}
# fp16 with a fixed loss scale: the dynamic one starts at 2^16, overflows this model's gradients and
# skips the first steps, which the reference does not (tests/sharding/test_zero_equivalence.py).
FP16_LOSS_SCALE = 128.0
ZERO_STEPS = 4
KERNEL_TOLERANCE = 2e-2  # bf16 gradients against torch's (benchmarks/gpu_bench.py's tolerance)
ADAM_TOLERANCE = 1e-6  # fp32 update against the reference
ADAM_CHECK = "fused Adam > 2^31 elements"
BUILD_CHECK = "extension build"
# nvcc compiles the CUDA Adam extension for one architecture in about a minute; a hung build must end
# before the session's time does.
BUILD_TIMEOUT = 480


@dataclass(frozen=True)
class Row:
    check: str
    setting: str
    result: str  # "ok", "skipped", "MISMATCH" or "ERROR"
    figure: str

    @property
    def failed(self) -> bool:
        return self.result in ("MISMATCH", "ERROR")

    def __str__(self) -> str:
        return f"| {self.check} | {self.setting} | {self.result} | {self.figure} |"


@dataclass(frozen=True)
class Options:
    smoke: bool
    inject_mismatch: bool
    device: torch.device
    world_size: int = 1  # > 1 under torchrun: the zero and checkpoint rows on that many ranks
    checkpoint_dir: str | None = None  # keep the checkpoint row's checkpoint here, or resume from it
    out: Path | None = None  # $OUT: where the full logs go
    builds: Mapping[str, Future[Row]] | None = None  # the background builds' rows, once started


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISMATCH"


def ranks(options: Options) -> str:
    """The setting's world size; at one rank every collective is a local copy, so that ZeRO's
    communication is not what such a row checks."""
    if options.world_size == 1:
        return "1 rank (collectives are local copies)"
    return f"{options.world_size} ranks"


@contextlib.contextmanager
def log_path(out: Path | None, name: str) -> Iterator[Path]:
    """Where a subprocess's whole output goes: $OUT/name (it comes back from the GPU machine), or a
    scratch file that is read and removed."""
    if out is not None:
        yield out / name
        return
    with tempfile.TemporaryDirectory() as scratch:
        yield Path(scratch) / name


def run_logged(command: list[str], log: Path, timeout: float) -> int | None:
    """`command`'s exit status (None: killed at `timeout` seconds), its stdout and stderr written to
    `log` as they come, so that the log holds what it did even if this run is stopped first."""
    with log.open("w") as stream:
        try:
            done = subprocess.run(command, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    return done.returncode


def last_line(text: str, limit: int = 200) -> str:
    lines = text.strip().splitlines()
    return " ".join(lines[-1].split())[:limit] if lines else "no output"


# ---------------------------------------------------------------------------- 1. fused kernels
def kernel_rows(options: Options) -> list[Row]:
    widths, rows, vocab = ((4256, 20480), 2, 1000) if options.smoke else ((4256, 20480), 8, 50304)
    generator = torch.Generator().manual_seed(2)
    device = options.device
    cases: dict[str, Callable[[int], Callable]] = {
        "Triton LayerNorm": lambda width: layer_norm_case(rows, width, device, generator),
        "Triton bias + GeLU": lambda width: bias_gelu_case(rows, width, device, generator),
        "chunked LM head + CE": lambda width: cross_entropy_case(rows, width, vocab, device, generator),
    }
    table = []
    for width in widths:
        for name, case in cases.items():
            run = case(width)
            error = max(relative_error(a, b) for a, b in zip(run(True), run(False), strict=True))
            figure = f"max rel grad error {error:.1e} (tol {KERNEL_TOLERANCE:.0e})"
            setting = f"hidden {width}, {rows} rows" + (f", vocabulary {vocab}" if "CE" in name else "")
            table.append(Row(f"fused {name}", setting, verdict(error <= KERNEL_TOLERANCE), figure))
            del run
    return table + adam_rows(options)


def adam_rows(options: Options) -> list[Row]:
    """Triton's fused Adam, then the CUDA extension's: its row says why where it cannot run (an ERROR
    on a CUDA device, where it should)."""
    rows = [adam_row(options, "triton")]
    unavailable = cuda_adam_unavailable(options)
    if unavailable is None:
        return [*rows, adam_row(options, "cuda")]
    result = "ERROR" if options.device.type == "cuda" else "skipped"
    return [
        *rows,
        Row(ADAM_CHECK, "backend cuda" + (" (smoke)" if options.smoke else ""), result, unavailable),
    ]


def cuda_adam_unavailable(options: Options) -> str | None:
    """Why the CUDA extension cannot run here, or None. Waits for the background build if one was
    started; one that failed is not tried again in this process (each try is another compile)."""
    if options.device.type != "cuda":
        return "no CUDA device"
    built = cuda_build(options)
    if built is not None and built.result != "ok":
        return f"the extension did not build: {built.figure} (see the {BUILD_CHECK} row)"
    try:
        require_cuda_extension()  # loads what the background build compiled (the same flags: its cache)
    except KernelUnavailable as reason:
        return str(reason)
    return None


def adam_slices(numel: int) -> list[slice]:
    """The start, the end, and across 2^31 (where an int32 offset wraps) in a tensor that reaches
    past it; a smaller tensor's middle instead."""
    middle = 2**31 if numel > 2**31 else numel // 2
    return [slice(0, 2048), slice(middle - 2048, middle + 2048), slice(numel - 2048, numel)]


def adam_row(options: Options, backend: str) -> Row:
    """Fused Adam on one flat tensor past 2^31 elements (int32 offsets would wrap), compared with the
    reference on slices at the start, across 2^31 and at the end."""
    numel = 10_000 if options.smoke else 2**31 + 4099
    need = 16 * numel  # fp32 param, exp_avg, exp_avg_sq; bf16 grad and copy
    if options.device.type == "cuda":
        # The previous row's tensors (34 GiB for Triton's) stay cached by torch's allocator otherwise,
        # and the free memory the next row needs would not be there on an 80 GB H100.
        torch.cuda.empty_cache()
        if torch.cuda.mem_get_info(options.device)[0] < need * 1.1:
            setting = f"{numel:,} elements, backend {backend}"
            return Row(ADAM_CHECK, setting, "skipped", f"needs {need / 2**30:.0f} GiB free")
    torch.manual_seed(3)
    param = torch.randn(numel, device=options.device)
    grad = torch.randn(numel, device=options.device, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    out16 = torch.empty_like(grad)
    slices = adam_slices(numel)
    before = [param[s].clone() for s in slices]
    hyper = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 1, True)
    ran = fused_adam(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                     out16=out16, backend=backend)  # fmt: skip
    error = 0.0
    for piece, start in zip(slices, before, strict=True):
        want, moments = start.clone(), (torch.zeros_like(start), torch.zeros_like(start))
        want16 = torch.empty_like(grad[piece])
        adam_reference(want, grad[piece], *moments, hyper, out16=want16)
        error = max(error, relative_error(param[piece], want), relative_error(out16[piece], want16))
    del param, grad, exp_avg, exp_avg_sq, out16
    where = "middle" if numel <= 2**31 else "across 2^31"
    figure = f"max rel error {error:.1e} on 3 slices: start, {where}, end (tol {ADAM_TOLERANCE:.0e})"
    setting = f"{numel:,} elements, backend {ran}" + (" (smoke)" if options.smoke else "")
    return Row(ADAM_CHECK, setting, verdict(error <= ADAM_TOLERANCE), figure)


# ---------------------------------------------------------------------------- 2. extension builds
@dataclass(frozen=True)
class Build:
    """A C++ extension built in a subprocess of its own, whose whole output is the build's log.
    `code` runs with `python -c` and raises where the build fails, the compiler's output in the
    exception's chain (the extension modules keep it as the cause of their KernelUnavailable)."""

    setting: str
    log: str  # the log's file name under $OUT
    code: str


BUILDS = {
    "cuda": Build(
        "CUDA fused Adam (csrc/fused_adam.cpp + fused_adam_kernel.cu, nvcc)",
        "cuda_adam_build.log",
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from tnlg.sharding.kernels.cuda_adam import require_cuda_extension\n"
        "print(require_cuda_extension().__file__)",
    ),
    "cpu": Build(
        "CPU Adam (csrc/cpu_adam.cpp, for optimizer offload)",
        "cpu_adam_build.log",
        # cpu_extension warns and returns None where the build fails: the warning, raised instead,
        # carries the failed build in its chain. Only tnlg's own warnings: an import's must not fail it.
        "import warnings; warnings.filterwarnings('error', message='tnlg:')\n"
        "from tnlg.sharding.kernels.build import cpu_extension\n"
        "print(cpu_extension('cpu_adam').__file__)",
    ),
}


def start_builds(options: Options) -> dict[str, Future[Row]]:
    """Both builds, started now: they compile on the CPU while the GPU rows run (nvcc takes about a
    minute), and each ends as its row. A failed build is otherwise invisible: the CUDA Adam falls back
    to Triton and CPUAdam to torch's, each with one warning."""
    pool = ThreadPoolExecutor(max_workers=len(BUILDS), thread_name_prefix="build")
    futures: dict[str, Future[Row]] = {}
    for key, build in BUILDS.items():
        reason = build_skipped(key, options)
        if reason is None:
            futures[key] = pool.submit(run_build, build, options.out)
        else:
            futures[key] = Future()
            futures[key].set_result(Row(BUILD_CHECK, build.setting, "skipped", reason))
    pool.shutdown(wait=False)  # the submitted builds still run to their end
    return futures


def build_skipped(key: str, options: Options) -> str | None:
    if key == "cuda" and options.device.type != "cuda":
        return "no CUDA device"
    if key == "cpu" and options.smoke:
        return "--smoke: a fresh build takes over a minute on a small machine; the CPUAdam tests build it"
    return None


def run_build(build: Build, out: Path | None) -> Row:
    started = time.perf_counter()
    with log_path(out, build.log) as log:
        status = run_logged([sys.executable, "-c", build.code], log, BUILD_TIMEOUT)
        output = log.read_text(errors="replace")
    seconds = f"{time.perf_counter() - started:.0f} s" + (f", log {build.log}" if out is not None else "")
    if status == 0:
        return Row(BUILD_CHECK, build.setting, "ok", seconds)
    why = f"timed out after {BUILD_TIMEOUT} s" if status is None else last_line(output)
    return Row(BUILD_CHECK, build.setting, "ERROR", f"{why}; {seconds}")


def cuda_build(options: Options) -> Row | None:
    """The background CUDA build's row once it ends, or None where none was started."""
    return options.builds["cuda"].result() if options.builds is not None else None


def build_rows(options: Options) -> list[Row]:
    builds = options.builds if options.builds is not None else start_builds(options)
    return [future.result() for future in builds.values()]


# ---------------------------------------------------------------------------- 3. side by side
SIDE_BY_SIDE = "side by side"


def side_by_side_rows(options: Options) -> list[Row]:
    """benchmarks/side_by_side.py: tnlg stage 0 and 3, torch FSDP2 and Transformers GPT-2 on the same
    weights and batches, gated on their first-step losses, timed in ABBA order; then tnlg's kernels
    against torch's. Its whole report goes to $OUT/side_by_side.md line by line; its figures become rows."""
    rows: list[Row] = []
    gate_passed = False
    with log_path(options.out, "side_by_side.md") as path, path.open("w") as log:
        for line in side_by_side_lines(options.smoke, options.device):
            log.write(line + "\n")
            log.flush()
            gate_passed = gate_passed or line.startswith("gate passed")
            rows.extend(side_by_side_row(line))
    if not gate_passed:
        rows.append(Row(SIDE_BY_SIDE, "first-step loss gate", "MISMATCH", "no timing (side_by_side.md)"))
    return rows


def side_by_side_row(line: str) -> list[Row]:
    """The row a line of side_by_side's report makes, if any: a failed check, a variant's timing, a
    ratio, or a kernel against torch's."""
    cells = [cell.strip() for cell in line.split("|")[1:-1]]
    if line.startswith("gate passed: "):
        return [Row(SIDE_BY_SIDE, "first-step loss gate", "ok", line.removeprefix("gate passed: "))]
    if is_failure(line):
        return [Row(SIDE_BY_SIDE, cells[0], "MISMATCH", "; ".join(cells[1:-1]))]
    if len(cells) == 6 and cells[0] in VARIANTS:  # variant | ms | tokens/s | MFU | MFU matmul | GiB
        name, milliseconds, tokens, mfu, mfu_matmul, memory = cells
        figure = f"{milliseconds} ms, {tokens} tokens/s, MFU {mfu} (datasheet), {mfu_matmul} (matmul), {memory} GiB"
        return [Row(SIDE_BY_SIDE, name, "ok", figure)]
    if len(cells) == 2 and "bf16" in cells[0]:  # the achievable matmul
        return [Row(SIDE_BY_SIDE, f"matmul {cells[0]}", "ok", f"{cells[1]} TFLOP/s")]
    if len(cells) == 7 and cells[-1] == "ok":  # kernel | torch's | torch ms | tnlg ms | ratio | check | ok
        kernel, torch_name, torch_ms, tnlg_ms, ratio, check, result = cells
        figure = f"{tnlg_ms} ms against {torch_ms} ms ({torch_name}): torch / tnlg {ratio}; {check}"
        return [Row("kernel vs torch", kernel, result, figure)]
    if " / " in line and ": " in line and not cells:  # a ratio line
        label, value = line.rsplit(": ", 1)
        return [Row(SIDE_BY_SIDE, label, "ok", value)]
    return []


# ---------------------------------------------------------------------------- 4. gpu-marked tests
def gpu_test_rows(options: Options) -> list[Row]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    if options.smoke:
        command.append("--collect-only")
    with log_path(options.out, "gpu_tests.log") as log:
        status = run_logged(command, log, timeout=420)
        summary = last_line(log.read_text(errors="replace"), limit=300)
    setting = "pytest -m gpu" + (" --collect-only" if options.smoke else "")
    if status is None:
        return [Row("gpu-marked tests", setting, "ERROR", f"timed out after 420 s; last line: {summary}")]
    if options.smoke:
        # pytest -q --collect-only ends with "N/M tests collected (K deselected) in ...s"
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", summary)
        figure = f"{found.group(1)} collected" if found else summary
        return [Row("gpu-marked tests", setting, verdict(status == 0), figure)]
    counts = dict.fromkeys(("passed", "failed", "skipped", "error"), 0)
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
        counts[word.rstrip("s") if word.startswith("error") else word] += int(number)
    figure = ", ".join(f"{count} {word}" for word, count in counts.items())
    return [Row("gpu-marked tests", setting, verdict(status == 0), figure)]


# ---------------------------------------------------------------------------- 5. ZeRO settings
@dataclass(frozen=True)
class ZeroSetting:
    stage: int
    precision: str
    offload: bool
    no_sync: bool

    def config(self) -> ZeroConfig:
        return ZeroConfig(
            **SMALL,
            stage=self.stage,
            mixed_precision=self.precision,
            offload_optimizer="cpu" if self.offload else "none",
            static_loss_scale=FP16_LOSS_SCALE if self.precision == "fp16" else None,
        )

    def __str__(self) -> str:
        offload = "optimizer offload" if self.offload else "no offload"
        return f"stage {self.stage}, {self.precision}, {offload}, no_sync {'on' if self.no_sync else 'off'}"


def zero_settings() -> list[ZeroSetting]:
    """Stages 0-3 x bf16/fp16 x offload x no_sync; offload is a stage 1-3 setting."""
    return [
        ZeroSetting(stage, precision, offload, no_sync)
        for stage in range(4)
        for precision in ("bf16", "fp16")
        for offload in ((False,) if stage == 0 else (False, True))
        for no_sync in (False, True)
    ]


def train_steps(engine, steps: list, device: torch.device, no_sync: bool) -> tuple[list[float], int]:
    """This rank's slice of each global batch as two accumulated micro-batches (the first under
    `no_sync` if asked): (losses of the global batches, their mean over the ranks; steps skipped)."""
    losses, skipped = [], 0
    rank, world_size = engine.collectives.rank, engine.collectives.world_size
    for batch in steps:
        input_ids, labels = local(batch, rank, world_size)
        micro = list(zip(input_ids.chunk(2), labels.chunk(2), strict=True))
        total = 0.0
        for index, (ids, lab) in enumerate(micro):
            last = index == len(micro) - 1
            with engine.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = engine(ids.to(device), lab.to(device)) / len(micro)
                engine.backward(loss)
            total += loss.item()
        engine.step()
        skipped += engine.step_was_skipped
        losses.append(_mean_over_ranks(total, engine.collectives.group, device))
    return losses, skipped


def _mean_over_ranks(value: float, group, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    total = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)


def fresh_engine(setting: ZeroSetting, device: torch.device):
    model = make_model().to(device)
    return initialize(model, make_optimizer(model), setting.config())


def zero_rows(options: Options) -> list[Row]:
    reference, _, _ = train_reference(ZERO_STEPS)
    rows = []
    for index, setting in enumerate(zero_settings()):
        engine = fresh_engine(setting, options.device)
        losses, skipped = train_steps(engine, batches(ZERO_STEPS), options.device, setting.no_sync)
        engine.close()
        if options.inject_mismatch and index == 0:
            losses[0] += 1.0  # --inject-mismatch: this comparison must fail the run
        error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        tolerance = LOSS_TOLERANCE[setting.precision]
        figure = f"max rel loss diff {error:.1e} (tol {tolerance:.0e}), {skipped} skipped"
        ok = error <= tolerance and not skipped
        rows.append(Row("ZeRO vs fp32 reference", f"{ranks(options)}: {setting}", verdict(ok), figure))
    return rows


# ---------------------------------------------------------------------------- 6. checkpoint round trip
CHECKPOINT_SETTING = ZeroSetting(stage=3, precision="bf16", offload=False, no_sync=True)
CHECKPOINT_LOSS_TOLERANCE = 1e-2  # about two bf16 ulps of the loss (see checkpoint_rows)
CHECKPOINT_PARAM_TOLERANCE = 2e-3
EXPECTED_FILE = "gpu_first_contact_expected.pt"  # next to a kept checkpoint: the uninterrupted 3rd step


def checkpoint_rows(options: Options) -> list[Row]:
    """Two steps, save, load into a fresh engine, the third step: against three steps uninterrupted.
    With `--checkpoint-dir` the checkpoint (and the uninterrupted run's result) is kept there, and a
    later run, at another world size, resumes from it instead of saving its own: the reshape."""
    with shared_directory() as scratch:
        directory = Path(options.checkpoint_dir or scratch)
        kept = directory / EXPECTED_FILE
        resuming = kept.exists()  # read by every rank before any rank writes
        if resuming:
            expected = torch.load(kept, weights_only=True)
        else:
            expected = _save_after_two_steps(options, directory)
        loss, state = _resume_third_step(options, directory)
    loss_error = abs(loss - expected["loss"]) / abs(expected["loss"])
    # full_state_dict is rank 0's alone (empty elsewhere): the other ranks compare the losses
    diffs = ((state[k].float() - v.float()).abs().max().item() for k, v in expected["state"].items())
    state_error = max(diffs, default=0.0)
    # The same inputs and kernels: equal but for the order of atomic adds in CUDA's backward kernels
    # (embedding) and, across world sizes, of the gradient reduction and the micro-batch shapes. The
    # loss is a bf16 value (one ulp of a loss of about 14 is 4.5e-3 relative), so a changed last bit
    # of a logit can move it by that much; the fp32 master weights move by far less (1.7e-4 measured 2 -> 1 on
    # CPU), while a lost optimizer state would move them by about the learning rate (1e-2).
    ok = loss_error <= CHECKPOINT_LOSS_TOLERANCE and state_error <= CHECKPOINT_PARAM_TOLERANCE
    figure = (
        f"3rd-step loss rel diff {loss_error:.1e} (tol {CHECKPOINT_LOSS_TOLERANCE:.0e}), "
        f"max param diff {state_error:.1e} (tol {CHECKPOINT_PARAM_TOLERANCE:.0e})"
    )
    where = f"saved by {expected['world_size']} rank(s), resumed on {options.world_size}"
    setting = f"{ranks(options)}: {CHECKPOINT_SETTING}; {where}"
    return [Row("checkpoint round trip", setting, verdict(ok), figure)]


def _save_after_two_steps(options: Options, directory: Path) -> dict:
    """Saves the checkpoint after two steps into `directory`; returns the uninterrupted third step."""
    steps = batches(3)
    first = fresh_engine(CHECKPOINT_SETTING, options.device)
    train_steps(first, steps[:2], options.device, CHECKPOINT_SETTING.no_sync)
    first.save_checkpoint(directory)
    first.close()
    whole = fresh_engine(CHECKPOINT_SETTING, options.device)
    losses, _ = train_steps(whole, steps, options.device, CHECKPOINT_SETTING.no_sync)
    state = {k: v.cpu() for k, v in whole.full_state_dict().items()}
    expected = {"loss": losses[-1], "state": state, "world_size": options.world_size}
    whole.close()
    if options.checkpoint_dir and not (dist.is_initialized() and dist.get_rank() != 0):
        torch.save(expected, directory / EXPECTED_FILE)
    return expected


def _resume_third_step(options: Options, directory: Path) -> tuple[float, dict]:
    resumed = fresh_engine(CHECKPOINT_SETTING, options.device)
    resumed.load_checkpoint(directory)
    (loss,), _ = train_steps(resumed, batches(3)[2:], options.device, CHECKPOINT_SETTING.no_sync)
    state = {k: v.cpu() for k, v in resumed.full_state_dict().items()}
    resumed.close()
    return loss, state


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """A scratch directory that every rank of this node writes into (rank 0 makes and removes it)."""
    if not dist.is_initialized():
        with tempfile.TemporaryDirectory() as directory:
            yield directory
        return
    scratch = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scratch, src=0)
    try:
        yield scratch[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(scratch[0])


# ---------------------------------------------------------------------------- the table
# The order they run in, what matters most first, so that a run stopped at its time limit has done that:
# the fused kernels and fused Adam past 2^31 (checked on a GPU nowhere else; a minute), the side-by-side
# training comparison (the throughput this session is for), the extension builds (compiling since the
# start, reported once they end), the gpu-marked tests (several minutes), then ZeRO and the checkpoint
# round trip, whose arithmetic the CPU tests already check on gloo processes.
SECTIONS: dict[str, Callable[[Options], list[Row]]] = {
    "kernels": kernel_rows,
    "side-by-side": side_by_side_rows,
    "builds": build_rows,
    "gpu-tests": gpu_test_rows,
    "zero": zero_rows,
    "checkpoint": checkpoint_rows,
}
ROWS = tuple(SECTIONS)


class Report:
    """The table as it grows: the header first, each row printed and flushed when its section ends,
    and the same lines in $OUT/first_contact.md; each ERROR row's traceback to stderr and $OUT/errors.log
    when it happens. Only rank 0 prints and writes (every rank computes the same rows: the losses are
    means over the ranks)."""

    def __init__(self, options: Options):
        self.options = options
        self.rows: list[Row] = []
        self.tracebacks: list[tuple[str, str]] = []
        self.writing = int(os.environ.get("RANK", "0")) == 0
        out = options.out if self.writing else None
        self.markdown = out / "first_contact.md" if out is not None else None
        self.errors = out / "errors.log" if out is not None else None
        for path in (self.markdown, self.errors):
            if path is not None:
                path.unlink(missing_ok=True)  # a rerun into the same $OUT starts afresh

    def begin(self) -> None:
        options = self.options
        device = torch.cuda.get_device_name(options.device) if options.device.type == "cuda" else "CPU"
        where = f"{device} x {options.world_size}" if options.world_size > 1 else device
        smoke = " (smoke)" if options.smoke else ""
        self._emit(f"# gpu_first_contact on {where}{smoke}, torch {torch.__version__}\n")
        self._emit("| check | setting | result | figure |\n|---|---|---|---|")

    def add(self, rows: list[Row]) -> None:
        self.rows += rows
        for row in rows:
            self._emit(str(row))

    def error(self, section: str, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self.tracebacks.append((section, text))
        if self.errors is not None:
            with self.errors.open("a") as stream:
                stream.write(f"--- {section}\n{text}\n")

    def end(self) -> int:
        """The summary line (and, in first_contact.md, the tracebacks); the exit status."""
        failed = sum(row.failed for row in self.rows)
        self._emit(f"\n{len(self.rows)} rows, {failed} failed" + ("" if failed else ": every check passed"))
        if self.markdown is not None and self.tracebacks:
            with self.markdown.open("a") as stream:
                stream.write("\n## Tracebacks\n")
                for section, text in self.tracebacks:
                    stream.write(f"\n### {section}\n\n```\n{text.rstrip()}\n```\n")
        return 1 if failed else 0

    def _emit(self, text: str) -> None:
        if not self.writing:
            return
        print(text, flush=True)
        if self.markdown is not None:
            with self.markdown.open("a") as stream:
                stream.write(text + "\n")


def run_section(name: str, options: Options, report: Report) -> list[Row]:
    """A section that raises becomes one ERROR row, its traceback in the report; the next sections
    still run."""
    try:
        return SECTIONS[name](options)
    except Exception as error:  # reported in the table and the exit status
        report.error(name, traceback.format_exc())
        message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        return [Row(name, "", "ERROR", message)]
    finally:
        if options.device.type == "cuda":
            torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> tuple[list[str], Options]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device (checks the script)")
    parser.add_argument("--inject-mismatch", action="store_true", help="make one ZeRO comparison fail")
    parser.add_argument("--checkpoint-dir", help="keep the checkpoint row's checkpoint here; resume if there")
    parser.add_argument(
        "--rows", help=f"comma-separated subset of {','.join(ROWS)}, run in that order (default: all)"
    )
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rows = args.rows.split(",") if args.rows else list(ROWS if world_size == 1 else DISTRIBUTED_ROWS)
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if world_size > 1 and set(rows) - set(DISTRIBUTED_ROWS):
        parser.error(
            f"under torchrun (WORLD_SIZE={world_size}) only the rows {', '.join(DISTRIBUTED_ROWS)} run"
        )
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.exit(2, "gpu_first_contact needs a CUDA device (use --smoke to check the script elsewhere)\n")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        parser.exit(
            2, "--smoke on CPU runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1\n"
        )
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    # SECTIONS' order, whatever order --rows names them in
    ordered = [name for name in ROWS if name in rows]
    return ordered, Options(args.smoke, args.inject_mismatch, device, world_size, args.checkpoint_dir, out)


def main(argv: list[str] | None = None) -> int:
    rows, options = parse_args(argv)
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
    if options.device.type == "cuda":
        torch.cuda.set_device(options.device)
        # One architecture, this device's (9.0 on an H100 or H200): nvcc compiles once, and every process
        # that loads the extension (the builds, this one, the gpu-marked tests) asks for the same flags,
        # so that they share one cached build.
        major, minor = torch.cuda.get_device_capability(options.device)
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    if "builds" in rows:
        options = dataclasses.replace(options, builds=start_builds(options))
    if options.world_size > 1:  # torchrun's environment names the rendezvous
        dist.init_process_group("nccl" if options.device.type == "cuda" else "gloo")
    report = Report(options)
    report.begin()
    for name in rows:
        report.add(run_section(name, options, report))
    if options.world_size > 1:
        dist.destroy_process_group()
    return report.end()


if __name__ == "__main__":
    sys.exit(main())
