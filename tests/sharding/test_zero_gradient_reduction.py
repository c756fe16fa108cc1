"""Gradients are divided by the world size before the ranks' reduction sums them, as DeepSpeed's ZeRO
and DDP divide: summed first, fp16 gradients that no rank overflows overflowed in the sum, and the fp16
loss scale settled up to the world size lower than DeepSpeed's (see [Note: gradient reduction])."""

from __future__ import annotations

import pytest

from tests.support.zero_cases import reduce_large_fp16_gradients
from tnlg.tools.spawn import run_distributed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_gradients_whose_sum_overflows_reduce_to_their_finite_mean(stage):
    for result in run_distributed(reduce_large_fp16_gradients, 2, stage, 1):
        assert result["applied"]  # summed first, 80000 is inf in fp16 and the step was skipped
        assert result["w"] == [-40000.0] * 8


@pytest.mark.parametrize("probe", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_second_backward_before_the_step_adds_every_ranks_new_gradients(stage, probe):
    # Stage 1 keeps the first reduction's means in its piece; the second backward must not divide them
    # again. `probe`: a torch.autograd.grad after each backward runs the tensor hooks and accumulates
    # nothing, so it must not turn the means back into shares of the sum.
    backwards = [[8192.0, 12288.0], [16384.0, 20480.0]]  # per rank, per backward
    mean_of_sums = sum(sum(values) for values in backwards) / 2
    for result in run_distributed(reduce_large_fp16_gradients, 2, stage, 2, probe):
        assert result["applied"]
        assert result["w"] == [-mean_of_sums] * 8
