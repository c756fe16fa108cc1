"""Loading a Transformers safetensors checkpoint straight into the engine's shards: each rank reads
only its slices, the values are exact at every stage, mismatches and damage are errors on every
rank, and the peak memory of a rank stays near what its shards hold."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from tests.support import meta_init_cases
from tests.support.pretrained_cases import SEED, load_error, load_sharded, peak_memory_of_loading
from tnlg import TNLGConfig, TNLGForCausalLM, TNLGModel
from tnlg.sharding import SafetensorsCheckpoint, ZeroConfig, init_weights, initialize, meta_from_pretrained
from tnlg.tools.spawn import run_distributed


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The debug model saved in several safetensors shards, and its state dict."""
    torch.manual_seed(3)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug")).eval()
    path = tmp_path_factory.mktemp("pretrained") / "model"
    model.save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path, model


def _row_overhead_bytes(model: TNLGForCausalLM) -> int:
    """The most a rank may read beyond its own elements: two rows of every matrix."""
    return sum(2 * (p.numel() // p.shape[0]) * 4 for p in model.parameters() if p.dim() > 1)


def _logits(model: TNLGForCausalLM) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_ranks_read_only_their_slices_and_hold_the_exact_values(saved, world_size):
    path, model = saved
    results = run_distributed(load_sharded, world_size, str(path), 3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(results[0]["state"][name], tensor), name
    assert torch.allclose(results[0]["logits"], _logits(model), rtol=1e-5, atol=1e-6)
    total = sum(p.numel() * 4 for p in model.parameters())  # the tied output layer is stored once
    for result in results:
        assert total / world_size <= result["bytes_read"] <= total / world_size + _row_overhead_bytes(model)
        assert result["master_bytes"] <= total / world_size + 4 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_that_keep_whole_parameters_load_the_exact_values(saved, stage):
    path, model = saved
    result = run_distributed(load_sharded, 2, str(path), stage)[0]
    for name, tensor in model.state_dict().items():
        assert torch.equal(result["state"][name], tensor), name
    assert torch.allclose(result["logits"], _logits(model), rtol=1e-5, atol=1e-6)


def test_a_bf16_checkpoint_loads_into_fp32_master_weights(saved, tmp_path):
    _, model = saved
    half = TNLGForCausalLM(model.config).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    half.save_pretrained(tmp_path)
    result = load_sharded(0, 1, str(tmp_path), 3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(result["state"][name], tensor.to(torch.bfloat16).float()), name


def test_a_base_model_checkpoint_loads_into_the_model_with_its_tied_head(saved, tmp_path):
    _, model = saved
    base = TNLGModel(model.config)
    base.load_state_dict(model.model.state_dict())
    base.save_pretrained(tmp_path)
    assert not any(k.startswith("model.") for k in load_file(tmp_path / "model.safetensors"))
    result = load_sharded(0, 1, str(tmp_path), 3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(result["state"][name], tensor), name


def test_loads_the_same_values_as_from_pretrained_from_a_single_file(saved, tmp_path):
    _, model = saved
    model.save_pretrained(tmp_path)  # one model.safetensors, no index
    assert (tmp_path / "model.safetensors").is_file()
    loaded = TNLGForCausalLM.from_pretrained(tmp_path)
    result = load_sharded(0, 1, str(tmp_path), 2)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(result["state"][name], tensor), name


def _edited_copy(saved_path, tmp_path, edit) -> str:
    """The checkpoint as one file, with `edit(tensors)` applied."""
    tensors = {}
    for file in saved_path.glob("model-*.safetensors"):
        tensors.update(load_file(file))
    edit(tensors)
    (tmp_path / "config.json").write_text((saved_path / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return str(tmp_path)


def test_a_missing_tensor_is_an_error_naming_it_unless_not_strict(saved, tmp_path):
    path, model = saved
    edited = _edited_copy(path, tmp_path, lambda t: t.pop("model.layers.1.mlp.fc_out.weight"))
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.mlp\.fc_out\.weight"):
        load_sharded(0, 1, edited, 3)
    result = load_sharded(0, 1, edited, 3, strict=False)
    reference = TNLGForCausalLM(model.config)
    init_weights(reference, SEED)  # what the seeded initialization gives that parameter anywhere
    for name, tensor in model.state_dict().items():
        expected = reference.state_dict()[name] if name == "model.layers.1.mlp.fc_out.weight" else tensor
        assert torch.equal(result["state"][name], expected), name


def test_unexpected_and_mis_shaped_tensors_are_errors_naming_them(saved, tmp_path):
    path, _ = saved

    def edit(tensors):
        tensors["model.layers.9.extra.weight"] = torch.zeros(3)
        tensors["model.final_layernorm.bias"] = torch.zeros(65)

    edited = _edited_copy(path, tmp_path, edit)
    with pytest.raises(ValueError) as error:
        load_sharded(0, 1, edited, 3)
    assert "unexpected: model.layers.9.extra.weight" in str(error.value)
    assert "model.final_layernorm.bias: saved [65], model [64]" in str(error.value)


def test_a_saved_output_layer_that_differs_from_the_tied_embedding_is_refused(saved, tmp_path):
    path, _ = saved

    def edit(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["lm_head.weight"][-1, -1] += 1.0  # only the last rank's slice differs

    edited = _edited_copy(path, tmp_path, edit)
    errors = run_distributed(load_error, 2, edited)
    assert all("lm_head.weight differs from model.embed_tokens.weight" in e for e in errors), errors


def test_an_equal_saved_output_layer_is_accepted(saved, tmp_path):
    path, model = saved
    edited = _edited_copy(
        path, tmp_path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone())
    )
    result = load_sharded(0, 1, edited, 3)
    assert torch.equal(result["state"]["lm_head.weight"], model.state_dict()["lm_head.weight"])


@pytest.mark.slow
def test_a_damaged_shard_fails_on_every_rank_without_a_hang(saved, tmp_path):
    path, _ = saved
    damaged = tmp_path / "model"
    damaged.mkdir()
    for file in path.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    victim = sorted(damaged.glob("model-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:50])  # truncated inside the header
    errors = run_distributed(load_error, 2, str(damaged))
    assert all(victim.name in e and "cannot be read as safetensors" in e for e in errors), errors

    victim.unlink()
    errors = run_distributed(load_error, 2, str(damaged))
    assert all(f"{victim.name} is missing" in e for e in errors), errors


def test_a_directory_without_safetensors_is_an_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors only"):
        SafetensorsCheckpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"model-00001-of-00001\.safetensors is missing"):
        SafetensorsCheckpoint(tmp_path)


def test_read_flat_reads_the_covering_rows_only(tmp_path):
    tensor = torch.arange(7 * 5 * 3, dtype=torch.float32).reshape(7, 5, 3)
    save_file({"t": tensor, "v": torch.arange(10.0)}, tmp_path / "model.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path)
    try:
        for start, end in [(0, 1), (14, 16), (15, 30), (29, 31), (0, 105), (100, 105)]:
            before = checkpoint.bytes_read
            part = checkpoint.read_flat("t", start, end)
            assert torch.equal(part, tensor.reshape(-1)[start:end])
            rows = math.ceil(end / 15) - start // 15
            assert checkpoint.bytes_read - before == rows * 15 * 4
        assert torch.equal(checkpoint.read_flat("v", 3, 7), torch.arange(3.0, 7.0))
    finally:
        checkpoint.close()


def test_a_model_that_already_has_weights_is_refused(saved):
    path, _ = saved
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    with pytest.raises(ValueError, match="needs a model built on the meta device"):
        initialize(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3), pretrained=path)


def test_config_overrides_reach_the_meta_model(saved):
    path, _ = saved
    model = meta_from_pretrained(TNLGForCausalLM, path, hidden_dropout=0.25)
    assert model.config.hidden_dropout == 0.25
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for resident memory")
def test_peak_memory_per_rank_stays_near_its_shard(tmp_path):
    """4 ranks at stage 3 load a 160 MB (fp32) model. Loading into the shards must peak near what the
    engine keeps (fp32 master, 16-bit shard and gradient shard: about 80 MB); the naive way, the
    whole model on every rank then sharded, is measured side by side and peaks above the full model."""
    config = TNLGConfig.from_preset(
        "debug",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        vocab_size=32000,
        max_position_embeddings=256,
    )
    model = TNLGForCausalLM(config)
    full_mb = model.num_parameters() * 4 / 2**20
    model.save_pretrained(tmp_path, max_shard_size="32MB")
    del model
    for rank, result in enumerate(run_distributed(peak_memory_of_loading, 4, str(tmp_path), timeout=300)):
        sharded, naive = result["sharded"], result["naive"]
        assert naive["peak_mb"] >= full_mb, (rank, result)  # the measurement sees a whole model
        assert sharded["peak_mb"] <= 1.15 * sharded["engine_mb"] + 8, (rank, result)
        assert sharded["peak_mb"] < 0.6 * full_mb, (rank, result)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Transformers Llama saved: its rotary inv_freq / original_inv_freq are non-persistent
    buffers, so the checkpoint does not hold them."""
    path = tmp_path_factory.mktemp("llama")
    meta_init_cases.build("llama", meta=False).save_pretrained(path)
    return path


@pytest.mark.parametrize("stage", [0, 3])
def test_a_llama_gets_the_buffers_and_the_loss_of_from_pretrained(saved_llama, stage):
    model = meta_from_pretrained(LlamaForCausalLM, saved_llama)
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=stage))
    expected = LlamaForCausalLM.from_pretrained(saved_llama)
    for name, buffer in expected.named_buffers():
        assert torch.equal(dict(engine.module.named_buffers())[name], buffer), name
    ids = meta_init_cases.ids()
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=ids).loss.item()
        assert loss == pytest.approx(expected(input_ids=ids, labels=ids).loss.item(), rel=1e-6)


def test_a_meta_buffer_that_no_initializer_writes_is_refused_by_name(tmp_path):
    meta_init_cases.LlamaWithScratch(meta_init_cases.CONFIGS["llama"]()).save_pretrained(tmp_path)
    model = meta_from_pretrained(meta_init_cases.LlamaWithScratch, tmp_path)
    with pytest.raises(
        ValueError, match=r"no initializer gives these meta-device tensors a value: scratch\."
    ):
        initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=3))
