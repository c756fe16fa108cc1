"""GPU kernels and a bf16 training step: each fused kernel checked against its reference, then timed
against torch's own, side by side in one run; then tokens/s and MFU of a `tnlg-1.3b` step with and
without the fused kernels.

    python -m benchmarks.gpu_bench                 # on a CUDA machine; prints markdown tables
    python -m benchmarks.gpu_bench --smoke         # tiny sizes on any device (CPU: TRITON_INTERPRET=1)

Times are medians of `--repeats` runs after warm-up, measured with CUDA events (wall clock on CPU).
A kernel whose output differs from its reference beyond the tolerance stops the run: a fast wrong
kernel is not a result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling import fused_ops
from tnlg.run.activations import enable_activation_checkpointing
from tnlg.run.metrics import peak_flops_per_device
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.kernels.cuda_adam import cuda_extension
from tnlg.sharding.kernels.fused_adam import AdamHyper, adam_reference, adam_triton, fused_adam


def timed(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `run()`."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check(name: str, error: float, tolerance: float) -> None:
    if not error <= tolerance:
        sys.exit(f"{name}: relative error {error:.2e} exceeds {tolerance:.0e}; no timing for a wrong kernel")


def row(name: str, seconds: float, baseline: float, nbytes: int | None = None) -> str:
    bandwidth = f"{nbytes / seconds / 1e9:.0f}" if nbytes else ""
    return f"| {name} | {seconds * 1e3:.3f} | {baseline / seconds:.2f}x | {bandwidth} |"


# ---------------------------------------------------------------------------- Adam
def bench_adam(numel: int, device: torch.device, repeats: int) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=generator).to(device)
    grad = torch.randn(numel, generator=generator).to(device, torch.bfloat16)
    hyper = AdamHyper(1e-4, 0.9, 0.95, 1e-8, 0.1, 10, True)

    def fresh():
        return master.clone(), torch.zeros_like(master), torch.zeros_like(master), torch.empty_like(grad)

    want = fresh()
    adam_reference(want[0], grad, want[1], want[2], hyper, out16=want[3])
    kernels: dict[str, Callable] = {}
    if fused_ops.triton_available():
        kernels["tnlg Triton fused Adam (+ bf16 copy)"] = lambda p, m, v, o: adam_triton(
            p, grad, m, v, hyper, out16=o
        )
    if device.type == "cuda" and cuda_extension() is not None:
        kernels["tnlg CUDA fused Adam (+ bf16 copy)"] = lambda p, m, v, o: fused_adam(
            p, grad, m, v, step=10, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, out16=o, backend="cuda"
        )
    for name, kernel in kernels.items():
        got = fresh()
        kernel(*got)
        check(name, max(relative_error(got[0], want[0]), relative_error(got[1], want[1])), 1e-6)

    # torch: AdamW(fused=True) on an fp32 gradient (it takes no bf16 one: the cast is part of its cost)
    param = torch.nn.Parameter(master.clone())
    torch_adam = torch.optim.AdamW(
        [param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    copy16 = torch.empty_like(grad)

    def torch_step():
        param.grad = grad.float()
        torch_adam.step()
        copy16.copy_(param)

    baseline = timed(torch_step, device, repeats)
    # bytes per element: param r/w 8, moments r/w 16, bf16 grad 2, bf16 copy 2
    lines = [
        f"### Fused Adam, {numel:,} fp32 parameters, bf16 gradients, bf16 copy written",
        "",
        "| variant | ms | vs torch | GB/s |",
        "|---|---|---|---|",
        row("torch AdamW(fused) + grad cast + copy_", baseline, baseline, 28 * numel),
    ]
    for name, kernel in kernels.items():
        buffers = fresh()
        lines.append(
            row(
                name,
                timed(lambda kernel=kernel, b=buffers: kernel(*b), device, repeats),
                baseline,
                28 * numel,
            )
        )
    return lines


# ---------------------------------------------------------------------------- model kernels
GradientsOf = Callable[
    [bool], tuple[torch.Tensor, ...]
]  # run(fused) -> the gradients of one forward + backward


def bench_model_kernels(rows: int, width: int, vocab: int, device: torch.device, repeats: int) -> list[str]:
    generator = torch.Generator().manual_seed(1)
    table = KernelTable(device, repeats)
    # Each case draws its inputs when it is built: built one after the other, as they are timed.
    table.compare("Triton LayerNorm", "F.layer_norm", layer_norm_case(rows, width, device, generator))
    table.compare("Triton bias + GeLU", "F.gelu(x + b, tanh)", bias_gelu_case(rows, width, device, generator))
    table.compare(
        "chunked LM head + cross-entropy",
        "LM head + F.cross_entropy (fp32 logits)",
        cross_entropy_case(rows, width, vocab, device, generator),
    )
    return [
        f"### Model kernels, bf16, {rows} tokens, hidden {width}, vocabulary {vocab} (forward + backward)",
        "",
        "| kernel | ms | vs torch | peak MiB |",
        "|---|---|---|---|",
        *table.lines,
    ]


class KernelTable:
    """Rows of the model kernels' table: each fused kernel checked against torch's, then both timed."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        self.lines: list[str] = []

    def compare(self, name: str, torch_name: str, run: GradientsOf) -> None:
        """`run(fused)` returns the gradients: checked against torch's, then both timed."""
        errors = [relative_error(a, b) for a, b in zip(run(True), run(False), strict=True)]
        check(name, max(errors), 2e-2)
        base = self.measure(torch_name, lambda: run(False))
        self.measure(f"tnlg {name}", lambda: run(True), base)

    def measure(self, name: str, run: Callable[[], object], baseline: float | None = None) -> float:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        seconds = timed(run, self.device, self.repeats)
        peak = f"{(torch.cuda.max_memory_allocated() - before) / 2**20:.0f}" if cuda else ""
        self.lines.append(
            f"| {name} | {seconds * 1e3:.3f} | {(baseline or seconds) / seconds:.2f}x | {peak} |"
        )
        return seconds


def _bf16(generator: torch.Generator, *shape: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(device, torch.bfloat16)


def layer_norm_case(rows: int, width: int, device: torch.device, generator: torch.Generator) -> GradientsOf:
    x = _bf16(generator, rows, width, device=device, scale=2).requires_grad_()
    weight = _bf16(generator, width, device=device).requires_grad_()
    bias = _bf16(generator, width, device=device).requires_grad_()
    upstream = _bf16(generator, rows, width, device=device)

    def layer_norm(fused: bool):
        y = fused_ops.layer_norm(x, weight, bias, 1e-5, "triton" if fused else "none")
        return torch.autograd.grad(y, (x, weight, bias), upstream)

    return layer_norm


def bias_gelu_case(rows: int, width: int, device: torch.device, generator: torch.Generator) -> GradientsOf:
    wide = _bf16(generator, rows, 4 * width, device=device, scale=2).requires_grad_()
    wide_bias = _bf16(generator, 4 * width, device=device).requires_grad_()
    wide_upstream = _bf16(generator, rows, 4 * width, device=device)

    def gelu(fused: bool):
        if fused:
            y = fused_ops.bias_gelu(wide, wide_bias, "triton")
        else:
            y = F.gelu(wide + wide_bias, approximate="tanh")
        return torch.autograd.grad(y, (wide, wide_bias), wide_upstream)

    return gelu


def cross_entropy_case(
    rows: int, width: int, vocab: int, device: torch.device, generator: torch.Generator
) -> GradientsOf:
    hidden = _bf16(generator, rows, width, device=device).requires_grad_()
    head = _bf16(generator, vocab, width, device=device, scale=0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator).to(device)

    def cross_entropy(fused: bool):
        if fused:
            loss = fused_ops.linear_cross_entropy(hidden, head, targets, choice="triton")
        else:
            loss = F.cross_entropy((hidden @ head.T).float(), targets)
        return torch.autograd.grad(loss, (hidden, head))

    return cross_entropy


# ---------------------------------------------------------------------------- training step
def bench_training(
    preset: str, micro_batch: int, seq_len: int, device: torch.device, steps: int
) -> list[str]:
    """The step with torch's kernels, then with the fused ones; each label names the Adam that ran."""
    lines = [
        f"### Training step: {preset}, bf16, micro-batch {micro_batch} x {seq_len} tokens, one GPU, ZeRO stage 0",
        "",
    ]
    lines += ["| kernels | step ms | tokens/s | MFU |", "|---|---|---|---|"]
    peak = peak_flops_per_device(device, "bf16")
    results = {}
    for label, fused in (
        ("torch (F.layer_norm, GeLU, full logits)", "none"),
        ("tnlg fused (Triton LN, bias+GeLU, chunked CE)", "auto"),
    ):
        config = TNLGConfig.from_preset(
            preset, fused_kernels=fused, max_position_embeddings=max(seq_len, 128)
        )
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TNLGForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        zero = ZeroConfig(stage=0, mixed_precision="bf16", fused_adam="auto" if fused == "auto" else "none")
        engine = initialize(model, optimizer, zero, device=device)
        # The engine resolves "auto" when it is built: the CUDA extension, else Triton; on the CPU torch's.
        adam = engine.optimizer.fused_backend
        shown = f"{label}; {f'fused Adam {adam}' if adam else 'torch AdamW'}"
        enable_activation_checkpointing(model)  # as a 1.3B run would use
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)

        def step(engine=engine, ids=ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        seconds = timed(step, device, steps, warmup=2)
        tokens = micro_batch * seq_len / seconds
        mfu = f"{100 * tokens * config.flops_per_token(seq_len) / peak:.1f}%" if peak else ""
        results[label] = seconds
        lines.append(f"| {shown} | {seconds * 1e3:.1f} | {tokens:,.0f} | {mfu} |")
        # The next configuration is measured alone on the device: `step` holds this engine too.
        engine.close()
        del engine, model, optimizer, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first, second = results.values()
    lines += ["", f"fused / torch step time: {second / first:.2f}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device (checks the script)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("gpu_bench needs a CUDA device (use --smoke to check the script elsewhere)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--smoke on CPU runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke)"
    print(f"# gpu_bench on {name}, torch {torch.__version__}\n")
    if args.smoke:
        sections = [
            bench_adam(10_000, device, repeats=2),
            bench_model_kernels(64, 64, 1000, device, repeats=2),
            bench_training("debug", 2, 32, device, steps=2),
        ]
    else:
        sections = [
            bench_adam(100_000_000, device, args.repeats),
            bench_model_kernels(8 * 2048, 2048, 50304, device, args.repeats),
            bench_training("tnlg-1.3b", 4, 2048, device, steps=10),
        ]
    for lines in sections:
        print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
