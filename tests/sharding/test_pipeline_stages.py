"""Pipeline stages composed with ZeRO (and tensor slicing): equal to one process, what is refused, and the
communication of a step against the analytic volumes."""

from __future__ import annotations

import math

import pytest
import torch

from tests.sharding.test_parallel_dims import assert_equal_to_one_process
from tests.support.parallel_cases import tnlg_batches, tnlg_optimizer, tnlg_reference, train_tensor_data
from tests.support.pipeline_cases import (
    dropout_generators_out_of_step,
    evaluate_after_training,
    frozen_tied_embedding,
    mid_schedule_refusals,
    optimizer_beyond_the_model,
    pipeline_refusals,
    pipeline_traffic,
    pretrained_layout,
    schedules_kept,
    train_mixed_precision,
)
from tests.support.tensor_parallel_cases import make_config, make_model
from tests.support.zero_models import train_one_process
from tnlg.sharding import ParallelDims
from tnlg.sharding.pipeline import schedule_count_problem
from tnlg.tools.spawn import run_distributed


@pytest.fixture(scope="module")
def reference_2_layers():
    return tnlg_reference()


@pytest.fixture(scope="module")
def reference_4_layers():
    return tnlg_reference(layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pipeline_2_x_data_2_trains_like_one_process(reference_2_layers, stage):
    results = run_distributed(train_tensor_data, 4, 1, stage, 0.0, 2, timeout=600)
    assert_equal_to_one_process(results[0], reference_2_layers)
    assert all(r["state"] == {} for r in results[1:])  # consolidated on rank 0 only


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tensor_2_x_pipeline_2_trains_like_one_process(reference_2_layers, stage):
    results = run_distributed(train_tensor_data, 4, 2, stage, 0.0, 2, timeout=600)
    assert_equal_to_one_process(results[0], reference_2_layers)


@pytest.mark.slow
@pytest.mark.parametrize(("tensor", "stage"), [(1, 3), (2, 2)])
def test_interleaved_stages_train_like_one_process(reference_4_layers, tensor, stage):
    # 4 layers in 4 stages, 2 per rank (stages r and r + 2): the interleaved 1F1B schedule.
    results = run_distributed(train_tensor_data, 4, tensor, stage, 0.0, 2, 2, 4, timeout=600)
    assert_equal_to_one_process(results[0], reference_4_layers)


@pytest.mark.slow
def test_clipping_counts_the_tied_embedding_once():
    # The norm sums over the stages; the tied embedding's copy on the last stage must not count twice,
    # or the clipped update (and every later loss) would differ from one process's.
    reference = tnlg_reference(clip=0.5)
    results = run_distributed(train_tensor_data, 4, 1, 2, 0.5, 2, timeout=600)
    assert_equal_to_one_process(results[0], reference)


@pytest.mark.slow
@pytest.mark.parametrize(("pipeline", "tensor"), [(2, 1), (2, 2)])
def test_eval_batch_is_the_whole_models_loss(pipeline, tensor):
    results = run_distributed(evaluate_after_training, 4, pipeline, tensor, 3, timeout=600)
    model = make_model()
    model.load_state_dict(results[0]["state"])
    ids, labels = tnlg_batches(3)[2]
    with torch.no_grad():
        expected = model(ids, labels=labels).loss.item()
    assert {r["loss"] for r in results} == {results[0]["loss"]}  # the same on every rank
    assert results[0]["loss"] == pytest.approx(expected, rel=1e-6)


def test_what_pipeline_stages_cannot_run_is_refused_by_name_on_every_rank():
    results = run_distributed(pipeline_refusals, 2, timeout=300)
    (
        mask,
        no_labels,
        shapes,
        tuples,
        forward,
        label_shape,
        eval_labels,
        too_long,
        flat,
        positions,
        accumulating,
    ) = results[0]
    assert "micro-batch 0: pipeline stages take" in mask and "unsupported: ['attention_mask']" in mask
    assert "missing: ['labels']" in no_labels
    assert "must all have one shape" in shapes
    assert "each micro-batch is a mapping" in tuples
    assert "holds pipeline stages [0] of 2, not the whole model: train with engine.train_batch" in forward
    assert "train_batch: micro-batch 0: labels [4, 6] must have the shape of input_ids [4, 12]" in label_shape
    assert "eval_batch: micro-batch 0" in eval_labels and "missing: ['labels']" in eval_labels
    assert "sequences of 40 tokens are longer than the model's max_position_embeddings (32)" in too_long
    assert "input_ids must be integer token ids of shape (batch, length)" in flat
    assert "position_ids [1, 5] do not fit input_ids [4, 12]" in positions
    assert (
        "pipeline stages the micro-batches given to train_batch are the step's accumulation" in accumulating
    )
    assert "accumulates 2 per step (gradient_accumulation_steps): set it to 1" in accumulating
    # Both stages refuse before the schedule starts: neither is left waiting for the other.
    assert results[1][5:] == results[0][5:]


@pytest.fixture(scope="module")
def refusals():
    # A short collective timeout: a rank left waiting for another that raised mid-schedule would end in a
    # timeout error, not in the ValueError every rank must raise before the schedule starts.
    return run_distributed(mid_schedule_refusals, 2, timeout=300, collective_timeout=20)


VALUE_REFUSALS = {
    "token": "train_batch: micro-batch 1: token id 64 is outside the vocabulary [0, 64)",
    "negative token": "train_batch: micro-batch 0: token id -1 is outside the vocabulary [0, 64)",
    "label": "train_batch: micro-batch 1: label 64 is outside the vocabulary [0, 64) and not the ignore index -100",
    "negative label": "train_batch: micro-batch 0: label -5 is outside the vocabulary [0, 64)",
    "float labels": "train_batch: micro-batch 0: labels must be integer token ids (-100: no loss), got torch.float32",
    "negative position": "train_batch: micro-batch 0: position id -1 is outside [0, 32) (max_position_embeddings)",
    "position beyond": "train_batch: micro-batch 0: position id 40 is outside [0, 32)",
    "eval label": "eval_batch: micro-batch 1: label 64 is outside the vocabulary [0, 64)",
}


def test_values_only_one_stage_would_meet_are_refused_on_every_rank_before_the_schedule(refusals):
    # Token ids meet the first stage's embedding, labels the last stage's loss: mid-schedule, one stage
    # would raise and the other wait. Every rank raises the same ValueError instead.
    for case, message in VALUE_REFUSALS.items():
        assert refusals[0][case].startswith(f"ValueError: {message}"), (case, refusals[0][case])
        assert refusals[1][case] == refusals[0][case], case
    # A bad value on one rank only (a data replica's own batch): that rank names it, the others point to it.
    assert refusals[0]["one rank's token"].startswith("ValueError: train_batch: micro-batch 0: token id 64 ")
    assert refusals[1]["one rank's token"] == (
        "ValueError: train_batch: another rank's pipeline stage refused these micro-batches (see its error)"
    )
    for result in refusals:  # int32 labels are taken as the int64 ones; the engine still trains
        assert result["int32 labels"][0] == result["int32 labels"][1]
        assert result["trained"] == refusals[0]["trained"] and math.isfinite(result["trained"])


def test_ranks_passing_different_micro_batches_all_refuse_the_step(refusals):
    # Rank 0: 2 micro-batches of 2 rows, rank 1: 4 of 1; then rows of 12 and of 8 tokens.
    assert refusals[0]["counts"] == refusals[1]["counts"]
    assert refusals[0]["counts"].startswith(
        "ValueError: train_batch: the ranks disagree on their micro-batches (micro-batch counts 2..4, rows per "
        "micro-batch 1..2): under pipeline stages every rank of a step passes the same number"
    )
    assert refusals[0]["lengths"] == refusals[1]["lengths"]
    assert "disagree on their micro-batches (lengths 8..12)" in refusals[0]["lengths"]


def test_fewer_micro_batches_than_stages_are_refused_by_name(refusals):
    for case, action in (("one micro-batch", "train_batch"), ("one micro-batch eval", "eval_batch")):
        assert refusals[0][case] == refusals[1][case], action
        assert refusals[0][case] == (
            "ValueError: 1 micro-batch(es) for 2 pipeline stages: the 1F1B schedule needs at least as many "
            "micro-batches as stages; split the batch into at least 2 micro-batches"
        )


def test_interleaved_counts_are_refused_naming_the_count_stages_and_rule(refusals):
    assert refusals[0]["interleaved 5"] == refusals[1]["interleaved 5"]
    assert refusals[0]["interleaved 5"] == (
        "ValueError: 5 micro-batches for 4 pipeline stages (2 on each of 2 ranks): the interleaved 1F1B schedule "
        "needs a count that is a multiple of its rounds, max(1, count // 2) = 2 here; e.g. 4 or 6 micro-batches"
    )


@pytest.mark.parametrize("pipeline", [2, 3, 4, 8])
def test_the_counts_an_interleaved_refusal_suggests_are_taken(pipeline):
    refused = 0
    for count in range(1, 12 * pipeline):
        problem = schedule_count_problem(count, pipeline, 2)
        if problem is None:
            continue
        refused += 1
        below, above = (
            int(n) for n in problem.split("e.g. ")[1].removesuffix(" micro-batches").split(" or ")
        )
        assert below < count < above
        assert schedule_count_problem(below, pipeline, 2) is None
        assert schedule_count_problem(above, pipeline, 2) is None
        assert all(
            schedule_count_problem(n, pipeline, 2) for n in range(count + 1, above)
        )  # the nearest above
    assert refused  # every degree here has counts torch refuses


@pytest.mark.slow
def test_a_frozen_tied_embedding_trains_the_rest_like_one_process():
    results = run_distributed(frozen_tied_embedding, 4, timeout=600)
    model = make_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    reference = train_one_process(
        model, tnlg_optimizer(model), tnlg_batches(), lambda ids, labels: model(ids, labels=labels).loss
    )
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for name, value in reference["state"].items():
        torch.testing.assert_close(results[0]["state"][name], value, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_dropout_generators_out_of_step_on_a_later_stage_stop_every_rank():
    messages = run_distributed(dropout_generators_out_of_step, 4, timeout=600)
    assert all("ValueError" not in m and m != "trained" for m in messages)
    later = [m for m in messages if m.startswith("pipeline stage 1:")]
    assert later and all("another rank's pipeline stage refused" in m for m in messages if m not in later)


def test_an_optimizer_beyond_the_model_is_refused_under_pipeline_stages():
    message = run_distributed(optimizer_beyond_the_model, 2, timeout=300)[0]
    assert "holds a parameter of shape [3] that is not in the model" in message


def test_one_schedule_is_kept_and_nothing_of_a_step_outlives_it():
    kept = run_distributed(schedules_kept, 2, timeout=300)
    for result in kept:
        assert result["key"] == (4, (4, 12), False)  # the evaluation's, replacing the two training shapes
        assert result["leftovers"] == 0
        assert result["training"]  # eval_batch restores the mode it found


def test_virtual_stages_need_pipeline_stages():
    with pytest.raises(ValueError, match="virtual_stages=2 needs pipeline stages"):
        ParallelDims(virtual_stages=2)
    assert ParallelDims(pipeline=2, virtual_stages=3).num_stages == 6


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_traffic_equals_the_analytic_pipeline_and_zero_volumes(stage):
    results = run_distributed(pipeline_traffic, 4, stage, timeout=600)
    h = make_config().hidden_size
    for traffic in results:
        counted, units, micro = dict(traffic["bytes"]), traffic["units"], traffic["micro_batches"]
        # Pipeline: each micro-batch's activations (b x s x h, fp32) go forward from the first stage, and
        # their gradient comes back from the last: one message per micro-batch from every rank.
        assert counted.pop("send/pipeline") == micro * traffic["tokens"] * h * 4
        # ZeRO over the data ranks, of each stage's parameters: stages 2-3 reduce-scatter every
        # micro-batch's gradients, stage 1 the accumulated ones once; stages 1-2 all-gather the updated
        # parameters once; stage 3 gathers each block (one layer here) in every micro-batch's forward and
        # backward, the root block once for the schedule, the persistent parameters after the step.
        scatters = 1 if stage == 1 else micro
        assert counted.pop("reduce_scatter/data") == 4 * scatters * units["full"]
        if stage == 3:
            gathered = 2 * micro * units["block"] + units["root"] + units["persistent"]
        else:
            gathered = units["full"]
        assert counted.pop("all_gather/data") == 4 * gathered
        # The tied embedding: this rank's piece of its gradient summed over first and last stage.
        assert counted.pop("all_reduce/shared") == 4 * units["shared_piece"]
        # The norm's fp64 scalar over data and pipeline; the mean loss broadcast from the last stage and
        # averaged over the data replicas.
        assert counted.pop("all_reduce/data") == 8 + 4
        assert counted.pop("all_reduce/pipeline") == 8
        assert counted.pop("broadcast/pipeline") == 4
        # The ranks' agreement on the step's micro-batches before the schedule: 9 int64 over the world
        # ([Note: micro-batches agreed before the schedule] in sharding/pipeline.py).
        assert counted.pop("all_reduce/world") == 9 * 8
        assert counted == {}  # nothing else


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "tensor", "pipeline", "share"),
    [
        (3, 1, 2, 1 / 4),  # a stage's half of the model, over 2 data ranks
        (3, 2, 1, 1 / 4),  # a tensor rank's half of every matrix, over 2 data ranks
        (1, 2, 2, 1 / 4),  # a stage's half, a tensor rank's half of it (stage 1 with data 1: kept whole)
    ],
)
def test_each_rank_reads_only_its_part_of_a_pretrained_checkpoint(tmp_path, stage, tensor, pipeline, share):
    model = make_model(num_hidden_layers=4)
    model.save_pretrained(tmp_path)
    results = run_distributed(pretrained_layout, 4, str(tmp_path), stage, tensor, pipeline, timeout=600)
    for name, value in model.state_dict().items():
        assert torch.equal(results[0]["state"][name], value), name
    # The whole model once (the tied head is not saved); each rank reads about its share of it: the rows
    # around its piece's ends, the whole of what it keeps whole (LayerNorms, biases), a little more.
    saved = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n != "lm_head.weight")
    assert all(r["bytes_read"] < 1.5 * share * saved for r in results), [
        r["bytes_read"] / saved for r in results
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "stage"), [("fp16", 1), ("bf16", 3)])
def test_16_bit_stages_train_like_fp32(reference_2_layers, precision, stage):
    # fp16: the loss function scales every micro-batch's backward by the loss scale (2^16) and the step
    # unscales: the norm (of unscaled gradients) would be 65536 times too large with the scale left in.
    run = run_distributed(train_mixed_precision, 4, precision, stage, timeout=600)[0]
    assert run["losses"] == pytest.approx(reference_2_layers["losses"], abs=2e-3)
    assert run["norms"] == pytest.approx(reference_2_layers["norms"], rel=2e-2)
    assert run["loss_scale"] == (65536.0 if precision == "fp16" else 1.0)
