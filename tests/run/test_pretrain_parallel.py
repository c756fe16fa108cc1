"""Pretraining with `--parallel.tensor 2`: the run config's layout reaches the engine and the data."""

from __future__ import annotations

import pytest
import torch

from tests.support.parallel_run_cases import debug_run_losses
from tnlg.tools.spawn import run_distributed

FP32_STEPS = ["--train.max_steps", "3", "--train.eval_every", "0"]  # debug.yaml trains in fp32


@pytest.mark.slow
def test_tensor_2_x_data_2_trains_like_data_2(tmp_path):
    cache = str(tmp_path / "cache")
    sliced = run_distributed(
        debug_run_losses,
        4,
        cache,
        str(tmp_path / "sliced"),
        [*FP32_STEPS, "--parallel.tensor", "2"],
        timeout=600,
    )
    plain = run_distributed(debug_run_losses, 2, cache, str(tmp_path / "plain"), FP32_STEPS, timeout=600)
    # The same two data replicas read the same batches; the tensor ranks of one replica share them.
    assert sliced[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)
    for name, tensor in plain[0]["state"].items():
        torch.testing.assert_close(sliced[0]["state"][name], tensor, atol=1e-5, rtol=0, msg=name)
