"""The largest debug-family model that trains within a per-rank device-memory budget, with and without
CPU offload.

    python -m benchmarks.offload_capacity [--budget-mb 40] [--world-size 2]

The family is the `debug` preset (4 heads, vocabulary 512) at 4 layers and growing width. Each
candidate trains two bf16 AdamW steps on `--world-size` gloo processes. Its device memory is the
peak, over the steps, of every live tensor storage in the process (the `live_tensor_bytes` census)
minus the storages the engine placed in host memory (`engine.host_tensors()`), sampled after every
block's forward, at every parameter's gradient (where stage 3 holds a gathered block and its
gradients), after backward and after the step. Activations that only autograd holds are invisible
to the census: they are the same with and without offload and are left out of the budget. On a
CPU-only machine the "device" is the CPU as well; the split is the one a GPU run would have.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import live_tensor_bytes
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

WIDTHS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
SETTINGS = {
    "stage 2": {"stage": 2},
    "stage 2 + offload_optimizer": {"stage": 2, "offload_optimizer": "cpu"},
    "stage 3": {"stage": 3},
    "stage 3 + offload_optimizer + offload_param": {
        "stage": 3,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
    },
}


def family_config(width: int) -> TNLGConfig:
    return TNLGConfig.from_preset(
        "debug",
        hidden_size=width,
        num_hidden_layers=4,
        intermediate_size=4 * width,
        max_position_embeddings=64,
    )


def measure(rank: int, world_size: int, width: int, zero: dict) -> dict:
    torch.manual_seed(0)
    baseline = live_tensor_bytes()
    model = TNLGForCausalLM(family_config(width))
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = initialize(
        model, optimizer, ZeroConfig(mixed_precision="bf16", param_persistence_threshold=0, **zero)
    )
    del optimizer
    peak = 0

    def sample(*_args) -> None:
        nonlocal peak
        host = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in engine.host_tensors()}
        peak = max(peak, live_tensor_bytes() - baseline - sum(host.values()))

    hooks = [block.register_forward_hook(sample) for block in model.model.layers]
    hooks += [p.register_post_accumulate_grad_hook(sample) for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        sample()
        engine.step()
        losses.append(loss.item())
        del loss
        sample()
    for hook in hooks:
        hook.remove()
    stats = engine.memory_stats()
    return {"psi": psi, "device_peak": peak, "host": stats["host"], "losses": losses}


def largest_within(budget: int, world_size: int, zero: dict) -> tuple[dict | None, dict]:
    """(the largest width's result within the budget, the first one over it)."""
    fits = None
    for width in WIDTHS:
        result = run_distributed(measure, world_size, width, zero, timeout=1200)[0]
        result["width"] = width
        if not all(math.isfinite(loss) for loss in result["losses"]):
            raise RuntimeError(f"width {width} with {zero}: losses {result['losses']}")
        if result["device_peak"] > budget:
            return fits, result
        fits = result
    return fits, {}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-mb", type=float, default=40.0, help="per-rank device memory budget, MiB")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    budget = int(args.budget_mb * 2**20)
    print(f"budget {args.budget_mb:g} MiB of device memory per rank, {args.world_size} ranks, bf16, AdamW\n")
    print(
        "| setting | largest width | parameters | device peak (MiB) | host (MiB) | next width: device peak (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    widest = {}
    for name, zero in SETTINGS.items():
        fits, over = largest_within(budget, args.world_size, zero)
        mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
        next_cell = f"{over['width']}: {mib(over['device_peak'])}" if over else "(all fit)"
        if fits is None:
            print(f"| {name} | none | | | | {next_cell} |")
            continue
        widest[name] = fits["psi"]
        print(
            f"| {name} | {fits['width']} | {fits['psi'] / 1e6:.2f}M | {mib(fits['device_peak'])} | "
            f"{mib(fits['host'])} | {next_cell} |"
        )
    for base, offloaded in (
        ("stage 2", "stage 2 + offload_optimizer"),
        ("stage 3", "stage 3 + offload_optimizer + offload_param"),
    ):
        if base in widest and offloaded in widest:
            print(f"\n{offloaded}: {widest[offloaded] / widest[base]:.2f}x the parameters of {base}")


if __name__ == "__main__":
    main()
