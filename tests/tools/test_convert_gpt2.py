"""GPT-2 → TNLG: the converted model computes the same function as GPT2LMHeadModel."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, GPT2LMHeadModel

from scripts.convert_checkpoint import main as convert_main
from tnlg import TNLGForCausalLM
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.modeling import CheckpointMismatchError
from tnlg.modeling.transformers_compat import cache_kwarg, output_cache
from tnlg.tools.convert import from_gpt2

VOCAB = 300


def random_gpt2(tie: bool = True, implementation: str = "eager") -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=3,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tie,
    )
    model = GPT2LMHeadModel._from_config(config, attn_implementation=implementation).eval()
    with torch.no_grad():  # move LayerNorms and biases off their 1/0 init so a mix-up would show
        for name, parameter in model.named_parameters():
            if "ln_" in name or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_logits_equal_gpt2(implementation):
    gpt2 = random_gpt2(implementation=implementation)
    tnlg = from_gpt2(gpt2)
    tnlg.set_attn_implementation(implementation)
    input_ids = torch.randint(0, VOCAB, (3, 40))
    mask = torch.ones_like(input_ids)
    mask[2, :6] = 0
    torch.testing.assert_close(tnlg(input_ids).logits, gpt2(input_ids).logits, atol=1e-5, rtol=0)
    # Padded batches: compare where tokens are real (GPT-2 uses plain positions, TNLG counts from the
    # mask, so give GPT-2 the same positions explicitly).
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    expected = gpt2(input_ids, attention_mask=mask, position_ids=positions).logits
    got = tnlg(input_ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=0)


def test_cached_generation_equals_gpt2():
    gpt2 = random_gpt2()
    tnlg = from_gpt2(gpt2)
    input_ids = torch.randint(1, VOCAB, (2, 7))
    config = GenerationConfig(
        max_new_tokens=15, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None
    )
    assert torch.equal(
        tnlg.generate(input_ids, generation_config=config), gpt2.generate(input_ids, generation_config=config)
    )
    # Step-by-step cached logits too, not only their argmax.
    tnlg_out = tnlg(input_ids, use_cache=True)
    gpt2_out = gpt2(input_ids, use_cache=True)
    next_ids = torch.randint(1, VOCAB, (2, 1))
    torch.testing.assert_close(
        tnlg(next_ids, **cache_kwarg(output_cache(tnlg_out)), use_cache=True).logits,
        gpt2(next_ids, **cache_kwarg(output_cache(gpt2_out)), use_cache=True).logits,
        atol=1e-5,
        rtol=0,
    )


def test_converted_model_does_not_share_storage_with_gpt2():
    gpt2 = random_gpt2()
    tnlg = from_gpt2(gpt2)
    with torch.no_grad():
        tnlg.model.final_layernorm.weight.zero_()
    assert gpt2.transformer.ln_f.weight.abs().sum() > 0


def test_untied_output_layer_is_kept():
    gpt2 = random_gpt2(tie=False)
    with torch.no_grad():
        gpt2.lm_head.weight.copy_(torch.randn_like(gpt2.lm_head.weight) * 0.02)
    tnlg = from_gpt2(gpt2)
    assert not tnlg.config.tie_word_embeddings
    input_ids = torch.randint(0, VOCAB, (1, 10))
    torch.testing.assert_close(tnlg(input_ids).logits, gpt2(input_ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("file_format", ["safetensors", "bin"])
def test_from_a_checkpoint_directory(tmp_path, file_format):
    gpt2 = random_gpt2()
    if file_format == "safetensors":
        gpt2.save_pretrained(tmp_path, max_shard_size="50KB")
    else:
        gpt2.config.save_pretrained(tmp_path)
        torch.save(gpt2.state_dict(), tmp_path / "pytorch_model.bin")
    tnlg = from_gpt2(tmp_path)
    input_ids = torch.randint(0, VOCAB, (2, 12))
    torch.testing.assert_close(tnlg(input_ids).logits, gpt2(input_ids).logits, atol=1e-5, rtol=0)


def test_unsupported_gpt2_options_are_refused():
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, scale_attn_by_inverse_layer_idx=True)
    )
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        from_gpt2(gpt2)


def test_a_checkpoint_missing_tensors_lists_them(tmp_path):
    gpt2 = random_gpt2()
    state = gpt2.state_dict()
    del state["transformer.h.1.mlp.c_fc.bias"]
    gpt2.config.save_pretrained(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointMismatchError, match=r"missing \(1\): model\.layers\.1\.mlp\.fc_in\.bias"):
        from_gpt2(tmp_path)


@pytest.mark.parametrize("where", ["missing", "no-config", "a-file"])
def test_a_path_that_is_no_gpt2_directory_is_named_without_reaching_the_hub(tmp_path, where, monkeypatch):
    # a missing path was looked up on the hub; a directory without config.json read as GPT-2 small
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gpt2 = random_gpt2()
    torch.save(gpt2.state_dict(), tmp_path / "pytorch_model.bin")  # weights without their config
    path = {"missing": tmp_path / "absent", "no-config": tmp_path, "a-file": tmp_path / "pytorch_model.bin"}[
        where
    ]
    with pytest.raises(
        FileNotFoundError, match=r"is not a GPT-2 checkpoint directory: it holds no config.json"
    ):
        from_gpt2(path)


def test_pickled_objects_are_refused(tmp_path):
    gpt2 = random_gpt2()
    gpt2.config.save_pretrained(tmp_path)
    torch.save({"weights": gpt2.state_dict(), "evil": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="weights_only=True"):
        from_gpt2(tmp_path)


class _NotATensor:
    pass


def test_cli_writes_a_sharded_checkpoint_with_tokenizer(tmp_path):
    gpt2 = random_gpt2()
    source, output = tmp_path / "gpt2", tmp_path / "tnlg"
    gpt2.save_pretrained(source)
    byte_level_tokenizer().save_pretrained(source)
    convert_main(
        ["--from", "gpt2", "--input", str(source), "--output", str(output), "--max-shard-size", "50KB"]
    )
    assert (output / "model.safetensors.index.json").is_file()
    assert (output / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(output)
    assert type(loaded) is TNLGForCausalLM
    input_ids = torch.randint(0, VOCAB, (2, 12))
    torch.testing.assert_close(loaded(input_ids).logits, gpt2(input_ids).logits, atol=1e-5, rtol=0)


def test_the_script_names_an_unreadable_config_in_one_line(tmp_path, capsys, monkeypatch):
    # Transformers raises OSError for a config.json that is not JSON: a traceback before, exit 1
    from scripts.convert_checkpoint import main
    from tnlg.run.cli import exit_on_input_error

    monkeypatch.delenv("TNLG_TRACEBACK", raising=False)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exited:
        exit_on_input_error(main)(
            ["--from", "gpt2", "--input", str(tmp_path / "gpt2"), "--output", str(tmp_path / "out")]
        )
    error = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(error) == 1 and error[0].startswith("error: ")
    assert "config.json" in error[0] and not (tmp_path / "out").exists()


def test_an_empty_weight_file_is_named_as_empty(tmp_path):
    # torch's message was empty, and the advice to re-save the state dict alone did not apply
    random_gpt2().config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pytorch_model.bin is empty \(0 bytes\)"):
        from_gpt2(tmp_path)


def _gpt2_with_generation_settings() -> GPT2LMHeadModel:
    gpt2 = random_gpt2()
    gpt2.generation_config.update(max_new_tokens=4, repetition_penalty=1.5, no_repeat_ngram_size=2)
    return gpt2


def test_the_generation_config_comes_along(tmp_path):
    # It was dropped: generate() of the converted model ran to max_length with none of GPT-2's settings.
    gpt2 = _gpt2_with_generation_settings()
    gpt2.save_pretrained(tmp_path / "gpt2")
    convert_main(["--from", "gpt2", "--input", str(tmp_path / "gpt2"), "--output", str(tmp_path / "tnlg")])
    input_ids = torch.randint(1, VOCAB, (2, 6))
    expected = gpt2.generate(input_ids, pad_token_id=0)
    assert expected.shape[1] == 6 + 4
    for tnlg in (
        from_gpt2(gpt2),
        from_gpt2(tmp_path / "gpt2"),
        TNLGForCausalLM.from_pretrained(tmp_path / "tnlg"),
    ):
        settings = tnlg.generation_config
        assert (settings.max_new_tokens, settings.repetition_penalty, settings.no_repeat_ngram_size) == (
            4,
            1.5,
            2,
        )
        assert torch.equal(tnlg.generate(input_ids, pad_token_id=0), expected)


def test_generation_token_ids_outside_the_vocabulary_are_dropped_as_the_configs_are():
    # GPT2Config's default end-of-text id 50256 names no row of a 300-token vocabulary.
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=4, pad_token_id=7)
    gpt2 = GPT2LMHeadModel(config).eval()
    gpt2.generation_config.max_new_tokens = 3
    tnlg = from_gpt2(gpt2)
    assert tnlg.config.eos_token_id is None and tnlg.generation_config.eos_token_id is None
    assert tnlg.config.bos_token_id is None and tnlg.generation_config.bos_token_id is None
    assert tnlg.config.pad_token_id == tnlg.generation_config.pad_token_id == 7
    assert tnlg.generation_config.max_new_tokens == 3
    assert gpt2.generation_config.eos_token_id == 50256  # the caller's model is left as it was
