"""The model's pipeline split: which layers each stage holds, names kept, and stages chained = the model."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.positions import watch_positions
from tests.support.tensor_parallel_cases import batch, make_model
from tnlg.modeling.pipeline import DroppedModule, split_pipeline, stage_layers
from tnlg.sharding.parallel import rank_stages


@pytest.mark.parametrize(
    ("layers", "stages", "sizes"),
    [
        (105, 35, [3] * 35),  # MT-NLG: 3 layers per stage
        (78, 4, [19, 20, 20, 19]),  # T-NLG over 4 stages: the extra layers go between first and last
        (10, 4, [2, 3, 3, 2]),
        (5, 2, [3, 2]),
        (4, 1, [4]),
    ],
)
def test_stage_layers_are_contiguous_and_as_even_as_the_count_allows(layers, stages, sizes):
    runs = stage_layers(layers, stages)
    assert [len(run) for run in runs] == sizes
    assert [i for run in runs for i in run] == list(range(layers))


def test_more_stages_than_layers_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"3 pipeline stages need at least one layer each.*2 layers"):
        stage_layers(2, 3)


def test_interleaved_stages_are_looped_over_the_ranks():
    assert rank_stages(1, 4, 2) == [1, 5]
    assert rank_stages(0, 2, 3) == [0, 2, 4]


def _chain(model: torch.nn.Module, num_stages: int, ids: torch.Tensor, labels: torch.Tensor):
    """Each stage cut from its own copy of `model`, run one after the other; the loss and the copies."""
    copies = [copy.deepcopy(model) for _ in range(num_stages)]
    splits = [split_pipeline(c, [s], num_stages) for s, c in enumerate(copies)]
    hidden = ids
    for split in splits:
        hidden = split.stages[0](hidden)
    return splits[-1].loss(hidden, labels), copies, splits


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_chained_compute_the_whole_models_loss_and_gradients(num_stages):
    model = make_model(num_hidden_layers=3)
    ids, labels = batch()
    expected = model(ids, labels=labels).loss
    expected.backward()
    loss, copies, _ = _chain(model, num_stages, ids, labels)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    whole = dict(model.named_parameters())
    seen = set()
    for stage_copy in copies:
        for name, param in stage_copy.named_parameters():
            seen.add(name)
            if name != "model.embed_tokens.weight":  # tied: checked below
                torch.testing.assert_close(param.grad, whole[name].grad, atol=1e-6, rtol=0, msg=name)
    # The tied embedding's gradient is the sum of the first stage's (lookup) and last stage's (head).
    tied = copies[0].model.embed_tokens.weight.grad + copies[-1].model.embed_tokens.weight.grad
    torch.testing.assert_close(tied, whole["model.embed_tokens.weight"].grad, atol=1e-6, rtol=0)
    assert seen == set(whole)  # every parameter on some stage, under the whole model's name


def test_a_stage_keeps_the_whole_models_names_and_drops_the_rest():
    model = make_model(num_hidden_layers=4)
    split = split_pipeline(model, [1], 2)
    names = {name for name, _ in model.named_parameters()}
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"2", "3"}
    assert "model.final_layernorm.weight" in names and "model.embed_positions.weight" not in names
    # Tied: the last stage keeps the token embedding as its head's weight, and says it shares it.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert split.shared == {"model.embed_tokens.weight": [0, 1]}
    assert isinstance(model.model.layers[0], DroppedModule)
    with pytest.raises(
        RuntimeError, match=r"model\.embed_positions is not on this rank: it holds pipeline stages"
    ):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_untied_heads_share_nothing_and_the_last_stage_has_no_token_embedding():
    model = make_model(num_hidden_layers=2, tie_word_embeddings=False)
    split = split_pipeline(model, [1], 2)
    assert split.shared == {}
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([2], r"pipeline stages \[2\] are not distinct stages of 0..1"),
        ([], "not distinct"),
        ([0, 0], "not distinct"),
    ],
)
def test_bad_stage_lists_are_named(stages, message):
    with pytest.raises(ValueError, match=message):
        split_pipeline(make_model(), stages, 2)


def test_splitting_twice_or_a_model_without_layers_is_refused():
    model = make_model()
    split_pipeline(model, [0], 2)
    with pytest.raises(RuntimeError, match="already cut into pipeline stages"):
        split_pipeline(model, [0], 2)
    with pytest.raises(ValueError, match="needs a TNLGForCausalLM, got Linear"):
        split_pipeline(torch.nn.Linear(2, 2), [0], 2)


def test_a_stage_searches_only_the_callers_positions_for_packed_sequences(monkeypatch):
    """As the whole model (test_modeling.py): the positions a stage counts itself hold one sequence a
    row, so neither the mask nor the blocks are handed them to search for packed ones."""
    model = make_model(num_hidden_layers=2)
    seen = watch_positions(monkeypatch, model.model.layers[0])
    stage = split_pipeline(model, [0], 2).stages[0]
    ids, _ = batch()
    counted = stage(ids)
    assert seen.searched == [] and seen.block_given == [None]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    given = stage(ids, position_ids=positions)
    assert len(seen.searched) == 1 and seen.block_given[1] is positions
    torch.testing.assert_close(given, counted, rtol=0, atol=0)
