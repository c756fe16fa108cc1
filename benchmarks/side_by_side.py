"""tnlg against its peers, side by side on one device: the same initial weights, the same batches, one run.

    python -m benchmarks.side_by_side              # tnlg-1.3b shape on one CUDA device; markdown tables
    python -m benchmarks.side_by_side --smoke      # the debug preset on any device (CPU: TRITON_INTERPRET=1)
    python -m benchmarks.side_by_side --compile on # also tnlg stage 0 and 3 with torch.compile'd blocks
        [--compile-mode max-autotune-no-cudagraphs]   # inductor's mode for them (default: torch's default;
                                                      # a CUDA-graph mode leaves stage 3 out, which refuses it)

Variants of one bf16 training step (micro-batch x sequence, activation checkpointing as a setting), at world
size 1, each loaded from one seeded state dict and fed one seeded list of batches:

    tnlg stage 0 / tnlg stage 3   tnlg.sharding.initialize(model, AdamW, ZeroConfig(stage, bf16)): bf16
                                  gradients, reduce-scattered and kept in bf16 (fp32 master and Adam)
    torch FSDP2                   fully_shard on every TNLGBlock, then the root; bf16 params, and
                                  reduce_dtype=fp32 (FSDP2's usual recipe): gradients cast to fp32,
                                  reduce-scattered and kept in fp32
    Transformers GPT-2            GPT2LMHeadModel of the same shape, converted weights, autocast bf16
    tnlg stage 0/3 compiled       with --compile on: as tnlg stage 0/3, each block's forward compiled by
                                  inductor (CompileConfig); the warmup steps absorb the compilation, whose
                                  seconds are reported apart from the step times

The printed "tnlg stage 3 / torch FSDP2 step time" therefore mixes gradient precisions: FSDP2's step
includes the casts to fp32 and moves fp32 gradients where tnlg stage 3 moves bf16 ones, so the ratio
is not the two engines' scheduling alone (FSDP2 with reduce_dtype=bf16 would be like for like).

Before any time is reported, every variant's first-step loss must match the fp32 reference's (see
`LOSS_TOLERANCE`); a variant that does not is a MISMATCH row, no time is reported and the run exits 1.
Timing runs in ABBA order (A B C D ..., then reversed), so that a drift in clocks or temperature lands on
every variant alike; each slot builds its variant afresh from the seeded state (see `run_slot`). Also
measured in the same run: an 8192^3 bf16 matmul (the achievable FLOP/s, MFU's second denominator) and,
after the training table, tnlg's fused kernels against torch's equivalents at the model's shape.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import GPT2LMHeadModel

from benchmarks.gpu_bench import (
    LOSS_TOLERANCE,
    bias_gelu_case,
    cross_entropy_case,
    layer_norm_case,
    own_prediction_labels,
    relative_error,
    timed,
)
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.configuration_tnlg import FUSED_CHOICES
from tnlg.run.activations import enable_activation_checkpointing
from tnlg.run.metrics import peak_flops_per_device
from tnlg.sharding import CompileConfig, ZeroConfig, initialize
from tnlg.sharding.compile import COMPILE_MODES, check_compile_fits
from tnlg.sharding.kernels.fused_adam import fused_adam
from tnlg.tools.convert.to_gpt2 import gpt2_config, tnlg_state_to_gpt2

# First-step loss against the fp32 reference, relative. The variants compute in bf16 (8 significant
# bits) through different kernels (Triton LayerNorm and a bf16 residual stream in tnlg; fp32 LayerNorm
# and residual under GPT-2's autocast): 1e-4 apart on CPU (smoke), expected within a few 1e-3 at 1.3b
# on a GPU (not yet measured); 2e-2 is the project's bf16 loss tolerance, gpu_bench's LOSS_TOLERANCE
# (imported above; also gpu_first_contact's and the CPU equivalence tests'). What it catches, since
# the gate batch's labels are the reference's own predictions (`gate_labels`), measured in fp32 on CPU:
# at the 1.3b width (2 layers), labels one position late +15%, another batch +14%, one square weight
# transposed +3%; on the smoke's model +52%, +45%, +7%.
# The converted GPT-2 against tnlg in fp32, max |difference| over max |logit|: two orders of summation
# (Conv1D's addmm against F.linear) differ by ~1e-6; a misplaced weight by ~1e-1.
CONVERSION_TOLERANCE = 1e-3
KERNEL_TOLERANCE = 2e-2  # bf16 gradients against torch's (benchmarks/gpu_bench.py's tolerance)
ADAM_TOLERANCE = 1e-3  # one fp32 update against torch's, relative to the update (not the weight)
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SEED = 0
MISMATCH = "MISMATCH"


@dataclass(frozen=True)
class Settings:
    device: torch.device
    smoke: bool
    micro_batch: int
    activation_checkpointing: bool
    preset: str = "tnlg-1.3b"
    seq_len: int = 2048
    warmup_steps: int = 2  # per ABBA slot, untimed; the first is the gate's step
    timed_steps: int = 3  # per ABBA slot: each variant has two slots
    matmul_size: int = 8192
    repeats: int = 20  # kernel and matmul timings
    warmup: int = 3
    adam_numel: int | None = None  # None: the model's parameter count
    init_std: float | None = None  # None: the preset's initializer_range
    fused_kernels: str = "auto"  # TNLGConfig.fused_kernels of the tnlg variants
    compiled: bool = False  # also the tnlg variants with compiled blocks (`compiled_variants`)
    compile_mode: str | None = None  # CompileConfig.mode of the compiled variants (None: torch's default)

    @classmethod
    def create(
        cls, smoke: bool, device: torch.device, micro_batch: int | None, checkpointing: bool,
        fused_kernels: str = "auto", compiled: bool = False, compile_mode: str | None = None,
    ) -> Settings:  # fmt: skip
        if not smoke:
            return cls(
                device, smoke, micro_batch or 4, checkpointing, fused_kernels=fused_kernels, compiled=compiled,
                compile_mode=compile_mode,
            )  # fmt: skip
        # The interpreter runs the Triton kernels on CPU: tiny sizes, one repeat.
        return cls(
            device, smoke, micro_batch or 2, checkpointing, preset="debug", seq_len=32, warmup_steps=1,
            timed_steps=1, matmul_size=256, repeats=1, warmup=1, adam_numel=10_000,
            # Logits as spread as tnlg-1.3b's at its init (0.02 x sqrt(2048) = 0.9): 1 / sqrt(64). At
            # 0.02 the debug model's logits are nearly flat and no loss tells one model from another.
            init_std=0.125, fused_kernels=fused_kernels, compiled=compiled, compile_mode=compile_mode,
        )  # fmt: skip

    def config(self, fused_kernels: str | None = None) -> TNLGConfig:
        init = {} if self.init_std is None else {"initializer_range": self.init_std}
        return TNLGConfig.from_preset(
            self.preset, max_position_embeddings=self.seq_len,
            fused_kernels=fused_kernels or self.fused_kernels, **init,
        )  # fmt: skip

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ---------------------------------------------------------------------------- models from one state
def seeded_state(config: TNLGConfig, device: torch.device, seed: int = SEED) -> dict[str, torch.Tensor]:
    """The initial weights every variant loads: fp32, on the host (pinned when `device` is CUDA)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = TNLGForCausalLM(config)
    with torch.no_grad():  # LayerNorms and biases off their 1/0 init, so that a mix-up would show
        for name, parameter in model.named_parameters():
            if "layernorm" in name or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    # Copies: a variant's training must never write into the state the next variant loads.
    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    return {name: t.pin_memory() for name, t in state.items()} if device.type == "cuda" else state


def tnlg_model(
    config: TNLGConfig, state: Mapping[str, torch.Tensor], device: torch.device, checkpointing: bool
) -> TNLGForCausalLM:
    with torch.device(device):
        model = TNLGForCausalLM(config)
    model.load_state_dict(state)  # copies into the (tied) parameters
    model.set_attn_implementation("sdpa")
    if checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def gpt2_model(
    config: TNLGConfig, state: Mapping[str, torch.Tensor], device: torch.device, checkpointing: bool
) -> GPT2LMHeadModel:
    peer_config = gpt2_config(config)
    peer_config.use_cache = False  # training: no KV cache kept
    with torch.device(device):
        model = GPT2LMHeadModel._from_config(peer_config, attn_implementation="sdpa")
    loaded = model.load_state_dict(tnlg_state_to_gpt2(state), strict=False)
    parameters = dict(model.named_parameters())
    missing = [name for name in loaded.missing_keys if name in parameters]  # buffers are no weights
    if missing or loaded.unexpected_keys:
        raise ValueError(f"GPT-2 load: missing {missing}, unexpected {loaded.unexpected_keys}")
    if checkpointing:  # as tnlg's: Transformers' own, non-reentrant, by whatever name the release uses
        enable_activation_checkpointing(model)
    return model.train()


# ---------------------------------------------------------------------------- the workload and its gate
@dataclass
class Workload:
    settings: Settings
    config: TNLGConfig
    state: dict[str, torch.Tensor]
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # (input ids, labels) on the device; [0] is the gate's
    reference_loss: float
    conversion_error: float


def make_workload(settings: Settings) -> Workload:
    config = settings.config()
    state = seeded_state(config, settings.device)
    generator = torch.Generator().manual_seed(SEED + 1)
    shape = (settings.micro_batch, settings.seq_len)
    ids = [
        torch.randint(0, config.vocab_size, shape, generator=generator).to(settings.device)
        for _ in range(settings.warmup_steps + settings.timed_steps)
    ]
    labels, loss, conversion = gate_labels(settings, state, ids[0])
    batches = [(ids[0], labels)] + [(i, i) for i in ids[1:]]
    return Workload(settings, config, state, batches, loss, conversion)


@torch.no_grad()
def gate_labels(
    settings: Settings, state: Mapping[str, torch.Tensor], ids: torch.Tensor
) -> tuple[torch.Tensor, float, float]:
    """The gate batch's labels, its fp32 reference loss, and the converted GPT-2's fp32 logit error.

    At initialization every model's loss on random labels is about ln(vocab), whatever it computes.
    The labels are therefore the fp32 reference's own predictions (`own_prediction_labels`, shared
    with gpu_bench's training-step gate), so that only a variant computing this model on these
    positions of this batch scores the reference's loss; any other scores that of random labels.
    """
    config = settings.config(fused_kernels="none")  # torch's kernels, no autocast: the reference
    model = tnlg_model(config, state, settings.device, checkpointing=False).eval()
    logits = model(input_ids=ids, use_cache=False).logits.float()  # (B, T, V)
    del model
    gpt2 = gpt2_model(config, state, settings.device, checkpointing=False).eval()
    conversion_error = relative_error(gpt2(input_ids=ids).logits, logits)
    del gpt2
    labels = own_prediction_labels(logits, ids)  # position t predicts token t + 1
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    return labels, loss.item(), conversion_error


# ---------------------------------------------------------------------------- the variants
@dataclass
class Trainer:
    """One variant, built: `step(input_ids, labels)` trains one step and returns its loss."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    close: Callable[[], None] = field(default=lambda: None)
    # A compiled variant's `engine.compile_stats`: its compilations so far and their seconds; None if eager.
    compile_stats: Callable[[], Mapping[str, float] | None] = field(default=lambda: None)


def adamw(parameters, settings: Settings) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameters, **ADAMW, fused=True if settings.cuda else None)


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """A plain torch training step's second half; returns the loss."""
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def tnlg_configs(settings: Settings, stage: int, compiled: bool) -> tuple[ZeroConfig, CompileConfig | None]:
    """What a tnlg variant's engine is built with (its compile setting None when eager)."""
    compile_config = CompileConfig(backend="inductor", mode=settings.compile_mode) if compiled else None
    return ZeroConfig(stage=stage, mixed_precision="bf16"), compile_config


def tnlg_trainer(workload: Workload, stage: int, compiled: bool = False) -> Trainer:
    settings = workload.settings
    model = tnlg_model(workload.config, workload.state, settings.device, settings.activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)  # the engine steps it (its fused Adam on CUDA)
    zero_config, compile_config = tnlg_configs(settings, stage, compiled)
    engine = initialize(model, optimizer, zero_config, device=settings.device, compile_config=compile_config)
    records_graphs = compile_config is not None and compile_config.uses_cuda_graphs

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()  # zeroes the gradients too
        return loss.detach()

    def close() -> None:
        engine.close()
        if records_graphs:
            # The CUDA graphs this slot recorded hold its parameters as static inputs, and their memory
            # pool: dropped with the slot, so that the next compiled slot records its own (compiling
            # again, from inductor's warm cache) as a run of its own would, and so that no slot after
            # it, eager ones too, counts them in its peak memory (an H100 run's eager rows read 2.5 GiB
            # high while the graphs lived on until the next compiled slot was built).
            torch.compiler.reset()

    return Trainer(step, close, engine.compile_stats)


def fsdp2_trainer(workload: Workload) -> Trainer:
    settings = workload.settings
    model = tnlg_model(workload.config, workload.state, settings.device, settings.activation_checkpointing)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the rest: embeddings, tied head, final LayerNorm
    optimizer = adamw(model.parameters(), settings)
    return Trainer(lambda ids, labels: backward_and_step(model(input_ids=ids, labels=labels).loss, optimizer))


def gpt2_trainer(workload: Workload) -> Trainer:
    settings = workload.settings
    model = gpt2_model(workload.config, workload.state, settings.device, settings.activation_checkpointing)
    optimizer = adamw(model.parameters(), settings)  # fp32 master weights; autocast casts per op

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(settings.device.type, dtype=torch.bfloat16):  # forward only, as torch advises
            loss = model(input_ids=ids, labels=labels).loss
        return backward_and_step(loss, optimizer)

    return Trainer(step)


VARIANTS: dict[str, Callable[[Workload], Trainer]] = {
    "tnlg stage 0": partial(tnlg_trainer, stage=0),
    "tnlg stage 3": partial(tnlg_trainer, stage=3),
    "torch FSDP2": fsdp2_trainer,
    "Transformers GPT-2": gpt2_trainer,
}
# With --compile on, these stages again with compiled blocks, side by side with the eager ones: the
# speed-up is only measured in one run.
COMPILED_STAGES = (0, 3)


def compile_refusal(settings: Settings, stage: int) -> str | None:
    """Why the engine refuses this run's compile mode at `stage` (stage 3 and the CUDA-graph modes), or None."""
    zero_config, compile_config = tnlg_configs(settings, stage, compiled=True)
    try:
        check_compile_fits(compile_config, zero_config)
    except ValueError as refusal:
        return str(refusal)
    return None


def compiled_variants(settings: Settings) -> dict[str, Callable[[Workload], Trainer]]:
    """The compiled variants of the stages whose engine takes this run's compile mode."""
    return {
        f"tnlg stage {stage} compiled": partial(tnlg_trainer, stage=stage, compiled=True)
        for stage in COMPILED_STAGES
        if compile_refusal(settings, stage) is None
    }


def variants(settings: Settings) -> dict[str, Callable[[Workload], Trainer]]:
    """This run's variants, in their A B C ... order: `VARIANTS`, then the compiled ones if asked for."""
    return {**VARIANTS, **(compiled_variants(settings) if settings.compiled else {})}


# ---------------------------------------------------------------------------- ABBA slots
@dataclass(frozen=True)
class Slot:
    """One variant built afresh, warmed up and timed: one letter of A B C D D C B A."""

    first_loss: float
    seconds: list[float]
    peak_bytes: int | None
    compile_seconds: float | None = None  # compiling this slot's steps (a compiled variant's; else None)
    late_compiles: int = 0  # compilations during the timed steps: their seconds are in the step times


def release(device: torch.device) -> None:
    """Free what the last variant held, so that the next one is measured alone on the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_slot(build: Callable[[Workload], Trainer], workload: Workload) -> Slot:
    """Build the variant from the seeded state, run every batch (the first `warmup_steps` untimed), free it.

    One variant at a time: four 1.3B training states (about 21 GB each) do not fit an 80 GB device
    together, and alone each variant's peak memory is its own.
    """
    device = workload.settings.device
    release(device)
    trainer = build(workload)
    losses, seconds = [], []
    warm: Mapping[str, float] | None = None
    for index, (ids, labels) in enumerate(workload.batches):
        if index == workload.settings.warmup_steps:
            warm = trainer.compile_stats()
        synchronize(device)
        began = time.perf_counter()
        losses.append(trainer.step(ids, labels))
        synchronize(device)
        if index >= workload.settings.warmup_steps:
            seconds.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    stats = trainer.compile_stats()  # before close, which stops the engine's count
    trainer.close()
    del trainer
    release(device)
    if stats is None or warm is None:
        return Slot(losses[0].item(), seconds, peak)
    late = int(stats["compiles"] - warm["compiles"])
    return Slot(losses[0].item(), seconds, peak, stats["compile_seconds"], late)


def gate_lines(workload: Workload, slots: Mapping[str, list[Slot]]) -> Iterator[str]:
    yield f"### Gate: first-step loss against the fp32 reference (tolerance {LOSS_TOLERANCE:.0e} relative)"
    yield ""
    yield "| variant | first-step loss | relative difference | result |"
    yield "|---|---|---|---|"
    yield f"| fp32 reference (tnlg, torch kernels) | {workload.reference_loss:.4f} | | reference |"
    error = workload.conversion_error
    yield (
        f"| GPT-2 conversion, fp32 logits | | {error:.1e} (tol {CONVERSION_TOLERANCE:.0e}) "
        f"| {verdict(error <= CONVERSION_TOLERANCE)} |"
    )
    for name, runs in slots.items():
        difference = max(abs(s.first_loss - workload.reference_loss) for s in runs) / workload.reference_loss
        losses = ", ".join(f"{s.first_loss:.4f}" for s in runs)
        yield f"| {name} | {losses} | {difference:.1e} | {verdict(difference <= LOSS_TOLERANCE)} |"


def verdict(ok: bool) -> str:
    return "ok" if ok else MISMATCH


def is_failure(line: str) -> bool:
    """Whether a line of the report is a failed check (its result cell reads MISMATCH)."""
    return f"| {MISMATCH} |" in line


def training_lines(settings: Settings, matmul_flops: float) -> Iterator[str]:
    workload = make_workload(settings)
    chosen = variants(settings)
    slots: dict[str, list[Slot]] = {name: [] for name in chosen}
    for name in chosen:  # A B C D ...; each first step on fresh weights is the gate's
        slots[name].append(run_slot(chosen[name], workload))
    gate = list(gate_lines(workload, slots))
    yield from [*gate, ""]
    if any(is_failure(line) for line in gate):
        yield "No timing: a variant that computes something else is no comparison."
        return
    for name in reversed(chosen):  # ... D C B A, rebuilt from the same state: their first steps gated too
        slots[name].append(run_slot(chosen[name], workload))
    rebuilt = [line for line in gate_lines(workload, slots) if is_failure(line)]
    if rebuilt:
        yield from ["Rebuilt variants no longer match:", *rebuilt, "", "No timing."]
        return
    yield "gate passed: every variant's first step matches the fp32 reference (both ABBA slots)"
    yield ""
    n = settings.matmul_size
    yield from (
        "| achievable matmul | TFLOP/s |",
        "|---|---|",
        f"| {n}x{n}x{n} bf16 | {matmul_flops / 1e12:.3g} |",
    )
    yield ""
    yield from timing_lines(settings, workload.config, slots, matmul_flops)


def timing_lines(
    settings: Settings, config: TNLGConfig, slots: Mapping[str, list[Slot]], matmul_flops: float
) -> Iterator[str]:
    tokens = settings.micro_batch * settings.seq_len
    # Model FLOPs (PaLM / Megatron MFU): 6N + attention per token, without the recomputation that
    # activation checkpointing adds (flops_per_token's docstring): the hardware does more than this.
    flops = config.flops_per_token(settings.seq_len) * tokens
    peak = peak_flops_per_device(settings.device, "bf16")
    datasheet = f"{peak / 1e12:.0f} TFLOP/s datasheet" if peak else "datasheet n/a"
    count = 2 * settings.timed_steps
    order = " ".join(string.ascii_uppercase[: len(slots)])
    yield f"### Training step, ABBA order {order} {order[::-1]}, median of {count} timed steps per variant"
    yield ""
    # The compile column only with --compile on: without, the table is as before (gpu_first_contact reads
    # its six cells).
    column = " compile s (per slot) |" if settings.compiled else ""
    yield f"| variant | step ms | tokens/s | MFU ({datasheet}) | MFU (measured matmul) | peak memory GiB |{column}"
    yield "|---|---|---|---|---|---|" + ("---|" if settings.compiled else "")
    medians = {
        name: statistics.median(s for slot in runs for s in slot.seconds) for name, runs in slots.items()
    }
    for name, seconds in medians.items():
        achieved = flops / seconds
        mfu = f"{100 * achieved / peak:.1f}%" if peak else "n/a"
        peaks = [slot.peak_bytes for slot in slots[name] if slot.peak_bytes is not None]
        memory = f"{max(peaks) / 2**30:.1f}" if peaks else "n/a"
        # Dynamo's cache is the process's: on CPU the first compiled slot compiled the block and the later
        # ones (stage 3's too, the same code and shapes) reused it, reading about 0
        compiling = [slot.compile_seconds for slot in slots[name] if slot.compile_seconds is not None]
        cell = f" {', '.join(f'{s:.1f}' for s in compiling) or '-'} |" if settings.compiled else ""
        yield (
            f"| {name} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {mfu} "
            f"| {100 * achieved / matmul_flops:.1f}% | {memory} |{cell}"
        )
    yield ""
    stage0, stage3 = medians["tnlg stage 0"], medians["tnlg stage 3"]
    yield f"tnlg stage 0 / Transformers GPT-2 tokens/s: {medians['Transformers GPT-2'] / stage0:.2f}"
    yield f"tnlg stage 3 / torch FSDP2 step time: {stage3 / medians['torch FSDP2']:.2f}"
    if settings.compiled:  # the goal (tnlg-1.3b on a GPU): compiled at least 1.1x eager tokens/s
        ratios = [
            f"stage {s} {medians[f'tnlg stage {s}'] / medians[f'tnlg stage {s} compiled']:.2f}"
            for s in COMPILED_STAGES
            if f"tnlg stage {s} compiled" in medians
        ]
        yield f"tnlg compiled / eager tokens/s: {', '.join(ratios)}"
    late = [name for name, runs in slots.items() if any(slot.late_compiles for slot in runs)]
    if late:  # the warmup did not absorb every compilation: these step times include some
        yield f"compiled during the timed steps (more warmup steps needed): {', '.join(late)}"


# ---------------------------------------------------------------------------- matmul and kernels
def measure_matmul(settings: Settings) -> float:
    """FLOP/s of one n^3 bf16 matmul: what this device achieves on the operation a step is made of."""
    n = settings.matmul_size
    a, b = (torch.randn(n, n, device=settings.device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    seconds = timed(lambda: torch.matmul(a, b, out=out), settings.device, settings.repeats, settings.warmup)
    return 2 * n**3 / seconds


def kernel_lines(settings: Settings) -> Iterator[str]:
    config = settings.config()
    rows, width, vocab = settings.micro_batch * settings.seq_len, config.hidden_size, config.vocab_size
    generator = torch.Generator().manual_seed(SEED + 2)
    device = settings.device
    cases = (  # built one at a time, as they are timed: the LM head's inputs alone are large
        ("LayerNorm", "F.layer_norm", lambda: layer_norm_case(rows, width, device, generator)),
        ("bias + GeLU", "F.gelu(x + b, approximate='tanh')", lambda: bias_gelu_case(rows, width, device, generator)),
        ("chunked LM head + cross-entropy", "F.linear + F.cross_entropy (fp32 logits)",
         lambda: cross_entropy_case(rows, width, vocab, device, generator)),
    )  # fmt: skip
    yield f"### Kernels, bf16, {rows} tokens x hidden {width}, vocabulary {vocab} (forward + backward)"
    yield ""
    yield "| kernel | torch | torch ms | tnlg ms | torch / tnlg | check | result |"
    yield "|---|---|---|---|---|---|---|"
    for name, torch_name, build in cases:
        yield kernel_row(name, torch_name, build(), settings)
        release(device)
    yield adam_row(settings.adam_numel or config.num_parameters(), settings)
    release(device)


def kernel_row(name: str, torch_name: str, run: Callable[[bool], tuple], settings: Settings) -> str:
    """`run(fused)` returns the gradients of one forward + backward: compared, then both timed."""
    error = max(relative_error(a, b) for a, b in zip(run(True), run(False), strict=True))
    check = f"max rel grad error {error:.1e} (tol {KERNEL_TOLERANCE:.0e})"
    if not error <= KERNEL_TOLERANCE:
        return f"| tnlg {name} | {torch_name} | | | | {check} | {MISMATCH} |"
    base = timed(lambda: run(False), settings.device, settings.repeats, settings.warmup)
    fused = timed(lambda: run(True), settings.device, settings.repeats, settings.warmup)
    return f"| tnlg {name} | {torch_name} | {base * 1e3:.3f} | {fused * 1e3:.3f} | {base / fused:.2f}x | {check} | ok |"


def adam_row(numel: int, settings: Settings) -> str:
    """tnlg's fused Adam (bf16 gradient in, bf16 copy out) against torch's fused AdamW doing the same
    work: the gradient cast to fp32 (it takes no bf16 one), the step, the bf16 copy."""
    backend = "auto" if settings.cuda else "triton"  # CPU: the Triton kernel in the interpreter
    error, ran = adam_update_error(settings.device, backend)
    check = f"update rel error {error:.1e} (tol {ADAM_TOLERANCE:.0e})"
    name = f"tnlg fused Adam ({ran}), {numel:,} fp32 parameters"
    torch_name = "AdamW(fused) + grad cast + bf16 copy" if settings.cuda else "AdamW + grad cast + bf16 copy"
    if not error <= ADAM_TOLERANCE:
        return f"| {name} | {torch_name} | | | | {check} | {MISMATCH} |"
    base = timed(torch_adam_step(numel, settings), settings.device, settings.repeats, settings.warmup)
    release(settings.device)
    fused = timed(
        tnlg_adam_step(numel, settings.device, backend), settings.device, settings.repeats, settings.warmup
    )
    return f"| {name} | {torch_name} | {base * 1e3:.3f} | {fused * 1e3:.3f} | {base / fused:.2f}x | {check} | ok |"


def adam_update_error(device: torch.device, backend: str, numel: int = 4096) -> tuple[float, str]:
    """One step from the same weights and gradient: tnlg's update against torch AdamW's; the backend run."""
    generator = torch.Generator().manual_seed(SEED + 3)
    start = torch.randn(numel, generator=generator).to(device)
    grad = torch.randn(numel, generator=generator).to(device, torch.bfloat16)
    param = torch.nn.Parameter(start.clone())
    param.grad = grad.float()
    torch.optim.AdamW([param], **{**ADAMW, "lr": 1e-3}).step()
    mine, moments = start.clone(), (torch.zeros_like(start), torch.zeros_like(start))
    ran = fused_adam(mine, grad, *moments, step=1, **{**ADAMW, "lr": 1e-3}, backend=backend)
    return relative_error(mine - start, param.detach() - start), ran


def torch_adam_step(numel: int, settings: Settings) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(numel, device=settings.device))
    grad = torch.randn(numel, device=settings.device, dtype=torch.bfloat16)
    copy16 = torch.empty_like(grad)
    optimizer = adamw([param], settings)

    def step() -> None:
        param.grad = grad.float()
        optimizer.step()
        copy16.copy_(param)

    return step


def tnlg_adam_step(numel: int, device: torch.device, backend: str) -> Callable[[], None]:
    param = torch.randn(numel, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    grad = torch.randn(numel, device=device, dtype=torch.bfloat16)
    out16 = torch.empty_like(grad)
    return lambda: fused_adam(
        param, grad, exp_avg, exp_avg_sq, step=10, **ADAMW, out16=out16, backend=backend
    )


# ---------------------------------------------------------------------------- the report
@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """FSDP2 needs a process group: a one-rank one, made here (and destroyed) unless one exists."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(f"side_by_side compares at world size 1; this group has {dist.get_world_size()}")
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as scratch:  # a FileStore: no port to find free
        store = dist.FileStore(os.path.join(scratch, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def side_by_side_lines(
    smoke: bool,
    device: torch.device,
    *,
    micro_batch: int | None = None,
    activation_checkpointing: bool = True,
    fused_kernels: str = "auto",
    compiled: bool = False,
    compile_mode: str | None = None,
) -> Iterator[str]:
    """The report's lines, each as soon as it is known; a failed check's line reads MISMATCH
    (`is_failure`). Runs at world size 1 on `device` (CPU only with `smoke`)."""
    settings = Settings.create(
        smoke, device, micro_batch, activation_checkpointing, fused_kernels, compiled, compile_mode
    )
    config = settings.config()
    name = torch.cuda.get_device_name(device) if settings.cuda else "CPU"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    yield f"# side_by_side on {name}{' (smoke)' if smoke else ''}: {versions}"
    yield ""
    if smoke:
        yield "Smoke: tiny sizes, to check the script; its timings say nothing about the device."
        yield ""
    yield (
        f"{settings.preset}: {config.describe()}; bf16 mixed precision, micro-batch {settings.micro_batch} x "
        f"{settings.seq_len} tokens, activation checkpointing {'on' if activation_checkpointing else 'off'}, "
        f"fused kernels {fused_kernels}, compile {'on' if compiled else 'off'}"
        + (f" (mode {compile_mode})" if compile_mode else "")
    )
    yield ""
    refused = {stage: compile_refusal(settings, stage) for stage in COMPILED_STAGES} if compiled else {}
    for stage, refusal in refused.items():
        if refusal is not None:
            yield f"tnlg stage {stage} compiled is left out: {refusal}"
            yield ""
    with one_rank_group(device):
        matmul_flops = measure_matmul(settings)  # reported with the step times, once the gate has passed
        yield from training_lines(settings, matmul_flops)
        yield ""
        yield from kernel_lines(settings)  # each kernel checked against torch's before it is timed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the debug preset on any device (checks the script)"
    )
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default 4; --smoke 2)")
    parser.add_argument("--activation-checkpointing", choices=("on", "off"), default="on")
    parser.add_argument(
        "--fused", choices=FUSED_CHOICES, default="auto", help="TNLGConfig.fused_kernels of the tnlg variants"
    )
    parser.add_argument(
        "--compile", choices=("on", "off"), default="off",
        help="also tnlg stage 0 and 3 with each block compiled (inductor), timed beside the eager ones",
    )  # fmt: skip
    parser.add_argument(
        "--compile-mode", choices=COMPILE_MODES,
        help="torch.compile's mode for the compiled variants (a CUDA-graph mode leaves stage 3 out, which refuses it)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.compile_mode is not None and args.compile != "on":
        parser.error("--compile-mode sets the mode of the compiled variants: give it with --compile on")
    if not torch.cuda.is_available() and not args.smoke:
        parser.exit(2, "side_by_side needs a CUDA device (use --smoke to check the script elsewhere)\n")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        parser.exit(
            2, "--smoke on CPU runs the Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1\n"
        )
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch must be at least 1, got {args.micro_batch}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    failed = False
    lines = side_by_side_lines(
        args.smoke,
        device,
        micro_batch=args.micro_batch,
        activation_checkpointing=args.activation_checkpointing == "on",
        fused_kernels=args.fused,
        compiled=args.compile == "on",
        compile_mode=args.compile_mode,
    )
    for line in lines:
        print(line, flush=True)
        failed = failed or is_failure(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
