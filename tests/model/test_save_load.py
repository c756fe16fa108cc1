"""save_pretrained / from_pretrained: sharded safetensors, bit-exact reload, strict mismatch errors."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
from accelerate import infer_auto_device_map
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from tnlg import TNLGConfig, TNLGForCausalLM, TNLGModel
from tnlg.modeling import CheckpointFileError, CheckpointMismatchError


@pytest.fixture
def saved(tmp_path, debug_model):
    debug_model.save_pretrained(tmp_path, max_shard_size="100KB")
    return tmp_path


def test_sharded_save_writes_an_index_and_reloads_bit_exactly(saved, debug_model):
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((saved / shard).is_file() for shard in shards)
    assert not list(saved.glob("*.bin"))
    for loader in (TNLGForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        loaded = loader(saved)
        assert type(loaded) is TNLGForCausalLM
        original = debug_model.state_dict()
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, original[name]), name
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_base_model_loads_from_a_causal_lm_checkpoint(saved, debug_model):
    base = TNLGModel.from_pretrained(saved)
    assert torch.equal(base.layers[1].mlp.fc_in.weight, debug_model.model.layers[1].mlp.fc_in.weight)


def test_dtype_is_honoured(saved):
    assert TNLGForCausalLM.from_pretrained(saved, dtype=torch.bfloat16).dtype == torch.bfloat16


def _edit_shard_holding(directory, name, edit):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"][name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    (directory / "tnlg_checksums.json").unlink()  # the edit is deliberate: not what the checksums catch


def test_missing_and_unexpected_tensors_fail_with_a_list(saved):
    def edit(tensors):
        tensors.pop("model.layers.0.mlp.fc_in.bias")
        tensors["model.layers.0.mlp.surprise"] = torch.zeros(3)

    _edit_shard_holding(saved, "model.layers.0.mlp.fc_in.bias", edit)
    with pytest.raises(CheckpointMismatchError) as raised:
        TNLGForCausalLM.from_pretrained(saved)
    message = str(raised.value)
    assert "missing (1): model.layers.0.mlp.fc_in.bias" in message
    assert "unexpected (1): model.layers.0.mlp.surprise" in message
    # strict=False keeps Transformers' behaviour for those who want it.
    _, info = TNLGForCausalLM.from_pretrained(saved, strict=False, output_loading_info=True)
    assert info["missing_keys"] == {"model.layers.0.mlp.fc_in.bias"}


def test_mis_shaped_tensor_fails(saved):
    def edit(tensors):
        tensors["model.layers.1.self_attn.out_proj.weight"] = torch.zeros(64, 32)

    _edit_shard_holding(saved, "model.layers.1.self_attn.out_proj.weight", edit)
    with pytest.raises(CheckpointMismatchError) as raised:
        TNLGForCausalLM.from_pretrained(saved)
    assert "mis-shaped: model.layers.1.self_attn.out_proj.weight has shape [64, 32]" in str(raised.value)
    assert "the model expects [64, 64]" in str(raised.value)
    # Both ways to load it anyway, as Transformers does, are named.
    assert "strict=False" in str(raised.value) and "ignore_mismatched_sizes=True" in str(raised.value)


def test_an_explicit_ignore_mismatched_sizes_re_initialises_mis_shaped_tensors(saved, debug_model):
    # It was overridden: the load raised as if the caller had not asked, unlike Transformers' (GPT-2's).
    loaded, info = TNLGForCausalLM.from_pretrained(
        saved, vocab_size=600, ignore_mismatched_sizes=True, output_loading_info=True
    )
    assert loaded.model.embed_tokens.weight.shape == (600, 64)
    assert [name for name, *_ in info["mismatched_keys"]] == ["model.embed_tokens.weight"]  # reported
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.layers[1].mlp.fc_in.weight, debug_model.model.layers[1].mlp.fc_in.weight)
    without_info = TNLGForCausalLM.from_pretrained(saved, vocab_size=600, ignore_mismatched_sizes=True)
    assert without_info.model.embed_tokens.weight.shape == (600, 64)


def test_ignore_mismatched_sizes_still_refuses_missing_tensors(saved):
    _edit_shard_holding(
        saved, "model.layers.0.mlp.fc_in.bias", lambda t: t.pop("model.layers.0.mlp.fc_in.bias")
    )
    with pytest.raises(
        CheckpointMismatchError, match=r"missing \(1\): model\.layers\.0\.mlp\.fc_in\.bias"
    ) as raised:
        TNLGForCausalLM.from_pretrained(saved, vocab_size=600, ignore_mismatched_sizes=True)
    assert "mis-shaped:" not in str(raised.value)  # asked for: re-initialised, not refused


@pytest.mark.parametrize("model_class", [TNLGForCausalLM, TNLGModel])
def test_a_gpt2_directory_is_refused_in_one_line_naming_the_converter(tmp_path, model_class):
    # Its config was read as a TNLG one, and the error listed every tensor (6,668 characters).
    GPT2LMHeadModel(
        GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    ).save_pretrained(tmp_path)
    with pytest.raises(CheckpointFileError) as raised:
        model_class.from_pretrained(tmp_path)
    message = str(raised.value)
    assert "\n" not in message and "'gpt2' model's config" in message
    assert "tnlg.tools.convert.from_gpt2" in message and "convert_checkpoint.py --from gpt2" in message


def test_a_config_naming_no_model_type_loads_as_in_transformers(saved, debug_model):
    config = json.loads((saved / "config.json").read_text())
    del config["model_type"]
    (saved / "config.json").write_text(json.dumps(config))
    loaded = TNLGForCausalLM.from_pretrained(saved)
    assert torch.equal(loaded.model.embed_tokens.weight, debug_model.model.embed_tokens.weight)


def test_device_map_auto_loads(saved, debug_model):
    model = TNLGForCausalLM.from_pretrained(saved, device_map="auto")
    input_ids = torch.randint(0, 512, (1, 10))
    torch.testing.assert_close(model(input_ids).logits, debug_model(input_ids).logits)


def test_device_maps_never_split_a_block():
    """With a memory budget that ends mid-block, blocks move whole (`_no_split_modules`)."""
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug", num_hidden_layers=4))
    budget = {"cpu": 600_000, "disk": 10**9}  # embeddings + one and a half blocks
    split = infer_auto_device_map(model, max_memory=budget)
    assert any(re.fullmatch(r"model\.layers\.\d+\..+", name) for name in split)  # the budget does cut a block
    whole = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules)
    layer_entries = [name for name in whole if name.startswith("model.layers")]
    assert layer_entries and all(re.fullmatch(r"model\.layers(\.\d+)?", name) for name in layer_entries)


def test_base_model_loads_from_an_untied_checkpoint(tmp_path):
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug", tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    base = TNLGModel.from_pretrained(tmp_path)
    assert torch.equal(base.embed_tokens.weight, model.model.embed_tokens.weight)
    loaded = TNLGForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_untied_weights_under_a_tied_config_are_refused(tmp_path):
    TNLGForCausalLM(TNLGConfig.from_preset("debug", tie_word_embeddings=False)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError, match=r"lm_head\.weight differs"):
        TNLGForCausalLM.from_pretrained(tmp_path)


def test_hub_kernels_stay_off_unless_asked_for(saved, monkeypatch):
    """Transformers 5.25 turned `use_kernels` on by default (a Hub download on CUDA at load); the
    model passes False unless the caller asks, and passes the caller's choice on."""
    from transformers import PreTrainedModel

    asked = []
    load = PreTrainedModel.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        asked.append(kwargs.get("use_kernels"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recording))
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert asked == [False] and not model.use_kernels
    # On this CPU machine the `kernels` package is absent (or has no CPU kernel): asking for them
    # reaches Transformers, which answers for itself.
    with contextlib.suppress(ValueError, ImportError):
        TNLGForCausalLM.from_pretrained(saved, use_kernels=True)
    assert asked[1:] == [True]
