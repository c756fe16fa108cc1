"""Partitioned construction: a meta-device model materializes only each rank's shards, with the values
the unsharded seeded initialization gives, at every world size and stage."""

from __future__ import annotations

import pytest
import torch

from tests.support.zero_models import AwkwardModel, batches, local, make_optimizer
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, init_weights, initialize
from tnlg.tools.spawn import run_distributed

SEED = 11


def _meta_tnlg() -> TNLGForCausalLM:
    with torch.device("meta"):
        return TNLGForCausalLM(TNLGConfig.from_preset("debug"))


def _materialized_state(rank: int, world_size: int, stage: int) -> dict:
    model = _meta_tnlg()
    engine = initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        ZeroConfig(stage=stage, param_persistence_threshold=100),
        init_seed=SEED,
    )
    return {"state": engine.full_state_dict(), "memory": engine.memory_stats()}


def _train_meta_awkward(rank: int, world_size: int, stage: int) -> list[float]:
    with torch.device("meta"):
        model = AwkwardModel()
    engine = initialize(
        model, make_optimizer(model), ZeroConfig(stage=stage, param_persistence_threshold=20), init_seed=SEED
    )
    losses = []
    for batch in batches(3):
        loss = engine(*local(batch, rank, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "stage"), [(1, 3), (2, 1), (2, 3)])
def test_shards_hold_the_unsharded_seeded_values(world_size, stage):
    result = run_distributed(_materialized_state, world_size, stage)[0]
    reference = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    init_weights(reference, SEED)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(result["state"][name], tensor), name
    if stage == 3 and world_size == 2:  # each rank built only its half of the sharded parameters
        assert result["memory"]["master"] <= reference.num_parameters() * 4 // 2 + 4 * 1024


def test_seeded_init_follows_the_model_init_rules():
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    init_weights(model, SEED)
    block = model.model.layers[1]
    assert torch.equal(block.input_layernorm.weight, torch.ones(64))
    assert block.mlp.fc_in.bias.abs().max() == 0
    assert block.self_attn.out_proj.weight.std() < block.self_attn.qkv_proj.weight.std()  # depth-scaled
    other = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    init_weights(other, SEED + 1)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.slow
def test_a_meta_model_trains_like_the_same_model_built_unsharded():
    """Frozen layer, tied embedding, odd sizes: materialized on 2 ranks at stage 3, then trained;
    rank 0's losses (on its half of each batch) equal those of the unsharded seeded model trained on
    the whole batch, evaluated on that half."""
    losses = run_distributed(_train_meta_awkward, 2, 3)[0]
    model = AwkwardModel()
    init_weights(model, SEED)
    optimizer = make_optimizer(model)
    expected = []
    for batch in batches(3):
        with torch.no_grad():
            expected.append(model(*local(batch, 0, 2)).item())
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses == pytest.approx(expected, rel=1e-5)
