"""Compiled blocks beside eager, ZeRO stages 1-3, 2 processes on CPU, in one run.

    python -m benchmarks.compile_speed

For each model (the benchmark model, hidden 256, and a wider one, hidden 1024) and each stage, an eager
engine and an engine whose blocks are compiled (inductor; see [Note: compiled blocks] in
sharding/compile.py) are built from the same seeded weights in the same two processes. Their first two
steps (the second after an optimizer step) run on the same batch and must agree, fp32 within 1e-5
relative on every rank, before any time is reported: a compiled model computing something else is no
comparison. Then both are timed in interleaved rounds (every round runs each once, the order rotating)
and the median step is reported.

Compile time is shown apart, from the engine's own count of torch's compilations: inductor's cache
starts empty in a fresh directory, so each model's first stage pays a cold compile; the later stages
compile the same graphs again after a Dynamo reset and find them in that cache, with the process's
in-memory caches warm. What a resumed run pays is measured apart: a new pair of processes reading the
cache the first run filled.
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
GATE, GATE_STEPS = 1e-5, 2


def _engine(overrides: dict, stage: int, compile_config: CompileConfig | None):
    model = bench_model(**overrides)
    return initialize(
        model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage), compile_config=compile_config
    )


def _step(engine, input_ids: torch.Tensor) -> torch.Tensor:
    loss = engine(input_ids=input_ids, labels=input_ids).loss
    engine.backward(loss)
    engine.step()
    return loss.detach()


def _stage_row(overrides: dict, stage: int, compile_config: CompileConfig, input_ids: torch.Tensor) -> dict:
    """One model at one stage: the gate's losses, compile seconds, median step times."""
    torch._dynamo.reset()  # nothing compiled carries over from the last row: each row compiles its own
    engines = {
        "eager": _engine(overrides, stage, None),
        "compiled": _engine(overrides, stage, compile_config),
    }
    # The gate: two steps each (the second after an optimizer step), the compiled engine compiling in them.
    losses = {
        name: [_step(engine, input_ids).item() for _ in range(GATE_STEPS)] for name, engine in engines.items()
    }
    differs = any(
        abs(c - e) > GATE * abs(e) for e, c in zip(losses["eager"], losses["compiled"], strict=True)
    )
    # Every rank takes the same decision: a rank timing while another skips would wait on it forever.
    verdict = torch.tensor(float(differs))
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    row = {
        "losses": losses,
        "compile": engines["compiled"].compile_stats(),
        "times": None,
        "late_compiles": 0,
    }
    if verdict.item() == 0.0:
        steps = {name: (lambda engine=engine: _step(engine, input_ids)) for name, engine in engines.items()}
        row["times"] = interleaved_medians(steps, REPEATS, WARMUP)
        # Compilations after the gate's steps landed in the timings: shown, not hidden.
        row["late_compiles"] = engines["compiled"].compile_stats()["compiles"] - row["compile"]["compiles"]
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


def _cached_compiles(rank: int, world_size: int, cache_dir: str) -> dict[str, float]:
    """What a resumed run pays: a new process, the cache the first run filled; each model's compiled
    engine (stage 1) through its first step, and the seconds torch spent compiling."""
    compile_config = CompileConfig(backend="inductor", cache_dir=cache_dir)
    input_ids = batch(rank, MICRO_BATCH, SEQ_LEN)
    seconds = {}
    for model_name, overrides in MODELS.items():
        torch._dynamo.reset()
        engine = _engine(overrides, 1, compile_config)
        _step(engine, input_ids)
        seconds[model_name] = engine.compile_stats()["compile_seconds"]
        engine.close()
    return seconds


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tnlg-inductor-") as cache_dir:
        per_rank = run_distributed(_all_rows, 2, cache_dir, timeout=3600)
        cached = run_distributed(_cached_compiles, 2, cache_dir, timeout=900)[0]
    tokens = MICRO_BATCH * SEQ_LEN * 2  # both ranks' tokens each step
    print(f"torch {torch.__version__}, CPU, 2 processes (gloo), fp32, micro-batch {MICRO_BATCH} x {SEQ_LEN}")
    print()
    print(
        "| model | stage | eager ms | compiled ms | compiled / eager tokens/s | compile s | gate losses (2 steps) |"
    )
    print("|---|---|---|---|---|---|---|")
    failed = False
    for key, row in per_rank[0].items():
        model_name, stage = key
        # The slower rank sets the pace; compile time is rank 0's (both compile the same graphs).
        losses = row["losses"]
        gate = ", ".join(
            f"{e:.6f} (rel {abs(c - e) / abs(e):.0e})"
            for e, c in zip(losses["eager"], losses["compiled"], strict=True)
        )
        compile_s = row["compile"]["compile_seconds"]
        if row["times"] is None:
            failed = True
            print(
                f"| {model_name} | {stage} | - | - | MISMATCH | {compile_s:.1f} | {gate}; compiled {losses['compiled']} |"
            )
            continue
        eager = max(r[key]["times"]["eager"] for r in per_rank)
        compiled = max(r[key]["times"]["compiled"] for r in per_rank)
        late = max(r[key]["late_compiles"] for r in per_rank)
        note = f" ({late} compiles while timed)" if late else ""
        print(
            f"| {model_name} | {stage} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | {eager / compiled:.2f}x{note} | "
            f"{compile_s:.1f} | {gate} |"
        )
    print()
    print(
        f"tokens per step: {tokens}. compile s: torch's compilations in the compiled engine's gate steps; each"
    )
    print("model's stage 1 compiles cold, stages 2 and 3 in the same process after a Dynamo reset.")
    print()
    print("| model | compile s, a new process reading the cache (a resumed run) |")
    print("|---|---|")
    for model_name, seconds in cached.items():
        print(f"| {model_name} | {seconds:.1f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
