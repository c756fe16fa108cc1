"""Compiled blocks beside eager, ZeRO stages 1-3, 2 processes on CPU, in one run.

    python -m benchmarks.compile_speed

For each model (the benchmark model, hidden 256, and a wider one, hidden 1024) and each stage, an eager
engine and an engine whose blocks are compiled (inductor; see [Note: compiled blocks] in
sharding/compile.py) are built from the same seeded weights in the same two processes. Their first steps
run on the same batch and must agree (fp32, 1e-5 relative) before any time is reported: a compiled model
computing something else is no comparison. Then both are timed in interleaved rounds (every round runs
each once, the order rotating) and the median step is reported.

Compile time is shown apart, from the engine's own count of torch's compilations: inductor's cache
starts empty in a fresh directory, so each model's first stage pays a cold compile; the later stages
compile the same graphs again and find them in that cache (what a resumed run pays).
"""

from __future__ import annotations

import tempfile

import torch
import torch._dynamo
import torch.distributed as dist

from benchmarks.common import batch, bench_model, interleaved_medians
from tnlg.sharding import CompileConfig, ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

WARMUP, REPEATS = 2, 8
MICRO_BATCH, SEQ_LEN = 4, 128
MODELS = {
    "benchmark model (hidden 256)": {},
    "wider (hidden 1024)": {"hidden_size": 1024, "num_attention_heads": 16},
}
GATE = 1e-5


def _engine(overrides: dict, stage: int, compile_config: CompileConfig | None):
    model = bench_model(**overrides)
    return initialize(
        model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage), compile_config=compile_config
    )


def _stage_row(overrides: dict, stage: int, compile_config: CompileConfig, input_ids: torch.Tensor) -> dict:
    """One model at one stage: the gate's first-step losses, compile seconds, median step times."""
    torch._dynamo.reset()  # nothing compiled carries over from the last row: each row compiles its own
    engines = {
        "eager": _engine(overrides, stage, None),
        "compiled": _engine(overrides, stage, compile_config),
    }

    def step(engine) -> torch.Tensor:
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    first = {name: step(engine).item() for name, engine in engines.items()}  # the compiled one compiles here
    dist.barrier()
    row = {"first_loss": first, "compile": engines["compiled"].compile_stats()}
    if abs(first["compiled"] - first["eager"]) > GATE * abs(first["eager"]):
        row["times"] = None
    else:
        steps = {name: (lambda engine=engine: step(engine)) for name, engine in engines.items()}
        row["times"] = interleaved_medians(steps, REPEATS, WARMUP)
    dist.barrier()
    for engine in engines.values():
        engine.close()
    return row


def _all_rows(rank: int, world_size: int, cache_dir: str) -> dict:
    compile_config = CompileConfig(backend="inductor", cache_dir=cache_dir)
    input_ids = batch(rank, MICRO_BATCH, SEQ_LEN)
    rows = {}
    for model_name, overrides in MODELS.items():
        for stage in (1, 2, 3):
            rows[(model_name, stage)] = _stage_row(overrides, stage, compile_config, input_ids)
    return rows


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tnlg-inductor-") as cache_dir:
        per_rank = run_distributed(_all_rows, 2, cache_dir, timeout=3600)
    tokens = MICRO_BATCH * SEQ_LEN * 2  # both ranks' tokens each step
    print(f"torch {torch.__version__}, CPU, 2 processes (gloo), fp32, micro-batch {MICRO_BATCH} x {SEQ_LEN}")
    print()
    print(
        "| model | stage | eager ms | compiled ms | compiled / eager tokens/s | compile s | first-step loss (compiled vs eager) |"
    )
    print("|---|---|---|---|---|---|---|")
    failed = False
    for key, row in per_rank[0].items():
        model_name, stage = key
        # The slower rank sets the pace; compile time is rank 0's (both compile the same graphs).
        first = row["first_loss"]
        compile_s = row["compile"]["compile_seconds"]
        if any(r[key]["times"] is None for r in per_rank):
            failed = True
            print(
                f"| {model_name} | {stage} | - | - | MISMATCH | {compile_s:.1f} | "
                f"eager {first['eager']:.6f}, compiled {first['compiled']:.6f} |"
            )
            continue
        eager = max(r[key]["times"]["eager"] for r in per_rank)
        compiled = max(r[key]["times"]["compiled"] for r in per_rank)
        print(
            f"| {model_name} | {stage} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | {eager / compiled:.2f}x | "
            f"{compile_s:.1f} | {first['eager']:.6f}, rel {abs(first['compiled'] - first['eager']) / abs(first['eager']):.1e} |"
        )
    print()
    print(f"tokens per step: {tokens}; compile s: torch's compilations in the compiled engine's first steps")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
