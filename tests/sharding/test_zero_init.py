"""Partitioned construction: a meta-device model materializes only each rank's shards, with the values
the unsharded seeded initialization gives, at every world size and stage."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.support import meta_init_cases
from tests.support.zero_models import AwkwardModel, batches, local, make_optimizer
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, init_weights, initialize, materialize
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


def _same_distribution(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal where the initialization is a constant (zero biases, unit norms), else the same mean and
    std within sampling noise (at least 4096 elements each: the std's relative noise is ~1%)."""
    if expected.std() == 0:
        assert torch.equal(got, expected), name
        return
    got, expected = got.float(), expected.float()
    assert got.std().item() == pytest.approx(expected.std().item(), rel=0.1), name
    assert abs(got.mean().item() - expected.mean().item()) < 0.1 * expected.std().item(), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "gpt_bigcode", "llama"])
def test_a_meta_transformers_model_gets_transformers_own_initialization(kind):
    """GPT-2 and GPTBigCode rescale c_proj in the rule of their attention / MLP modules, which own no
    parameter (the parent's rule runs after its children's, as in Transformers' initialize_weights);
    GPTBigCode's causal mask and Llama's rotary frequencies (non-persistent buffers) come from their
    rules too. Built on meta and materialized on 2 ranks at stages 0 and 3, each parameter has the
    distribution of the same model built normally, and each buffer its exact value."""
    results = run_distributed(meta_init_cases.materialized, 2, [kind], [0, 3], timeout=300)[0]
    reference = meta_init_cases.build(kind, meta=False)
    for stage in (0, 3):
        result = results[kind, stage]
        assert result["state"].keys() == reference.state_dict().keys()
        for name, tensor in reference.state_dict().items():
            _same_distribution(f"stage {stage}: {name}", result["state"][name], tensor)
        for name, buffer in reference.named_buffers():
            assert torch.equal(result["buffers"][name], buffer), (stage, name)
        assert result["loss"] == pytest.approx(math.log(meta_init_cases.VOCAB), rel=0.05)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _ParentRuled(nn.Module):
    """A parent module's rule that writes its child's weight through `.data` (Transformers 4 style),
    which bumps no version counter."""

    def __init__(self):
        super().__init__()
        self.block = _Residual()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, _Residual):
            module.proj.weight.data.fill_(0.5)


def test_a_parent_rule_writing_a_child_through_data_is_followed():
    with torch.device("meta"):
        model = _ParentRuled()
    values = {}
    materialize(model, SEED, torch.device("cpu"), lambda p, v: values.__setitem__(id(p), v))
    assert torch.equal(values[id(model.block.proj.weight)], torch.full((4, 4), 0.5))
    assert values[id(model.block.proj.bias)].abs().max() > 0  # the Linear's own rule still ran
    ordinary = _ParentRuled()
    init_weights(ordinary, SEED)
    assert torch.equal(ordinary.block.proj.weight, torch.full((4, 4), 0.5))
    assert torch.equal(ordinary.block.proj.bias, values[id(model.block.proj.bias)])


class _Wrapper(nn.Module):
    """A plain module around a Transformers model: the backbone brings its own _init_weights."""

    def __init__(self):
        super().__init__()
        self.backbone = meta_init_cases.CLASSES["llama"](meta_init_cases.CONFIGS["llama"]()).model
        self.head = nn.Linear(64, 3)


def test_a_sub_model_inside_a_plain_module_initializes_by_its_own_rule():
    with torch.device("meta"):
        model = _Wrapper()
    values = {}
    materialize(model, SEED, torch.device("cpu"), lambda p, v: values.__setitem__(id(p), v))
    reference = _Wrapper()
    assert torch.equal(values[id(model.backbone.norm.weight)], torch.ones(64))  # Llama's norm rule
    assert torch.equal(model.backbone.rotary_emb.inv_freq, reference.backbone.rotary_emb.inv_freq)
    assert values[id(model.head.weight)].abs().max() > 0  # the head: reset_parameters


class _ReadsItsValue(nn.Module):
    """A rule that reads a value (it cannot run on meta) and, on this value, writes nothing."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))

    def _init_weights(self, module: nn.Module) -> None:
        if module is self and module.scale.sum().item() > 1e30:
            module.scale.data.fill_(2.0)


def test_a_rule_that_cannot_run_on_meta_and_leaves_a_tensor_unwritten_is_refused():
    # It was handed on as uninitialized memory (with only a warning).
    with torch.device("meta"):
        model = _ReadsItsValue()
    with pytest.raises(ValueError, match=r"does not run on meta tensors and leaves \['scale'\] unwritten"):
        materialize(model, SEED, torch.device("cpu"), lambda p, v: None)
