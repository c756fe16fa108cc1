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
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch._dynamo

from benchmarks.common import interleaved_medians
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding.compile import CompileClock

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


def _row(hidden_size: int, vocab_size: int) -> dict:
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
    eager = _HeadAndLoss(TNLGForCausalLM(config))
    compiled = torch.compile(eager)  # the same module and weights, compiled
    # What the path reads (the head is tied to the embedding); the unused block gets no gradient.
    parameters = [*eager.model.model.final_layernorm.parameters(), eager.model.lm_head.weight]
    hidden = torch.randn(MICRO_BATCH, SEQ_LEN, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab_size, (MICRO_BATCH, SEQ_LEN))
    reference = _run(eager, parameters, hidden, labels)
    clock = CompileClock()  # after the reset above, which drops torch's compile callbacks
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
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        return _table()


def _table() -> int:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 process, 1 thread, fp32, {MICRO_BATCH} x {SEQ_LEN} tokens")
    print()
    print(
        "| head | hidden | vocabulary | eager ms | compiled ms | eager / compiled | compile s (cold) | gate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for name, (hidden_size, vocab_size) in HEADS.items():
        row = _row(hidden_size, vocab_size)
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
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
