"""The CPU Adam step that ZeRO-Offload runs, side by side in one process.

    python -m benchmarks.cpu_adam [--numel 50000000] [--threads N]

Every variant updates the same 50M fp32 parameters (AdamW, bf16 gradients as the offloaded engine
hands them over) and ends with the updated parameters also in a bf16 buffer, the copy that goes
back to the device:

- tnlg CPUAdam: one pass writes the moments, the parameters and their bf16 copy;
- torch.optim.AdamW(fused=True), then `copy_` into the bf16 buffer;
- torch.optim.AdamW(foreach=True), then `copy_` into the bf16 buffer.

Achieved bandwidth counts the bytes each element must move at least: read the fp32 parameter,
both moments and the bf16 gradient; write the parameter, both moments and the bf16 copy (28
bytes). It is compared with this machine's measured streaming bandwidth (the faster of a large fp32
`copy_` and `add`, counting bytes the same way), the ceiling for a memory-bound kernel.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import median_time
from tnlg.sharding.kernels import CPUAdam

BYTES_PER_ELEMENT = 4 + 4 + 4 + 2 + 4 + 4 + 4 + 2  # read p, m, v, g16; write p, m, v, p16


def copy_bandwidth(numel: int, repeats: int) -> float:
    """Bytes per second of the faster of two streaming kernels on fp32 tensors: `copy_` (read +
    write) and `torch.add(a, b, out=c)` (two reads, one write), as STREAM's copy and add."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    copy = 2 * 4 * numel / median_time(lambda: c.copy_(a), repeats)
    add = 3 * 4 * numel / median_time(lambda: torch.add(a, b, out=c), repeats)
    return max(copy, add)


def variants(numel: int):
    """name -> a step function, each with its own parameters, gradients and bf16 copy."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator)
    gradient = torch.randn(numel, generator=generator).to(torch.bfloat16)
    result = {}

    def ours():
        param = start.clone()
        out = torch.empty(numel, dtype=torch.bfloat16)
        optimizer = CPUAdam([param], lr=1e-4, weight_decay=0.1)
        return lambda: optimizer.step(out16=[out], grads=[gradient])  # bf16 gradients read as they are

    def torch_adamw(**flags):
        param = start.clone()
        param.grad = gradient.float()  # torch's Adam takes gradients in the parameter's dtype
        out = torch.empty(numel, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, **flags)

        def step():
            optimizer.step()
            out.copy_(param)

        return step

    result["tnlg CPUAdam (+ bf16 copy in the same pass)"] = ours()
    result["torch AdamW fused=True + copy_ to bf16"] = torch_adamw(fused=True)
    result["torch AdamW foreach=True + copy_ to bf16"] = torch_adamw(foreach=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not CPUAdam([torch.zeros(1)]).uses_extension:
        raise SystemExit("the CPUAdam C++ kernel could not be built here: nothing to compare")
    bandwidth = copy_bandwidth(args.numel, args.repeats)
    print(
        f"{args.numel:,} parameters, {args.threads} threads; streaming bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    print("| variant | step (ms) | vs tnlg | GB/s | of streaming bandwidth |")
    print("|---|---|---|---|---|")
    timings = {name: median_time(step, args.repeats) for name, step in variants(args.numel).items()}
    ours = next(iter(timings.values()))
    for name, seconds in timings.items():
        rate = BYTES_PER_ELEMENT * args.numel / seconds
        print(
            f"| {name} | {seconds * 1e3:.1f} | {seconds / ours:.2f}x | {rate / 1e9:.1f} | {rate / bandwidth:.0%} |"
        )


if __name__ == "__main__":
    main()
