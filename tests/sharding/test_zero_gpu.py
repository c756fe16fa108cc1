"""The engine on a CUDA device (skipped without one): the same training as on the CPU, aligned buffers."""

from __future__ import annotations

import pytest

from tests.support.zero_models import batches, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize

pytestmark = pytest.mark.gpu


def _train(device: str, stage: int, mixed_precision: str) -> list[float]:
    model = make_model().to(device)
    engine = initialize(
        model,
        make_optimizer(model),
        ZeroConfig(
            stage=stage,
            mixed_precision=mixed_precision,
            reduce_bucket_size=64,
            param_persistence_threshold=20,
        ),
    )
    losses = []
    for input_ids, labels in batches(5):
        loss = engine(input_ids.to(device), labels.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_training_matches_the_cpu(stage):
    assert _train("cuda", stage, "no") == pytest.approx(_train("cpu", stage, "no"), rel=1e-4)


@pytest.mark.parametrize("stage", [1, 3])
def test_cuda_bf16_trains(stage):
    losses = _train("cuda", stage, "bf16")
    assert losses[-1] < losses[0]


def test_cuda_pieces_are_256_byte_aligned():
    model = make_model().to("cuda")
    engine = initialize(
        model,
        make_optimizer(model),
        ZeroConfig(stage=3, mixed_precision="bf16", reduce_bucket_size=64, param_persistence_threshold=20),
    )
    for group in engine.groups:
        for unit in group.layout.units:
            assert (unit.piece * 2) % 256 == 0
            assert (unit.shard_offset * 2) % 256 == 0


def test_cuda_gradient_norm_is_a_few_large_reductions_with_no_fp32_copy():
    # [Note: gradient norm precision]: on CUDA a bf16 piece is reduced at once, widened inside the kernel.
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tnlg.sharding.optimizer import squared_norm

    numel = 64 * 2**20 + 4093  # ends in a partial row
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).cuda()
    expected = values.double().square().sum().item()
    squared_norm(values)  # warm up: the profile below counts one call's kernels only
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        result = squared_norm(values).item()
    kernels = [event for event in trace.events() if event.device_type.name == "CUDA"]
    assert result == pytest.approx(expected, rel=1e-6)
    assert len(kernels) <= 12, [event.name for event in kernels]
    assert torch.cuda.max_memory_allocated() - before < numel  # under 1 byte an element: no fp32 copy (4)
