"""Transformers' contracts the TNLG classes keep: `from_pretrained(None, config=, state_dict=)`, configs
built from defaults plus any valid field, and `output_loading_info=True` reporting instead of raising."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling import CheckpointMismatchError
from tnlg.tools.convert import from_gpt2, tnlg_config_from_gpt2


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    other = b.state_dict()
    return all(torch.equal(tensor, other[name]) for name, tensor in a.state_dict().items())


# ---------------------------------------------------------------------------------------------- no path
def test_from_pretrained_without_a_path_takes_the_config_and_state_dict(debug_config, debug_model):
    loaded = TNLGForCausalLM.from_pretrained(None, config=debug_config, state_dict=debug_model.state_dict())
    assert _same_weights(loaded, debug_model)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_from_pretrained_without_a_path_is_still_strict(debug_config, debug_model):
    state = debug_model.state_dict()
    state.pop("model.layers.0.mlp.fc_in.bias")
    with pytest.raises(
        CheckpointMismatchError, match=r"the state_dict given .*\n.*missing \(1\): model\.layers\.0"
    ):
        TNLGForCausalLM.from_pretrained(None, config=debug_config, state_dict=state)


def test_from_pretrained_without_a_path_refuses_an_untied_head_under_a_tied_config(debug_config, debug_model):
    state = {name: tensor.clone() for name, tensor in debug_model.state_dict().items()}
    state["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(CheckpointMismatchError, match=r"lm_head\.weight differs from the token embedding"):
        TNLGForCausalLM.from_pretrained(None, config=debug_config, state_dict=state)


# ---------------------------------------------------------------------------------------------- token ids
def test_a_small_vocabulary_drops_the_default_token_ids():
    config = TNLGConfig(vocab_size=100, hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    assert config.bos_token_id is None and config.eos_token_id is None
    TNLGForCausalLM(config)  # the model builds


def test_the_default_token_ids_stay_gpt2s_where_they_fit(tmp_path):
    config = TNLGConfig()
    assert config.bos_token_id == config.eos_token_id == 50256
    assert type(config.eos_token_id) is int  # the default's marker type does not leak into saves
    config.save_pretrained(tmp_path)
    reloaded = TNLGConfig.from_pretrained(tmp_path)
    assert reloaded.bos_token_id == reloaded.eos_token_id == 50256


def test_a_small_vocabulary_config_round_trips_without_token_ids(tmp_path):
    TNLGConfig(vocab_size=100).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] is None
    reloaded = TNLGConfig.from_pretrained(tmp_path)
    assert reloaded.bos_token_id is None and reloaded.eos_token_id is None


@pytest.mark.parametrize(
    ("field", "value"), [("bos_token_id", 50256), ("eos_token_id", 100), ("eos_token_id", [0, 100])]
)
def test_an_explicit_token_id_outside_the_vocabulary_is_an_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"TNLGConfig\.{field} .* is outside the vocabulary \[0, 100\)"):
        TNLGConfig(vocab_size=100, **{field: value})


def test_presets_keep_their_token_ids():
    assert TNLGConfig.from_preset("debug").eos_token_id == 511  # the last row of its 512
    assert TNLGConfig.from_preset("tnlg-125m").eos_token_id == 50256
    assert TNLGConfig.from_preset("debug", eos_token_id=None).eos_token_id is None


def test_gpt2_with_default_token_ids_outside_a_small_vocabulary_converts(caplog):
    gpt2_config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    assert gpt2_config.eos_token_id == 50256  # GPT2Config's default, whatever the vocabulary
    gpt2 = GPT2LMHeadModel(gpt2_config).eval()
    with caplog.at_level(logging.WARNING, logger="tnlg.tools.convert.gpt2"):
        tnlg = from_gpt2(gpt2)
    assert tnlg.config.bos_token_id is None and tnlg.config.eos_token_id is None
    assert "eos_token_id 50256 is outside its vocabulary of 100 tokens" in caplog.text
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(tnlg(ids).logits, gpt2(ids).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_token_ids_inside_the_vocabulary_are_kept():
    config = tnlg_config_from_gpt2(
        GPT2Config(vocab_size=100, n_embd=32, n_head=4, bos_token_id=1, eos_token_id=[2, 300], pad_token_id=3)
    )
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, [2], 3)


# ---------------------------------------------------------------------------------------------- loading info
@pytest.fixture
def edited(tmp_path, debug_model):
    """The debug model saved, then one tensor dropped, one added and one re-shaped."""
    debug_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("model.layers.0.mlp.fc_in.bias")
    tensors["model.layers.0.mlp.surprise"] = torch.zeros(3)
    tensors["model.final_layernorm.bias"] = torch.zeros(65)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "tnlg_checksums.json").unlink(missing_ok=True)  # the edit is deliberate
    return tmp_path


def test_output_loading_info_reports_the_mismatches_instead_of_raising(edited):
    model, info = TNLGForCausalLM.from_pretrained(edited, output_loading_info=True)
    assert isinstance(model, TNLGForCausalLM)
    assert set(info["missing_keys"]) == {"model.layers.0.mlp.fc_in.bias"}
    assert set(info["unexpected_keys"]) == {"model.layers.0.mlp.surprise"}
    assert [entry[0] for entry in info["mismatched_keys"]] == ["model.final_layernorm.bias"]


def test_strictness_stays_the_default_without_loading_info(edited):
    with pytest.raises(CheckpointMismatchError) as raised:
        TNLGForCausalLM.from_pretrained(edited)
    message = str(raised.value)
    assert "missing (1): model.layers.0.mlp.fc_in.bias" in message
    assert "unexpected (1): model.layers.0.mlp.surprise" in message
    assert "mis-shaped: model.final_layernorm.bias has shape [65]" in message


def test_output_loading_info_reports_an_untied_head_under_a_tied_config(tmp_path):
    TNLGForCausalLM(TNLGConfig.from_preset("debug", tie_word_embeddings=False)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, info = TNLGForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert any("lm_head.weight differs from the token embedding" in message for message in info["error_msgs"])


@pytest.mark.parametrize("kind", ["TNLG", "GPT-2"])
def test_the_trainers_label_smoothing_shifts_tnlgs_labels_as_gpt2s(tmp_path, kind):
    # The Trainer computes a smoothed loss from the logits itself, shifting the labels only for the
    # causal LMs Transformers lists by name: TNLG unlisted trained to repeat each token (5.78, not 6.25).
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=512)
    model = TNLGForCausalLM(tnlg_config_from_gpt2(config)) if kind == "TNLG" else GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=1e-6, report_to=[], use_cpu=True
    )
    trainer = Trainer(model=model.eval(), args=args)  # eval: no dropout between the two forwards
    with torch.no_grad():
        smoothed = trainer.compute_loss(model, {"input_ids": ids, "labels": ids})
        own = model(input_ids=ids, labels=ids).loss
    assert smoothed.item() == pytest.approx(own.item(), rel=1e-4)
