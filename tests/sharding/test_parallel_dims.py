"""ParallelDims: the (pipeline, data, tensor) grid, tensor innermost; train_batch over micro-batches."""

from __future__ import annotations

import pytest
import torch

from tests.sharding.test_zero_equivalence import assert_trains_like
from tests.support.parallel_cases import (
    mesh_coordinates,
    meta_tensor_data,
    step_traffic,
    train_batch_errors,
    train_batches,
    train_tensor_data,
)
from tests.support.parallel_cases import tnlg_reference as tnlg_reference_run
from tests.support.tensor_parallel_cases import make_config as make_tnlg_config
from tests.support.zero_cases import STEPS
from tests.support.zero_models import train_reference
from tnlg.sharding import ParallelDims
from tnlg.tools.spawn import run_distributed


def test_data_degree_is_what_the_world_leaves():
    assert ParallelDims(tensor=2, pipeline=2).resolve(8) == ParallelDims(2, 2, 2)
    assert ParallelDims().resolve(3).data == 3
    assert str(ParallelDims(tensor=4).resolve(8)) == "tensor 4 x pipeline 1 x data 2"


@pytest.mark.parametrize(
    ("dims", "world", "message"),
    [
        (ParallelDims(tensor=3), 4, r"tensor 3 x pipeline 1 = 3 does not divide the world of 4 ranks"),
        (ParallelDims(tensor=2, data=4), 4, r"needs 8 ranks; the world has 4 \(data would be 2\)"),
    ],
)
def test_degrees_that_do_not_fit_the_world_are_named(dims, world, message):
    with pytest.raises(ValueError, match=message):
        dims.resolve(world)


@pytest.mark.parametrize("bad", [{"tensor": 0}, {"pipeline": 1.5}, {"tensor": True}, {"data": 0}])
def test_bad_degrees(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"ParallelDims\.{name} must be an integer >= 1"):
        ParallelDims(**bad)


@pytest.mark.slow
def test_tensor_groups_are_consecutive_ranks_then_data_then_pipeline():
    results = run_distributed(mesh_coordinates, 8, 2, 2, timeout=300)
    assert [r["coordinates"] for r in results] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]
    assert results[5]["tensor_ranks"] == [4, 5]
    assert results[5]["data_ranks"] == [5, 7]


@pytest.fixture(scope="module")
def reference():
    return train_reference(STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_train_batch_over_micro_batches_trains_like_one_process(reference, stage):
    # 2 data ranks, each its half of the global batch as 2 micro-batches of 4 sequences.
    run = run_distributed(train_batches, 2, stage, 2, timeout=300)[0]
    assert_trains_like(run, reference)


@pytest.mark.slow
def test_train_batch_refuses_what_it_cannot_run():
    empty, mapping, disagreeing = run_distributed(train_batch_errors, 1, timeout=120)[0]
    assert empty == "train_batch got no micro-batches"
    assert "takes a list of micro-batches, got dict" in mapping
    assert "got 2 micro-batches, but the engine's config accumulates 3 per step" in disagreeing


@pytest.fixture(scope="module")
def tnlg_reference():
    return tnlg_reference_run()


def assert_equal_to_one_process(run: dict, reference: dict) -> None:
    """Losses, gradient norms and final consolidated parameters within 1e-5 of one process."""
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    if reference["norms"] is not None:
        assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5, abs=1e-6)
    assert run["state"].keys() == reference["state"].keys()
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(run["state"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tensor_2_x_data_2_trains_like_one_process(tnlg_reference, stage):
    results = run_distributed(train_tensor_data, 4, 2, stage, timeout=600)
    assert_equal_to_one_process(results[0], tnlg_reference)
    assert all(r["state"] == {} for r in results[1:])  # consolidated on rank 0 only


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_step_traffic_equals_the_analytic_megatron_and_zero_volumes(stage):
    traffic = run_distributed(step_traffic, 4, stage, timeout=600)[0]
    counted, units = traffic["bytes"], traffic["units"]
    config = make_tnlg_config()
    tokens, h, layers = traffic["tokens"], config.hidden_size, config.num_hidden_layers
    # Megatron: per layer two all-reduces of the activations forward (attention and MLP outputs) and
    # two backward (the QKV and fc_in inputs' gradients); the vocabulary-parallel embedding forward and
    # the head's input gradient backward; the loss's max, sum of exponentials and target logit per
    # token (fp32; the shifted labels are padded with an ignored one, as Transformers' loss does); and
    # the gradient norm's one fp64 scalar.
    tensor_all_reduce = 4 * ((4 * layers + 2) * tokens * h + 3 * tokens) + 8
    assert counted.pop("all_reduce/tensor") == tensor_all_reduce
    # ZeRO over the data ranks, of each rank's slices: every gradient reduce-scattered once; stage 2
    # all-gathers the updated parameters once, stage 3 gathers each block in forward and again in
    # backward, the root block once, and the persistent parameters after the step.
    assert counted.pop("reduce_scatter/data") == 4 * units["full"]
    gathered = units["full"] if stage == 2 else 2 * units["block"] + units["root"] + units["persistent"]
    assert counted.pop("all_gather/data") == 4 * gathered
    assert counted.pop("all_reduce/data") == 8 + 4  # the norm's fp64 scalar; train_batch's mean loss
    assert counted == {}  # nothing else, no broadcast, nothing on another group


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_meta_model_is_cut_in_shape_and_initialized_as_a_whole_one(stage):
    from tests.support.tensor_parallel_cases import make_config
    from tnlg.modeling import TNLGForCausalLM
    from tnlg.sharding import init_weights

    state = run_distributed(meta_tensor_data, 4, stage, timeout=300)[0]
    whole = TNLGForCausalLM(make_config())
    init_weights(whole, 5)
    assert state.keys() == whole.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(state[name], tensor), name
