"""Does compiling the output layer and its loss pay where the chunked Triton cross-entropy does not run?

    python -m benchmarks.compile_head

The engine compiles each decoder block and leaves the rest of the model eager ([Note: compiled blocks]
in sharding/compile.py). After the blocks, a step runs the final LayerNorm, the LM head and the loss.
On CUDA the loss is tnlg's chunked Triton cross-entropy, which never builds the (tokens x vocabulary)
logits. Elsewhere (CPU, `fused_kernels="none"`) the head builds them and Transformers' causal-LM loss
reads them, so inductor could fuse the softmax passes. This measures that path alone, forward and
backward, eager beside `torch.compile` (inductor), in one process with one thread (as each rank of
the 2-process benchmarks runs):

- on the benchmark model's head (hidden 256, vocabulary 2048), and on GPT-2-vocabulary heads at
  tnlg-125m's and tnlg-350m's widths (hidden 768 and 1024, vocabulary 50304);
- gated first: the compiled loss and every gradient must equal the eager ones (fp32, 1e-5 relative);
- timed in interleaved rounds, the median reported, the compile time apart: torch's own compilations
  (Dynamo's compile callbacks, forward and backward graphs), cold, into a fresh inductor cache.

Then the same heads cut over 2 tensor ranks (gloo, one thread each), where the loss is the
vocabulary-parallel one (`tensor_parallel.vocab_parallel_causal_lm_loss`): each rank makes its
(tokens x vocabulary / 2) logits, and three all-reduces inside the loss (and one on the hidden state's
gradient) join the ranks; gated on every rank, the slower rank's median reported.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch._dynamo
import torch.distributed as dist

from benchmarks.common import interleaved_medians
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.tensor_parallel import apply_tensor_parallel, vocab_parallel_causal_lm_loss
from tnlg.sharding.compile import CompileClock
from tnlg.tools.spawn import run_distributed

WARMUP, REPEATS = 3, 10
MICRO_BATCH, SEQ_LEN = 4, 128
HEADS = {  # name: (hidden, vocabulary)
    "benchmark model": (256, 2048),
    "tnlg-125m width": (768, 50304),
    "tnlg-350m width": (1024, 50304),
}
GATE = 1e-5


class _HeadAndLoss(torch.nn.Module):
    """The part of a step after the last block: final LayerNorm, LM head, the model's own loss."""

    def __init__(self, model: TNLGForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.model.model.final_layernorm(hidden_states))
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.model.config.vocab_size)


class _SlicedHeadAndLoss(_HeadAndLoss):
    """The same part on a model cut over the tensor group: the LM head's local rows, the loss on local
    logits (`TNLGForCausalLM`'s own path under tensor slicing)."""

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model.final_layernorm(hidden_states)
        return vocab_parallel_causal_lm_loss(self.model.lm_head, hidden, labels)


def _run(head: torch.nn.Module, parameters: list[torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor):
    """One forward and backward; the loss and the gradients (hidden state first), cleared after."""
    loss = head(hidden, labels)
    loss.backward()
    grads = [hidden.grad] + [p.grad for p in parameters]
    hidden.grad = None
    for p in parameters:
        p.grad = None
    return loss.detach(), grads


def _gate(eager, compiled) -> float:
    """The largest relative difference between the two runs' loss and gradients."""
    (loss_e, grads_e), (loss_c, grads_c) = eager, compiled
    worst = ((loss_c - loss_e).abs() / loss_e.abs()).item()
    for e, c in zip(grads_e, grads_c, strict=True):
        worst = max(worst, ((c - e).abs().max() / e.abs().max()).item())
    return worst


def _model(hidden_size: int, vocab_size: int) -> TNLGForCausalLM:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = TNLGConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=SEQ_LEN,
        fused_kernels="none",  # the path this measures: the logits built, the loss read from them
    )
    return TNLGForCausalLM(config)


def _row(hidden_size: int, vocab_size: int) -> dict:
    return _measure(_HeadAndLoss(_model(hidden_size, vocab_size)))


def _sliced_row(rank: int, world_size: int, hidden_size: int, vocab_size: int) -> dict:
    torch.set_num_threads(1)
    model = _model(hidden_size, vocab_size)  # the same full weights on every rank, then this rank's cut
    apply_tensor_parallel(model, dist.group.WORLD)
    return _measure(_SlicedHeadAndLoss(model))


def _measure(eager: _HeadAndLoss) -> dict:
    """Gate the compiled module against `eager` (the same module), then time both."""
    compiled = torch.compile(eager)  # the same module and weights, compiled
    # What the path reads (the head is tied to the embedding); the unused block gets no gradient.
    parameters = [*eager.model.model.final_layernorm.parameters(), eager.model.lm_head.weight]
    generator = torch.Generator().manual_seed(1)  # the same input on every tensor rank
    hidden_size, vocab_size = eager.model.config.hidden_size, eager.model.config.vocab_size
    hidden = torch.randn(MICRO_BATCH, SEQ_LEN, hidden_size, generator=generator).requires_grad_()
    labels = torch.randint(0, vocab_size, (MICRO_BATCH, SEQ_LEN), generator=generator)
    reference = _run(eager, parameters, hidden, labels)
    clock = CompileClock()  # after _model's reset, which drops torch's compile callbacks
    first = _run(compiled, parameters, hidden, labels)
    clock.close()
    row = {"compile_s": clock.seconds, "gate": _gate(reference, first), "times": None}
    if row["gate"] <= GATE:
        steps = {
            name: (lambda m=m: _run(m, parameters, hidden, labels))
            for name, m in (("eager", eager), ("compiled", compiled))
        }
        row["times"] = interleaved_medians(steps, REPEATS, WARMUP)
    return row


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tnlg-inductor-") as cache_dir:
        # Cold compiles: inductor's default cache would hold earlier runs' graphs. Inductor reads the
        # variable whenever it looks for a cached graph, so setting it before the first compile holds.
        # The ranks below are started after this is set, and read it as the parent does.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        failed = _table()
    with tempfile.TemporaryDirectory(prefix="tnlg-inductor-") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # cold again: the sliced graphs are new ones
        failed = _sliced_table() or failed
    return 1 if failed else 0


def _slowest(per_rank: list[dict]) -> dict:
    """One row from every rank's: the worst gate, the slower rank's times, rank 0's compile seconds."""
    row = dict(per_rank[0])
    row["gate"] = max(r["gate"] for r in per_rank)
    if any(r["times"] is None for r in per_rank):
        row["times"] = None
    else:
        row["times"] = {name: max(r["times"][name] for r in per_rank) for name in per_rank[0]["times"]}
    return row


def _sliced_table() -> bool:
    print()
    print(
        f"Cut over 2 tensor ranks (gloo, 1 thread each), the vocabulary-parallel loss, fp32, "
        f"{MICRO_BATCH} x {SEQ_LEN} tokens on both"
    )
    print()
    rows = {
        name: _slowest(run_distributed(_sliced_row, 2, hidden_size, vocab_size, timeout=1800))
        for name, (hidden_size, vocab_size) in HEADS.items()
    }
    return _print_rows(rows)


def _table() -> bool:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 process, 1 thread, fp32, {MICRO_BATCH} x {SEQ_LEN} tokens")
    print()
    rows = {name: _row(hidden_size, vocab_size) for name, (hidden_size, vocab_size) in HEADS.items()}
    return _print_rows(rows)


def _print_rows(rows: dict[str, dict]) -> bool:
    """The table; True if a row failed its gate."""
    print(
        "| head | hidden | vocabulary | eager ms | compiled ms | eager / compiled | compile s (cold) | gate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for name, row in rows.items():
        hidden_size, vocab_size = HEADS[name]
        if row["times"] is None:
            failed = True
            print(
                f"| {name} | {hidden_size} | {vocab_size} | - | - | MISMATCH | {row['compile_s']:.1f} | {row['gate']:.1e} |"
            )
            continue
        eager, compiled = row["times"]["eager"], row["times"]["compiled"]
        print(
            f"| {name} | {hidden_size} | {vocab_size} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | "
            f"{eager / compiled:.2f}x | {row['compile_s']:.1f} | {row['gate']:.1e} |"
        )
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
