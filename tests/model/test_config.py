"""TNLGConfig: presets, validation, and the analytic parameter / FLOP counts."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig

from tnlg import TNLGConfig, TNLGForCausalLM


@pytest.mark.parametrize("name", sorted(TNLGConfig.presets()))
def test_analytic_parameter_count_matches_a_meta_model(name):
    config = TNLGConfig.from_preset(name)
    start = time.perf_counter()
    with torch.device("meta"):
        model = TNLGForCausalLM(config)
    elapsed = time.perf_counter() - start
    counted = sum(p.numel() for p in model.parameters())  # tied weights are yielded once
    assert counted == config.num_parameters()
    assert all(p.is_meta for p in model.parameters())
    # Building even the 530B model on meta must not allocate: a generous bound that a real
    # allocation of hundreds of GB could never meet.
    assert elapsed < 60


def test_untied_output_layer_is_counted():
    config = TNLGConfig.from_preset("debug", tie_word_embeddings=False)
    with torch.device("meta"):
        model = TNLGForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    assert config.num_parameters() - TNLGConfig.from_preset("debug").num_parameters() == 512 * 64


def test_published_sizes():
    tnlg17 = TNLGConfig.from_preset("tnlg-17b")
    mtnlg = TNLGConfig.from_preset("mt-nlg-530b")
    assert (tnlg17.num_hidden_layers, tnlg17.hidden_size, tnlg17.num_attention_heads) == (78, 4256, 28)
    assert (mtnlg.num_hidden_layers, mtnlg.hidden_size, mtnlg.num_attention_heads) == (105, 20480, 128)
    assert tnlg17.num_parameters() == pytest.approx(17.2e9, rel=0.005)
    assert mtnlg.num_parameters() == pytest.approx(530e9, rel=0.005)


def test_flops_per_token_matches_counted_training_flops():
    """6N + 12·L·T·H against the matmul FLOPs torch counts for one forward + backward."""
    config = TNLGConfig(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"  # plain matmuls, so every attention FLOP is counted
    model = TNLGForCausalLM(config)
    batch, seq_len = 2, 64
    input_ids = torch.randint(0, 1000, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids, labels=input_ids).loss.backward()
    counted_per_token = counter.get_total_flops() / (batch * seq_len)
    # The analytic count includes biases and LayerNorms (not matmul FLOPs): under 1% at this width.
    assert config.flops_per_token(seq_len) == pytest.approx(counted_per_token, rel=0.01)


def test_config_uses_standard_names_and_auto_config(debug_config):
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "layer_norm_epsilon",
        "tie_word_embeddings",
    ):
        assert hasattr(debug_config, name)
    assert debug_config.intermediate_size == 4 * debug_config.hidden_size
    fields = {k: v for k, v in debug_config.to_diff_dict().items() if k != "model_type"}
    again = AutoConfig.for_model("tnlg", **fields)
    assert isinstance(again, TNLGConfig)
    assert again.to_dict() == debug_config.to_dict()


def test_config_round_trips_through_json(tmp_path, debug_config):
    debug_config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, TNLGConfig)
    assert loaded.to_diff_dict() == debug_config.to_diff_dict()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 100, "num_attention_heads": 3}, "num_attention_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"hidden_dropout": 1.5}, "hidden_dropout"),
        ({"layer_norm_epsilon": 0.0}, "layer_norm_epsilon"),
        ({"hidden_act": "swish-ish"}, "hidden_act"),
        ({"hidden_act": "prelu"}, "hidden_act"),  # has weights the parameter count would miss
        ({"vocab_size": 1000, "bos_token_id": 50256}, "bos_token_id"),  # given, and it does not fit
        ({"vocab_size": 1000, "bos_token_id": 0, "eos_token_id": [0, 1000]}, "eos_token_id"),
    ],
)
def test_invalid_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TNLGConfig(**overrides)


def test_invalid_head_count_lists_allowed_values():
    with pytest.raises(ValueError, match=r"head counts that divide it: \[1, 2, 4, 5, 10, 20, 25, 50, 100\]"):
        TNLGConfig(hidden_size=100, num_attention_heads=3)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="tnlg-17b"):
        TNLGConfig.from_preset("gpt-5")


def test_config_mutated_after_construction_is_checked_by_the_model(debug_config):
    debug_config.num_attention_heads = 5
    with pytest.raises(ValueError, match="num_attention_heads"):
        TNLGForCausalLM(debug_config)
