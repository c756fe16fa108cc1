"""Per-rank memory after a training step, counted from live tensors, against ZeRO's figures.

    python -m benchmarks.zero_memory

Ψ = trainable parameters; bf16 parameters and gradients, fp32 master weights, AdamW:
stage 1 = 4Ψ + 12Ψ/Nd, stage 2 = 2Ψ + 14Ψ/Nd, stage 3 = 16Ψ/Nd (Rajbhandari et al. 2020, fig. 1).
The census counts every tensor storage the process holds (see `live_tensor_bytes`), after the
step's outputs are dropped and before the next forward, minus what the process held before the
model was built.
"""

from __future__ import annotations

import torch

from benchmarks.common import batch, bench_model, live_tensor_bytes
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.memory import model_state_estimate
from tnlg.tools.spawn import run_distributed

FORMULAS = {
    1: lambda p, n: 4 * p + 12 * p / n,
    2: lambda p, n: 2 * p + 14 * p / n,
    3: lambda p, n: 16 * p / n,
}


def measure(rank: int, world_size: int, stage: int) -> dict:
    baseline = live_tensor_bytes()
    model = bench_model()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Stage 3 keeps small parameters whole on every rank: set the threshold to 0 so that the
    # measurement is of pure ZeRO-3 (the default keeps ~0.1% of this model whole).
    config = ZeroConfig(stage=stage, mixed_precision="bf16", param_persistence_threshold=0)
    engine = initialize(model, optimizer, config)
    del optimizer
    input_ids = batch(rank)
    for _ in range(2):
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        del loss
    held = live_tensor_bytes() - baseline - input_ids.untyped_storage().nbytes()
    return {"psi": psi, "held": held, "engine": engine.memory_stats()}


def main() -> None:
    rows = []
    for world_size in (2, 4):
        for stage in (1, 2, 3):
            result = run_distributed(measure, world_size, stage, timeout=600)[0]
            expected = FORMULAS[stage](result["psi"], world_size)
            rows.append(
                (stage, world_size, result["psi"], result["held"], expected, result["engine"]["total"])
            )
    print(
        "| stage | Nd | Ψ | measured bytes (live tensors) | ZeRO formula | measured / formula | "
        "engine's own count | tnlg.tools.memory estimate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for stage, world_size, psi, held, expected, engine_total in rows:
        estimate = model_state_estimate(psi, world_size=world_size, stage=stage, mixed_precision="bf16")
        print(
            f"| {stage} | {world_size} | {psi:,} | {held:,} | {expected:,.0f} | {held / expected:.4f} | "
            f"{engine_total:,} | {estimate.model_states:,} |"
        )


if __name__ == "__main__":
    main()
