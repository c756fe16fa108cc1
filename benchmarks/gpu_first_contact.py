"""The first GPU session in one command: every check that needs a GPU, in one table.

    python -m benchmarks.gpu_first_contact              # on one CUDA device, offline image; < 10 minutes
    python -m benchmarks.gpu_first_contact --smoke      # tiny sizes on any device (CPU: TRITON_INTERPRET=1)

Rows (`--rows` picks some): `install` (an editable install into a throwaway venv that sees this
interpreter's packages, then `import tnlg` there), `gpu-tests` (pytest -m gpu), `zero` (stages 0-3 x
bf16/fp16 x optimizer offload x no_sync against the unsharded fp32 reference), `checkpoint` (save, load
into a fresh engine, one more step), `kernels` (the fused kernels at T-NLG and MT-NLG widths, fused Adam
past 2^31 elements), `training` (a tnlg-1.3b step: tokens/s and MFU).

Each check that fails prints its row as MISMATCH (or ERROR, with the exception) and the others still
run: the first session should see every problem at once. The exit status is 1 if any row failed.
`--inject-mismatch` shifts one ZeRO comparison on purpose, to show that a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.gpu_bench import (
    bench_training,
    bias_gelu_case,
    cross_entropy_case,
    layer_norm_case,
    relative_error,
)
from tests.support import REPO
from tests.support.zero_cases import SMALL
from tests.support.zero_models import batches, local, make_model, make_optimizer, train_reference
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.kernels.cuda_adam import cuda_extension
from tnlg.sharding.kernels.fused_adam import AdamHyper, adam_reference, fused_adam

ROWS = ("install", "gpu-tests", "zero", "checkpoint", "kernels", "training")
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


@dataclass(frozen=True)
class Row:
    check: str
    setting: str
    result: str  # "ok", "skipped", "MISMATCH" or "ERROR"
    figure: str

    @property
    def failed(self) -> bool:
        return self.result in ("MISMATCH", "ERROR")


@dataclass(frozen=True)
class Options:
    smoke: bool
    skip_install: bool
    inject_mismatch: bool
    device: torch.device
    world_size: int = 1  # > 1 under torchrun: the zero and checkpoint rows on that many ranks
    checkpoint_dir: str | None = None  # keep the checkpoint row's checkpoint here, or resume from it


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISMATCH"


# ---------------------------------------------------------------------------- 1. offline install
def install_rows(options: Options) -> list[Row]:
    check = "offline editable install"
    if options.smoke or options.skip_install:
        reason = "--smoke" if options.smoke else "--skip-install"
        return [Row(check, "pip install --no-deps --no-build-isolation -e .", "skipped", reason)]
    with tempfile.TemporaryDirectory() as scratch:
        venv = Path(scratch) / "venv"
        # --system-site-packages alone would show the base interpreter's packages, not a venv's that
        # runs this script: a .pth file adds this interpreter's site-packages (torch, transformers).
        _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
        python = venv / "bin" / "python"
        target = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        Path(target.strip(), "_parent_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        # This interpreter's pip installs into the venv (--python): no ensurepip, no index.
        install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
        _run([*install, "--no-deps", "--no-build-isolation", "-e", str(REPO)])
        imported = _run([str(python), "-c", "import tnlg, tnlg.sharding, tnlg.accelerate; print(tnlg.__file__)"],
                        cwd=scratch)  # fmt: skip
    where = Path(imported.strip()).resolve()
    ok = where.is_relative_to(REPO.resolve())
    return [Row(check, "pip install -e . in a throwaway venv; import tnlg, .sharding, .accelerate",
                verdict(ok), f"tnlg from {where.parent}")]  # fmt: skip


def _run(command: list[str], cwd: str | Path | None = None, timeout: float = 300) -> str:
    """stdout of `command`; a failure raises with its output, which the row then shows."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {result.returncode}: {result.stderr[-500:]}")
    return result.stdout


# ---------------------------------------------------------------------------- 2. gpu-marked tests
def gpu_test_rows(options: Options) -> list[Row]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    if options.smoke:
        command.append("--collect-only")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-300:]
    if options.smoke:
        # pytest -q --collect-only ends with "N/M tests collected (K deselected) in ...s"
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", summary)
        figure = f"{found.group(1)} collected" if found else summary
        return [
            Row("gpu-marked tests", "pytest -m gpu --collect-only", verdict(result.returncode == 0), figure)
        ]
    counts = dict.fromkeys(("passed", "failed", "skipped", "error"), 0)
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary):
        counts[word.rstrip("s") if word.startswith("error") else word] += int(number)
    figure = ", ".join(f"{count} {word}" for word, count in counts.items())
    return [Row("gpu-marked tests", "pytest -m gpu", verdict(result.returncode == 0), figure)]


# ---------------------------------------------------------------------------- 3. ZeRO settings
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
        rows.append(
            Row("ZeRO vs fp32 reference", str(setting), verdict(error <= tolerance and not skipped), figure)
        )
    return rows


# ---------------------------------------------------------------------------- 4. checkpoint round trip
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
    ranks = f"saved by {expected['world_size']} rank(s), resumed on {options.world_size}"
    return [Row("checkpoint round trip", f"{CHECKPOINT_SETTING}; {ranks}", verdict(ok), figure)]


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


# ---------------------------------------------------------------------------- 5. fused kernels
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
    return table + [adam_row(options, backend) for backend in adam_backends(device)]


def adam_backends(device: torch.device) -> list[str]:
    return ["triton"] + (["cuda"] if device.type == "cuda" and cuda_extension() is not None else [])


def adam_row(options: Options, backend: str) -> Row:
    """Fused Adam on one flat tensor past 2^31 elements (int32 offsets would wrap), compared with the
    reference on slices at the start, across 2^31 and at the end."""
    numel = 10_000 if options.smoke else 2**31 + 4099
    setting = f"{numel:,} elements, backend {backend}" + (" (smoke)" if options.smoke else "")
    need = 16 * numel  # fp32 param, exp_avg, exp_avg_sq; bf16 grad and copy
    if options.device.type == "cuda" and torch.cuda.mem_get_info(options.device)[0] < need * 1.1:
        return Row("fused Adam > 2^31 elements", setting, "skipped", f"needs {need / 2**30:.0f} GiB free")
    torch.manual_seed(3)
    param = torch.randn(numel, device=options.device)
    grad = torch.randn(numel, device=options.device, dtype=torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    out16 = torch.empty_like(grad)
    middle = min(2**31, numel // 2)
    slices = [slice(0, 2048), slice(middle - 2048, middle + 2048), slice(numel - 2048, numel)]
    before = [param[s].clone() for s in slices]
    hyper = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 1, True)
    fused_adam(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
               out16=out16, backend=backend)  # fmt: skip
    error = 0.0
    for piece, start in zip(slices, before, strict=True):
        want, moments = start.clone(), (torch.zeros_like(start), torch.zeros_like(start))
        want16 = torch.empty_like(grad[piece])
        adam_reference(want, grad[piece], *moments, hyper, out16=want16)
        error = max(error, relative_error(param[piece], want), relative_error(out16[piece], want16))
    del param, grad, exp_avg, exp_avg_sq, out16
    figure = f"max rel error {error:.1e} on 3 slices (tol {ADAM_TOLERANCE:.0e})"
    return Row("fused Adam > 2^31 elements", setting, verdict(error <= ADAM_TOLERANCE), figure)


# ---------------------------------------------------------------------------- 6. training step
def training_rows(options: Options) -> list[Row]:
    """benchmarks/gpu_bench.py's bf16 stage 0 step with activation checkpointing, both kernel sets."""
    preset, micro, seq, steps = ("debug", 2, 32, 2) if options.smoke else ("tnlg-1.3b", 4, 2048, 10)
    rows = []
    for line in bench_training(preset, micro, seq, options.device, steps):
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 4 and cells[0].startswith(("torch", "tnlg")):
            label, milliseconds, tokens, mfu = cells
            setting = f"{preset}, bf16, stage 0, act. ckpt, {micro}x{seq}: {label}"
            rows.append(
                Row(
                    "training step",
                    setting,
                    "ok",
                    f"{milliseconds} ms, {tokens} tokens/s, MFU {mfu or 'n/a'}",
                )
            )
    return rows or [Row("training step", preset, "ERROR", "gpu_bench's table had no rows")]


# ---------------------------------------------------------------------------- the table
SECTIONS: dict[str, Callable[[Options], list[Row]]] = {
    "install": install_rows,
    "gpu-tests": gpu_test_rows,
    "zero": zero_rows,
    "checkpoint": checkpoint_rows,
    "kernels": kernel_rows,
    "training": training_rows,
}


def run_section(name: str, options: Options) -> list[Row]:
    """A section that raises becomes one ERROR row; the next sections still run."""
    try:
        return SECTIONS[name](options)
    except Exception as error:  # reported in the table and the exit status
        traceback.print_exc()
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
    parser.add_argument("--skip-install", action="store_true", help="skip the throwaway-venv install row")
    parser.add_argument("--inject-mismatch", action="store_true", help="make one ZeRO comparison fail")
    parser.add_argument("--checkpoint-dir", help="keep the checkpoint row's checkpoint here; resume if there")
    parser.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)} (default: all)")
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
    return rows, Options(
        args.smoke, args.skip_install, args.inject_mismatch, device, world_size, args.checkpoint_dir
    )


def main(argv: list[str] | None = None) -> int:
    rows, options = parse_args(argv)
    if options.device.type == "cuda":
        torch.cuda.set_device(options.device)
    if options.world_size > 1:  # torchrun's environment names the rendezvous
        dist.init_process_group("nccl" if options.device.type == "cuda" else "gloo")
    table = [row for name in rows for row in run_section(name, options)]
    if options.world_size > 1:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:  # every rank computed the same table (losses are rank means)
        print_table(table, options)
    return 1 if any(row.failed for row in table) else 0


def print_table(rows: list[Row], options: Options) -> None:
    device = torch.cuda.get_device_name(options.device) if options.device.type == "cuda" else "CPU"
    where = f"{device} x {options.world_size}" if options.world_size > 1 else device
    print(f"# gpu_first_contact on {where}{' (smoke)' if options.smoke else ''}, torch {torch.__version__}\n")
    print("| check | setting | result | figure |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row.check} | {row.setting} | {row.result} | {row.figure} |")
    failed = sum(row.failed for row in rows)
    print(f"\n{len(rows)} rows, {failed} failed" + ("" if failed else ": every check passed"))


if __name__ == "__main__":
    sys.exit(main())
