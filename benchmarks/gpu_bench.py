"""GPU kernels and a bf16 training step: each fused kernel checked against its reference, then timed
against torch's own, side by side in one run; then tokens/s and MFU of a `tnlg-1.3b` step with and
without the fused model kernels (the same weights, batch and Adam in both, the fused step's first loss
gated against the torch step's).

    python -m benchmarks.gpu_bench                 # on a CUDA machine; prints markdown tables
    python -m benchmarks.gpu_bench --smoke         # tiny sizes on any device (CPU: TRITON_INTERPRET=1)

Times are medians of `--repeats` runs after warm-up, measured with CUDA events (wall clock on CPU).
A kernel whose output differs from its reference beyond the tolerance stops the run, and so does a fused
training step whose first loss differs from the torch step's: a fast wrong kernel is not a result.
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
from tnlg.sharding import ZeroConfig, ZeroEngine, initialize
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
# The fused row's first-step loss against the torch row's, relative. Both compute the same model in
# bf16 from the same weights on the same batch and differ in the kernels alone (LayerNorm, bias + GeLU,
# the chunked LM head + cross-entropy in fp32 against full fp32 logits): 2e-2 is the project's bf16
# loss tolerance (side_by_side's LOSS_TOLERANCE, gpu_first_contact, the CPU equivalence tests).
LOSS_TOLERANCE = 2e-2
TRAINING_ROWS = (
    ("torch (F.layer_norm, GeLU, full logits)", "none"),
    ("tnlg fused (Triton LN, bias+GeLU, chunked CE)", "auto"),
)


def own_prediction_labels(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Labels for `ids` that make a loss tell one model from another: the model's own predictions.

    At initialization every model's loss on random labels is about ln(vocab), whatever it computes;
    on the labels one model predicts, only a model computing the same logits at these positions
    scores the same loss. Each label is the argmax of the position's logits less their mean over the
    batch (a part common to every position, the final LayerNorm's bias through the tied head, would
    make one token win everywhere), the input token itself excluded (through the tied embedding it
    often wins); position t predicts token t + 1, so the first label is ignored (-100).
    """
    logits = logits.float()  # (B, T, V)
    scores = logits[:, :-1] - logits[:, :-1].mean(dim=(0, 1))
    scores.scatter_(-1, ids[:, :-1, None], float("-inf"))
    labels = torch.full_like(ids, -100)
    labels[:, 1:] = scores.argmax(-1)
    return labels


def training_engine(config: TNLGConfig, device: torch.device) -> ZeroEngine:
    """The step's engine: ZeRO stage 0, bf16, AdamW through the engine's fused Adam ("auto": the CUDA
    extension, else Triton; on the CPU torch's AdamW step) in every row, so that rows differ in the
    model's kernels alone. Weights come from the engine's seeded initialization (see [Note: seeded
    initialization] in sharding/init.py): the same in every row of one architecture."""
    with torch.device("meta"):
        model = TNLGForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    engine = initialize(
        model, optimizer, ZeroConfig(stage=0, mixed_precision="bf16", fused_adam="auto"), device=device
    )
    enable_activation_checkpointing(model)  # as a 1.3B run would use
    return engine


def bench_training(
    preset: str,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    steps: int,
    initializer_range: float | None = None,
) -> list[str]:
    """The step with torch's kernels, then with the fused ones: the same weights, batch and Adam.

    The batch's labels are the torch row's own predictions before its first step (see
    `own_prediction_labels`); the fused row's first-step loss must match the torch row's within
    `LOSS_TOLERANCE` before it is timed, else the run stops: a fast wrong step is not a result.
    `initializer_range` replaces the preset's (None: keep it).
    """
    init = {} if initializer_range is None else {"initializer_range": initializer_range}
    configs = {
        label: TNLGConfig.from_preset(
            preset, fused_kernels=fused, max_position_embeddings=max(seq_len, 128), **init
        )
        for label, fused in TRAINING_ROWS
    }
    vocab = next(iter(configs.values())).vocab_size
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=torch.Generator().manual_seed(1))
    ids, labels = ids.to(device), None
    results: dict[str, tuple[float, float]] = {}  # label -> (seconds, first-step loss)
    adams: set[str | None] = set()
    for label, config in configs.items():
        engine = training_engine(config, device)
        adams.add(engine.optimizer.fused_backend)  # the engine resolves "auto" when it is built
        if labels is None:  # the first row, torch's kernels, is the reference
            with torch.no_grad():
                labels = own_prediction_labels(engine(input_ids=ids).logits, ids)

        def step(engine=engine, labels=labels):
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            return loss

        first_loss = step().item()  # the gate's step, on the initial weights; also a warm-up step
        if results:
            check_loss(label, first_loss, reference=next(iter(results.values()))[1])
        results[label] = (timed(step, device, steps, warmup=1), first_loss)
        # The next configuration is measured alone on the device: `step` holds this engine too.
        engine.close()
        del engine, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(adams) != 1:  # one setting resolves alike in both rows; were it not, the ratio would mix Adams
        sys.exit(f"training step: the rows ran different Adam kernels {sorted(map(str, adams))}; no timing")
    flops = next(iter(configs.values())).flops_per_token(seq_len)
    return training_lines(preset, (micro_batch, seq_len), device, flops, results, adams.pop())


def check_loss(label: str, loss: float, reference: float) -> None:
    difference = abs(loss - reference) / abs(reference)
    if not difference <= LOSS_TOLERANCE:
        sys.exit(
            f"training step, {label}: first-step loss {loss:.4f} against the torch row's {reference:.4f}, "
            f"relative difference {difference:.1e} exceeds {LOSS_TOLERANCE:.0e}; no timing for a wrong step"
        )


def training_lines(
    preset: str, shape: tuple[int, int], device: torch.device, flops_per_token: int,
    results: dict[str, tuple[float, float]], adam: str | None,
) -> list[str]:  # fmt: skip
    micro_batch, seq_len = shape
    peak = peak_flops_per_device(device, "bf16")
    adam_name = f"the engine's fused Adam, {adam}" if adam else "torch's AdamW"
    lines = [
        f"### Training step: {preset}, bf16, micro-batch {micro_batch} x {seq_len} tokens, one GPU, ZeRO stage 0",
        "",
        f"Both rows: the same initial weights, batch and optimizer ({adam_name}); only the model's kernels "
        "differ. The batch's labels are the torch row's own predictions, so that the first-step losses "
        "compare the two computations.",
        "",
        "| kernels | first-step loss | step ms | tokens/s | MFU |",
        "|---|---|---|---|---|",
    ]
    for label, (seconds, loss) in results.items():
        tokens = micro_batch * seq_len / seconds
        mfu = f"{100 * tokens * flops_per_token / peak:.1f}%" if peak else ""
        lines.append(f"| {label} | {loss:.4f} | {seconds * 1e3:.1f} | {tokens:,.0f} | {mfu} |")
    (torch_seconds, torch_loss), (fused_seconds, fused_loss) = results.values()
    difference = abs(fused_loss - torch_loss) / abs(torch_loss)
    lines += [
        "",
        f"gate passed: the fused row's first-step loss is within {difference:.1e} of the torch row's "
        f"(tolerance {LOSS_TOLERANCE:.0e} relative)",
        f"fused / torch step time: {fused_seconds / torch_seconds:.2f} (the model's kernels alone)",
    ]
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
            # Logits as spread as tnlg-1.3b's at its init (0.02 x sqrt(2048) = 0.9): 1 / sqrt(64), as in
            # side_by_side's smoke. At 0.02 the debug model's logits are nearly flat and its first-step
            # losses would tell no computation from another.
            bench_training("debug", 2, 32, device, steps=2, initializer_range=0.125),
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
