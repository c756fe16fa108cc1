"""Megatron-LM → TNLG: what the saved args and checkpoint_version decide (which GeLU, the QKV order, the
heads, zero-centred gains) and what they refuse, checked against the GPT-2 the checkpoints are built from."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from scripts.convert_checkpoint import main as convert_main
from scripts.convert_checkpoint import parse_args
from tests.support.megatron_cases import HEADS, VOCAB, assert_same_function, megatron_source_gpt2
from tests.support.megatron_layout import megatron_shards, save_megatron_checkpoint
from tnlg.tools.convert import from_megatron


@pytest.fixture
def gpt2() -> GPT2LMHeadModel:
    return megatron_source_gpt2()


def save_checkpoint_files(shards: dict[tuple[int, int], dict], root: Path, **args) -> Path:
    """Megatron checkpoint files holding `model` and exactly `args` (none when empty) and no
    checkpoint_version, as Megatron saved them before 2020-09."""
    for (rank, _), state in shards.items():
        (root / "iter_0000010" / f"mp_rank_{rank:02d}").mkdir(parents=True)
        saved = {"model": state, "iteration": 10, **({"args": argparse.Namespace(**args)} if args else {})}
        torch.save(saved, root / "iter_0000010" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return root


# ---------------------------------------------------------------------------- checkpoint_version
@pytest.mark.parametrize("with_args", [True, False], ids=["2020 args", "no args"])
def test_a_checkpoint_without_a_version_is_read_as_version_0_like_megatron(tmp_path, gpt2, caplog, with_args):
    shards = megatron_shards(gpt2, style="legacy", tp=2, version=0)
    args = {"num_attention_heads": HEADS} if with_args else {}
    save_checkpoint_files(shards, tmp_path, **args)
    with caplog.at_level(logging.INFO, logger="tnlg.tools.convert.megatron_args"):
        tnlg = from_megatron(tmp_path, vocab_size=VOCAB, num_attention_heads=None if with_args else HEADS)
    assert_same_function(tnlg, gpt2)
    assert (
        "checkpoint_version 0: the checkpoint records none, and Megatron reads a missing version as 0"
        in caplog.text
    )


def test_megatron_core_qkv_rows_are_per_head_whatever_the_version(tmp_path, gpt2, caplog):
    # Megatron reorders legacy query_key_value rows only; a core checkpoint without a version is not v0.
    save_checkpoint_files(megatron_shards(gpt2, style="core", tp=2), tmp_path, num_attention_heads=HEADS)
    with caplog.at_level(logging.INFO, logger="tnlg.tools.convert.megatron_args"):
        assert_same_function(from_megatron(tmp_path, vocab_size=VOCAB), gpt2)
    assert "megatron-core linear_qkv rows are per head" in caplog.text


def test_the_version_option_serves_checkpoints_that_record_none(tmp_path, gpt2, caplog):
    save_checkpoint_files(megatron_shards(gpt2, style="legacy", tp=2), tmp_path, num_attention_heads=HEADS)
    with caplog.at_level(logging.INFO, logger="tnlg.tools.convert.megatron_args"):
        assert_same_function(from_megatron(tmp_path, vocab_size=VOCAB, checkpoint_version=3), gpt2)
    assert "checkpoint_version 3: given; the checkpoint records none" in caplog.text


# ---------------------------------------------------------------------------- options against the record
@pytest.mark.parametrize(
    ("option", "given", "recorded"),
    [("num_attention_heads", 2, 4), ("checkpoint_version", 1.0, 3.0)],
)
def test_an_option_contradicting_what_the_checkpoint_records_is_refused(
    tmp_path, gpt2, option, given, recorded
):
    # Both converted silently into another function (2 heads of 32; QKV rows read as [nh, hd, 3]).
    save_megatron_checkpoint(megatron_shards(gpt2, style="legacy", tp=2), tmp_path, num_heads=HEADS)
    message = rf"{option} {given!r} was given, but the checkpoint records {option} {recorded!r}"
    with pytest.raises(ValueError, match=message):
        from_megatron(tmp_path, vocab_size=VOCAB, **{option: given})
    assert_same_function(from_megatron(tmp_path, vocab_size=VOCAB, **{option: recorded}), gpt2)


def test_the_script_refuses_a_head_count_the_checkpoint_contradicts(tmp_path, gpt2):
    save_megatron_checkpoint(megatron_shards(gpt2), tmp_path / "megatron", num_heads=HEADS)
    flags = ["--from", "megatron", "--input", str(tmp_path / "megatron"), "--output", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"num_attention_heads 2 was given, but the checkpoint records"):
        convert_main([*flags, "--num-attention-heads", "2"])
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- numbers refused when read
@pytest.mark.parametrize("flag", ["--vocab-size", "--num-attention-heads"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_count_that_is_not_positive_is_refused_by_the_script(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--from", "megatron", "--input", "in", "--output", "out", flag, value])
    assert (
        exit_info.value.code == 2
        and f"argument {flag}: {value} is not a positive number" in capsys.readouterr().err
    )


@pytest.mark.parametrize("vocab_size", [0, -1])
def test_a_vocab_size_that_is_not_positive_is_refused_by_the_library(gpt2, vocab_size):
    # -1 cut the last row off (383 rows); 0 left an empty embedding
    with pytest.raises(ValueError, match=rf"vocab_size {vocab_size} is not a number of rows"):
        from_megatron(megatron_shards(gpt2)[(0, 0)], num_attention_heads=HEADS, vocab_size=vocab_size)


# ---------------------------------------------------------------------------- unsupported options
@pytest.mark.parametrize(
    "args",
    [
        {"use_rotary_position_embeddings": True},
        {"window_size": (4, 0)},
        {"softmax_type": "off-by-one"},
        {"use_mup": True},
        {"group_query_attention": True, "num_query_groups": 2},
        {"quick_geglu": True},
        {"disable_bias_linear": True},
    ],
    ids=lambda args: next(iter(args)),
)
def test_options_that_change_the_function_are_refused_by_name(tmp_path, gpt2, args):
    # The tensors have plain GPT-2 shapes: each of these converted silently into another function.
    save_megatron_checkpoint(megatron_shards(gpt2), tmp_path, num_heads=HEADS, **args)
    name = next(iter(args))
    with pytest.raises(
        ValueError, match=re.escape(f"options TNLG does not implement: {name}={args[name]!r}")
    ):
        from_megatron(tmp_path, vocab_size=VOCAB)


def test_grouped_query_attention_is_refused_before_the_shapes_are_looked_at(tmp_path, gpt2):
    shards = megatron_shards(gpt2)
    for name, tensor in shards[(0, 0)].items():
        if "linear_qkv" in name:  # 4 query heads, 2 key-value groups: (4 + 2 * 2) * 16 rows, not 3 * 64
            shards[(0, 0)][name] = tensor[:128]
    save_megatron_checkpoint(
        shards, tmp_path, num_heads=HEADS, group_query_attention=True, num_query_groups=2
    )
    with pytest.raises(ValueError, match=r"group_query_attention=True \(num_query_groups differs"):
        from_megatron(tmp_path, vocab_size=VOCAB)


def test_the_defaults_of_those_options_convert(tmp_path, gpt2):
    save_megatron_checkpoint(
        megatron_shards(gpt2), tmp_path, num_heads=HEADS, use_rotary_position_embeddings=False, window_size=None,
        softmax_type="vanilla", use_mup=False, group_query_attention=True, num_query_groups=HEADS,
        quick_geglu=False, disable_bias_linear=False, add_bias_linear=True,
    )  # fmt: skip
    assert_same_function(from_megatron(tmp_path, vocab_size=VOCAB), gpt2)


# ---------------------------------------------------------------------------- which GeLU Megatron ran
@pytest.mark.parametrize(
    ("style", "args", "hidden_act"),
    [
        # megatron-core reads neither openai_gelu nor onnx_safe: F.gelu, or the tanh kernels
        ("core", {"openai_gelu": True, "bias_gelu_fusion": False}, "gelu"),
        ("core", {"openai_gelu": False, "onnx_safe": True, "bias_gelu_fusion": True}, "gelu_new"),
        ("core", {"use_te_activation_func": True, "bias_gelu_fusion": False}, "gelu_new"),
        # legacy from 2023-04 (args have swiglu): onnx_safe's erf GeLU comes before the fusion
        ("legacy", {"openai_gelu": False, "onnx_safe": True, "bias_gelu_fusion": True, "swiglu": False}, "gelu"),
        ("legacy", {"openai_gelu": True, "bias_gelu_fusion": False, "swiglu": False}, "gelu_new"),
        # legacy 2020-09 to 2023-04: the fused kernel comes before onnx_safe
        ("legacy", {"openai_gelu": False, "onnx_safe": True, "bias_gelu_fusion": True}, "gelu_new"),
        ("legacy", {"openai_gelu": False, "onnx_safe": None, "bias_gelu_fusion": False}, "gelu"),
        # legacy 2020-04 to 2020-09: no fusion arg, F.gelu unless openai_gelu
        ("legacy", {"openai_gelu": False, "onnx_safe": None}, "gelu"),
        ("legacy", {"openai_gelu": True, "onnx_safe": None}, "gelu_new"),
        # legacy before 2020-04: no openai_gelu arg, Megatron's own tanh gelu_impl
        ("legacy", {}, "gelu_new"),
    ],
    ids=[
        "core-openai_gelu-ignored", "core-fused", "core-te-activation", "legacy2023-onnx_safe-first",
        "legacy2023-openai", "legacy2020-fusion-first", "legacy2020-unfused", "legacy2020april-exact",
        "legacy2020april-openai", "legacy2019-tanh",
    ],
)  # fmt: skip
def test_the_gelu_is_the_one_megatron_ran(tmp_path, gpt2, style, args, hidden_act):
    save_checkpoint_files(megatron_shards(gpt2, style=style), tmp_path, num_attention_heads=HEADS, **args)
    tnlg = from_megatron(tmp_path, vocab_size=VOCAB, checkpoint_version=3)
    assert tnlg.config.hidden_act == hidden_act


# ---------------------------------------------------------------------------- zero-centred LayerNorm gains
def test_zero_centred_gains_of_a_bf16_checkpoint_are_shifted_in_fp32(tmp_path, gpt2):
    shards = megatron_shards(gpt2)
    stored = {
        name: (tensor - 1 if name.endswith("layernorm.weight") else tensor).to(torch.bfloat16)
        for name, tensor in shards[(0, 0)].items()
    }
    save_megatron_checkpoint({(0, 0): stored}, tmp_path, num_heads=HEADS, layernorm_zero_centered_gamma=True)
    tnlg = from_megatron(tmp_path, vocab_size=VOCAB, dtype=torch.float32)
    gain = tnlg.state_dict()["model.layers.0.input_layernorm.weight"]
    # Transformer Engine adds the 1 in fp32; a bf16 sum rounds to multiples of 2^-7 near 1
    assert gain.dtype == torch.float32
    assert torch.equal(gain, stored["decoder.layers.0.input_layernorm.weight"].float() + 1)
    kept = from_megatron(tmp_path, vocab_size=VOCAB)  # no dtype: the stored one
    assert kept.state_dict()["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
