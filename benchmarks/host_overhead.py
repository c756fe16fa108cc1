"""The host's share of a training step: what the engine adds to torch's own loop in Python and dispatch.

    python -m benchmarks.host_overhead [--rounds 12]

On a GPU the host only launches work. When launching one step's kernels takes longer than running them,
the device waits (profile_step's "waiting for the host"); compiling the blocks shortens the device's
work and so leaves the host's to set the pace. This measures the host's work alone: a model whose
device work is negligible (24 blocks of hidden 32, 8 tokens, one CPU thread), so each phase's time is
the Python, dispatcher and hook work a step pays at any size, per phase (forward, backward, optimizer
step), for:

- torch: the model in a plain loop (AdamW, gradients set to None): the floor;
- tnlg stage 0 and stage 3 at world size 1 (every hook runs; no collective has a peer to wait for);
- each of those eager and with each block compiled (inductor), as side_by_side's compiled variants.

The blocks' parameters make up nearly all of the model's, so the engine's per-parameter work (the
gradient hooks) shows at its real count: 24 blocks of 12 tensors, as tnlg-1.3b has. Variants are timed
in rounds (each runs a few steps per round, the order rotating), the median of each phase reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import rotated
from benchmarks.side_by_side import one_rank_group
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.compile import CompileConfig

MODEL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 24,  # tnlg-1.3b's block count: its 292 parameters, two gradient hooks each
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TOKENS = (1, 8)
WARMUP_STEPS, STEPS_PER_ROUND = 5, 10
PHASES = ("forward", "backward", "step")


@dataclass
class Variant:
    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]


def torch_variant(ids: torch.Tensor, compiled: bool) -> Variant:
    model = _model()
    if compiled:
        for block in model.model.layers:  # as the engine does: each block's forward, hooks outside
            block.forward = torch.compile(block.forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Variant(lambda: model(input_ids=ids, labels=ids).loss, torch.Tensor.backward, step)


def tnlg_variant(ids: torch.Tensor, compiled: bool, stage: int) -> Variant:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = initialize(
        model, optimizer, ZeroConfig(stage=stage), device="cpu",
        compile_config=CompileConfig() if compiled else None,
    )  # fmt: skip
    return Variant(lambda: engine(input_ids=ids, labels=ids).loss, engine.backward, engine.step)


def _model() -> TNLGForCausalLM:
    torch.manual_seed(0)
    return TNLGForCausalLM(TNLGConfig(**MODEL)).train()


def variants(ids: torch.Tensor) -> dict[str, Variant]:
    built = {}
    for compiled in (False, True):
        suffix = " compiled" if compiled else ""
        built["torch" + suffix] = torch_variant(ids, compiled)
        for stage in (0, 3):
            built[f"tnlg stage {stage}{suffix}"] = tnlg_variant(ids, compiled, stage)
    return built


def run_steps(variant: Variant, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(steps):
        began = time.perf_counter()
        loss = variant.forward()
        forward_done = time.perf_counter()
        variant.backward(loss)
        backward_done = time.perf_counter()
        variant.step()
        step_done = time.perf_counter()
        times["forward"].append(forward_done - began)
        times["backward"].append(backward_done - forward_done)
        times["step"].append(step_done - backward_done)
    return times


def measure(built: dict[str, Variant], rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds of each variant's phases over `rounds` rounds (see the module docstring)."""
    names = list(built)
    for name in names:
        run_steps(built[name], WARMUP_STEPS)  # compiles the compiled variants' graphs
    samples = {name: {phase: [] for phase in PHASES} for name in names}
    for round_ in range(rounds):
        for name in rotated(names, round_):
            for phase, seconds in run_steps(built[name], STEPS_PER_ROUND).items():
                samples[name][phase].extend(seconds)
    return {
        name: {phase: statistics.median(seconds) for phase, seconds in phases.items()}
        for name, phases in samples.items()
    }


def table_lines(medians: dict[str, dict[str, float]]) -> list[str]:
    lines = [
        "| variant | forward ms | backward ms | step ms | total ms | backward over torch's |",
        "|---|---|---|---|---|---|",
    ]
    for name, phases in medians.items():
        total = sum(phases.values())
        floor = medians["torch compiled" if "compiled" in name else "torch"]["backward"]
        lines.append(
            f"| {name} | {phases['forward'] * 1e3:.2f} | {phases['backward'] * 1e3:.2f} | "
            f"{phases['step'] * 1e3:.2f} | {total * 1e3:.2f} | {(phases['backward'] - floor) * 1e3:+.2f} ms |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    torch.set_num_threads(1)
    ids = torch.randint(0, MODEL["vocab_size"], TOKENS, generator=torch.Generator().manual_seed(0))
    print(
        f"# host_overhead: torch {torch.__version__}, CPU, 1 thread, {MODEL['num_hidden_layers']} blocks of "
        f"hidden {MODEL['hidden_size']}, {TOKENS[0]} x {TOKENS[1]} tokens, fp32, median of "
        f"{args.rounds} rounds x {STEPS_PER_ROUND} steps",
        flush=True,
    )
    with one_rank_group(torch.device("cpu")):
        medians = measure(variants(ids), args.rounds)
    print("\n".join(["", *table_lines(medians), ""]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
