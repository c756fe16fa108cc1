"""ZeroAccelerator with Accelerate's ParallelismConfig: tensor slicing from Accelerate's own settings; pipeline
stages (which Accelerate's ParallelismConfig has no dimension for, in 1.15) from `parallel=`."""

from __future__ import annotations

import pytest

from tests.sharding.test_parallel_dims import assert_equal_to_one_process
from tests.support.parallel_cases import accelerate_tensor_data, tnlg_reference
from tests.support.parallel_run_cases import accelerate_pipeline_data
from tnlg.tools.spawn import run_distributed


@pytest.fixture(scope="module")
def reference():
    return {**tnlg_reference(), "norms": None}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["config", "environment"])
def test_zero_accelerator_applies_accelerates_parallelism_config(reference, source):
    results = run_distributed(accelerate_tensor_data, 4, 2, source, timeout=600)
    # Tensor ranks read the same batches, data ranks different ones (tensor innermost: ranks 0-1, 2-3).
    assert results[0]["seen"] == results[1]["seen"] != results[2]["seen"] == results[3]["seen"]
    assert [r["data"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert "model.layers.0.self_attn.qkv_proj.weight" in results[0]["sliced"]
    assert_equal_to_one_process({**results[0], "norms": None}, reference)


@pytest.mark.slow
def test_zero_accelerator_runs_pipeline_stages_over_its_data_loader(reference):
    results = run_distributed(accelerate_pipeline_data, 4, 2, timeout=600)
    # (pipeline, data) grid: ranks 0-1 hold stage 0, ranks 2-3 stage 1; a pipeline group reads one share.
    assert [r["stages"] for r in results] == [[0], [0], [1], [1]]
    assert results[0]["seen"] == results[2]["seen"] != results[1]["seen"] == results[3]["seen"]
    assert [r["data"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert_equal_to_one_process({**results[0], "norms": None}, reference)
