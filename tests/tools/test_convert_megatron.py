"""Megatron-LM GPT → TNLG, for Megatron-core and legacy names, tensor and pipeline parallel shards."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from scripts.convert_checkpoint import main as convert_main
from tests.support.megatron_cases import HEADS, VOCAB, assert_same_function, megatron_source_gpt2
from tests.support.megatron_layout import megatron_shards, save_megatron_checkpoint
from tnlg import TNLGForCausalLM
from tnlg.tools.convert import from_megatron, read_megatron_checkpoint


@pytest.fixture
def gpt2() -> GPT2LMHeadModel:
    return megatron_source_gpt2()


@pytest.mark.parametrize("style", ["core", "te", "legacy"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_merge_to_gpt2(gpt2, style, tp):
    shards = megatron_shards(gpt2, style=style, tp=tp)
    tnlg = from_megatron(
        [shards[(rank, 0)] for rank in range(tp)], num_attention_heads=HEADS, vocab_size=VOCAB
    )
    assert tnlg.config.vocab_size == VOCAB and tnlg.config.tie_word_embeddings
    assert_same_function(tnlg, gpt2)


@pytest.mark.parametrize("version", [0, 1.0, 2.0, 3.0])
def test_legacy_qkv_orderings(gpt2, version):
    shards = megatron_shards(gpt2, style="legacy", tp=2, version=version)
    tnlg = from_megatron(
        [shards[(0, 0)], shards[(1, 0)]],
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        checkpoint_version=version,
    )
    assert_same_function(tnlg, gpt2)


def test_wrong_qkv_order_would_be_caught(gpt2):
    """The check has teeth: reading a v3 checkpoint as v0 gives a different function."""
    shards = megatron_shards(gpt2, style="legacy", version=3.0)
    wrong = from_megatron(shards[(0, 0)], num_attention_heads=HEADS, vocab_size=VOCAB, checkpoint_version=0)
    with pytest.raises(AssertionError):
        assert_same_function(wrong, gpt2)


@pytest.mark.parametrize("style", ["core", "legacy"])
def test_checkpoint_directory_with_tensor_and_pipeline_parallelism(tmp_path, gpt2, style):
    shards = megatron_shards(gpt2, style=style, tp=2, pp=2)
    save_megatron_checkpoint(shards, tmp_path, num_heads=HEADS)
    # Heads and epsilon come from the saved args; the padded vocabulary (384 rows) is trimmed.
    tnlg = from_megatron(tmp_path, vocab_size=VOCAB)
    assert tnlg.config.num_hidden_layers == 4 and tnlg.config.tie_word_embeddings
    assert_same_function(tnlg, gpt2)


def test_padded_vocabulary_is_kept_without_vocab_size(gpt2):
    tnlg = from_megatron(megatron_shards(gpt2)[(0, 0)], num_attention_heads=HEADS)
    assert tnlg.config.vocab_size == 384
    input_ids = torch.randint(0, VOCAB, (1, 10))
    torch.testing.assert_close(tnlg(input_ids).logits[..., :VOCAB], gpt2(input_ids).logits, atol=1e-5, rtol=0)


def test_cli_converts_a_megatron_directory(tmp_path, gpt2):
    save_megatron_checkpoint(megatron_shards(gpt2, tp=2), tmp_path / "megatron", num_heads=HEADS)
    output = tmp_path / "tnlg"
    convert_main(
        [
            "--from",
            "megatron",
            "--input",
            str(tmp_path / "megatron"),
            "--output",
            str(output),
            "--vocab-size",
            str(VOCAB),
        ]
    )
    assert_same_function(TNLGForCausalLM.from_pretrained(output), gpt2)


def test_unknown_tensors_are_listed(gpt2):
    shard = dict(megatron_shards(gpt2)[(0, 0)])
    shard["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match=r"q_layernorm"):
        from_megatron(shard, num_attention_heads=HEADS)


def test_heads_are_required_without_args(gpt2):
    with pytest.raises(ValueError, match="num_attention_heads"):
        from_megatron(megatron_shards(gpt2)[(0, 0)])


def test_wrong_head_count_is_refused(gpt2):
    with pytest.raises(ValueError, match="num_attention_heads"):
        from_megatron(megatron_shards(gpt2)[(0, 0)], num_attention_heads=5)


def test_rotary_models_are_refused(gpt2):
    shard = dict(megatron_shards(gpt2)[(0, 0)])
    del shard["embedding.position_embeddings.weight"]
    with pytest.raises(ValueError, match="position embeddings"):
        from_megatron(shard, num_attention_heads=HEADS)


def test_missing_rank_file_is_named(tmp_path, gpt2):
    shards = megatron_shards(gpt2, tp=2, pp=2)
    del shards[(1, 1)]
    save_megatron_checkpoint(shards, tmp_path, num_heads=HEADS)
    with pytest.raises(ValueError, match=r"\(1, 1\)"):
        from_megatron(tmp_path)


def test_a_missing_last_tensor_rank_is_named_by_the_saved_args(tmp_path, gpt2):
    # without the args the sizes came from the directories present: a tensor-1 model, a shape error later
    shards = megatron_shards(gpt2, tp=2, pp=2)
    del shards[(1, 0)], shards[(1, 1)]
    save_megatron_checkpoint(
        shards, tmp_path, num_heads=HEADS, tensor_model_parallel_size=2, pipeline_model_parallel_size=2
    )
    with pytest.raises(
        ValueError, match=r"lacks mp_rank_01_000, mp_rank_01_001: its saved args say tensor 2 x"
    ):
        from_megatron(tmp_path)


def test_a_damaged_iteration_file_is_named(tmp_path, gpt2):
    save_megatron_checkpoint(megatron_shards(gpt2), tmp_path, num_heads=HEADS)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("abc\n")
    with pytest.raises(ValueError, match=r"latest_checkpointed_iteration.txt names neither an iteration nor"):
        from_megatron(tmp_path)


def test_unsupported_architecture_args_are_refused(tmp_path, gpt2):
    save_megatron_checkpoint(
        megatron_shards(gpt2), tmp_path, num_heads=HEADS, apply_residual_connection_post_layernorm=True
    )
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        from_megatron(tmp_path)


def test_activation_follows_the_saved_args(tmp_path, gpt2):
    save_megatron_checkpoint(megatron_shards(gpt2), tmp_path, num_heads=HEADS, bias_gelu_fusion=False)
    assert from_megatron(tmp_path, vocab_size=VOCAB).config.hidden_act == "gelu"  # exact GeLU without fusion


def test_the_script_takes_activation_and_epsilon_from_the_saved_args_unless_told(tmp_path, gpt2):
    save_megatron_checkpoint(
        megatron_shards(gpt2),
        tmp_path / "megatron",
        num_heads=HEADS,
        bias_gelu_fusion=False,
        layernorm_epsilon=1e-6,
    )
    common = ["--from", "megatron", "--input", str(tmp_path / "megatron"), "--vocab-size", str(VOCAB)]
    convert_main([*common, "--output", str(tmp_path / "saved")])
    config = TNLGForCausalLM.from_pretrained(tmp_path / "saved").config
    assert (config.hidden_act, config.layer_norm_epsilon) == ("gelu", 1e-6)
    convert_main(
        [
            *common,
            "--output",
            str(tmp_path / "told"),
            "--hidden-act",
            "gelu_new",
            "--layer-norm-epsilon",
            "1e-5",
        ]
    )
    config = TNLGForCausalLM.from_pretrained(tmp_path / "told").config
    assert (config.hidden_act, config.layer_norm_epsilon) == ("gelu_new", 1e-5)


def test_args_of_megatron_core_types_load_as_inert_data(tmp_path, gpt2):
    # megatron-core 0.19's args hold enums (exit_signal, in every fixture), paths and namespaces:
    # read as stubs, never as the live objects, and never refused.
    save_megatron_checkpoint(
        megatron_shards(gpt2), tmp_path, num_heads=HEADS,
        data_cache_path=Path("/data/cache"), tokenizer_args=types.SimpleNamespace(kind="gpt2"),
    )  # fmt: skip
    _, metadata = read_megatron_checkpoint(tmp_path)
    args = metadata["args"]
    assert type(args.exit_signal).__module__ == "tnlg.inert" and args.exit_signal.args == (15,)
    assert type(args.data_cache_path).__module__ == "tnlg.inert"
    assert_same_function(from_megatron(tmp_path, vocab_size=VOCAB), gpt2)
