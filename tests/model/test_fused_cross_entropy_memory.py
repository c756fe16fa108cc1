"""What the chunked LM-head cross-entropy allocates: nothing for gradients where autograd wants none
(evaluation under no_grad, a frozen head), and while training at most one V x H fp32 buffer (the
weight gradient's accumulator, which becomes the gradient itself) plus, for 16-bit weights, the
gradient in their dtype. Measured through a TorchDispatchMode on CPU under TRITON_INTERPRET=1 (and
on CUDA when there is one): it sees every tensor an op returns, which is what the Python code keeps.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tnlg.modeling import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Chunks of 8 rows over 24 tokens, hidden 64, vocabulary 3000: every chunk-sized temporary (8 x 3000
# logits, 8 x 64 products) is far below V x H, so the bounds below leave room for them and no more.
ROWS, HIDDEN, VOCAB, CHUNK = 24, 64, 3000, 8


class AllocationTracker(TorchDispatchMode):
    """The tensors ops allocate while active (shape, dtype), and the peak bytes of those alive at once.

    A storage counts as new when no tensor or storage argument of the op holds it and it is not
    already tracked; it stops counting when freed (a weak reference to it expires). Triton's
    interpreter leaves its kernel arguments in reference cycles, which only the garbage collector
    frees (on a GPU they are plain references): it runs before each allocation is counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.peak_bytes = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __enter__(self):
        gc.freeze()  # the objects alive before are not the ops': collections below skip them (fast)
        return super().__enter__()

    def __exit__(self, *exc_info):
        gc.unfreeze()
        return super().__exit__(*exc_info)

    def live_bytes(self) -> int:
        self._live = {key: entry for key, entry in self._live.items() if not entry[0].expired()}
        return sum(size for _, size in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        arguments = tree_leaves((args, kwargs or {}))
        held = {StorageWeakRef(_storage(a)).cdata for a in arguments if _storage(a) is not None}
        out = func(*args, **(kwargs or {}))
        fresh = [
            t
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor)
            and t.untyped_storage().nbytes()
            and StorageWeakRef(t.untyped_storage()).cdata not in held
        ]
        if not fresh:
            return out
        gc.collect()
        self.live_bytes()  # drop the expired entries, whose addresses a new storage may reuse
        for tensor in fresh:
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref.cdata in self._live:
                continue
            self._live[ref.cdata] = (ref, tensor.untyped_storage().nbytes())
            self.allocations.append((tuple(tensor.shape), tensor.dtype))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out


def _storage(value) -> torch.UntypedStorage | None:
    if isinstance(value, torch.Tensor):
        return value.untyped_storage()
    return value if isinstance(value, torch.UntypedStorage) else None


def inputs(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[[1, 9]] = -100
    return hidden, weight, targets.to(DEVICE)


def reference(hidden, weight, targets):
    """The unfused loss in fp32 and its two leaves."""
    expected_inputs = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    return fused_ops.linear_cross_entropy_reference(*expected_inputs, targets), expected_inputs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_evaluation_makes_no_gradient_buffer(no_grad):
    """Under no_grad (Trainer.evaluate) the inputs still require grad: only the losses are computed."""
    hidden, weight, targets = inputs(torch.float32)
    with no_grad(), AllocationTracker() as tracker:
        loss = fused_ops.linear_cross_entropy(hidden, weight, targets, chunk_rows=CHUNK)
    assert loss.grad_fn is None
    assert loss.item() == pytest.approx(reference(hidden, weight, targets)[0].item(), rel=1e-5)
    shapes = {shape for shape, _ in tracker.allocations}
    assert (VOCAB, HIDDEN) not in shapes and (ROWS, HIDDEN) not in shapes, tracker.allocations
    assert tracker.peak_bytes <= CHUNK * VOCAB * 4 + 1024  # one chunk's logits, the losses, scalars


def test_a_frozen_head_gets_no_weight_gradient():
    """LoRA fine-tuning freezes the head: only the hidden states' gradient is made."""
    hidden, weight, targets = inputs(torch.float32)
    weight.requires_grad_(False)
    with AllocationTracker() as tracker:
        loss = fused_ops.linear_cross_entropy(hidden, weight, targets, chunk_rows=CHUNK)
        (grad_hidden,) = torch.autograd.grad(loss, [hidden])
    expected, expected_inputs = reference(hidden, weight, targets)
    (want_hidden,) = torch.autograd.grad(expected, expected_inputs[:1])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert relative_error(grad_hidden, want_hidden) <= 1e-5
    assert all(shape != (VOCAB, HIDDEN) for shape, _ in tracker.allocations), tracker.allocations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_keeps_one_fp32_vocab_by_hidden_buffer(dtype):
    """Forward + backward: one V x H fp32 accumulator, scaled in place and returned (fp32) or cast once
    (16-bit); before, backward's `grad * scale` and a whole-vocabulary product added one or two more."""
    hidden, weight, targets = inputs(dtype)
    with AllocationTracker() as tracker:
        loss = fused_ops.linear_cross_entropy(hidden, weight, targets, chunk_rows=CHUNK)
        grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight])
    want_hidden, want_weight = torch.autograd.grad(*reference(hidden, weight, targets))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative_error(grad_hidden, want_hidden) <= tolerance
    assert relative_error(grad_weight, want_weight) <= tolerance
    assert grad_weight.dtype == dtype

    vocab_by_hidden = [dt for shape, dt in tracker.allocations if math.prod(shape) >= VOCAB * HIDDEN]
    assert vocab_by_hidden == ([torch.float32] if dtype == torch.float32 else [torch.float32, dtype])
    bound = VOCAB * HIDDEN * (4 if dtype == torch.float32 else 4 + 2)
    # Everything else alive at once: the N x H gradients (fp32 and the input's dtype), one chunk's
    # logits in the compute dtype, one chunk-by-hidden product, the losses and scalars.
    chunk_sized = ROWS * HIDDEN * (4 + 4) + CHUNK * VOCAB * 4 + CHUNK * HIDDEN * 4 + ROWS * 4 + 1024
    assert tracker.peak_bytes <= bound + chunk_sized, (tracker.peak_bytes, bound, chunk_sized)


def test_a_second_backward_through_a_retained_graph_is_refused():
    """Backward scales the saved fp32 gradients in place: scaling them twice must be an error."""
    hidden, weight, targets = inputs(torch.float32)
    loss = fused_ops.linear_cross_entropy(hidden, weight, targets, chunk_rows=CHUNK)
    torch.autograd.grad(loss, [hidden, weight], retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, [hidden, weight])


@pytest.mark.gpu
def test_the_cuda_allocator_peak_stays_within_the_claimed_bound():
    """The same bound as the caching allocator sees it on a GPU (kernel scratch included), at a GPT-2
    vocabulary: a bf16 head of 50304 x 1024 and 8192 tokens in the default 4096-row chunks."""
    rows, hidden_size, vocab, chunk = 8192, 1024, 50304, fused_ops.CROSS_ENTROPY_CHUNK_ROWS
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=generator, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=generator, dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    hidden.requires_grad_()
    weight.requires_grad_()

    def step():
        loss = fused_ops.linear_cross_entropy(hidden, weight, targets, choice="triton")
        return torch.autograd.grad(loss, [hidden, weight])

    step()  # compiles the kernel and creates cuBLAS's workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    grads = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    del grads
    vocab_by_hidden = vocab * hidden_size * (4 + 2)  # the fp32 accumulator and the bf16 gradient
    chunk_sized = chunk * vocab * 2 + rows * hidden_size * (4 + 2) + chunk * hidden_size * 2
    assert peak <= vocab_by_hidden + chunk_sized + 64 * 2**20, (peak, vocab_by_hidden, chunk_sized)
