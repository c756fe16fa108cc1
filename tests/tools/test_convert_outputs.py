"""Where scripts/convert_checkpoint.py writes: never into its input, never over a model unasked, never
half-written; flags a format does not read are refused ([Note: conversion outputs])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

import scripts.convert_checkpoint as convert_script
from scripts.convert_checkpoint import main as convert_main
from scripts.convert_checkpoint import parse_args
from tests.support.megatron_layout import megatron_shards, save_megatron_checkpoint, source_gpt2
from tnlg import TNLGForCausalLM
from tnlg.sharding.consolidate import consolidate
from tnlg.tools.convert import from_megatron

VOCAB, HEADS = 96, 2


@pytest.fixture
def gpt2() -> GPT2LMHeadModel:
    return source_gpt2(VOCAB, width=32, layers=2, heads=HEADS, positions=32)


@pytest.fixture
def gpt2_dir(tmp_path, gpt2) -> Path:
    gpt2.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def convert_gpt2(source: Path, output: Path, *extra: str) -> None:
    convert_main(["--from", "gpt2", "--input", str(source), "--output", str(output), *extra])


@pytest.mark.parametrize("where", ["same", "inside"])
def test_an_output_overlapping_the_input_is_refused(gpt2_dir, where):
    before = snapshot(gpt2_dir)
    output = gpt2_dir if where == "same" else gpt2_dir / "tnlg"
    with pytest.raises(ValueError, match="overlaps --input"):
        convert_gpt2(gpt2_dir, output, "--overwrite")
    assert snapshot(gpt2_dir) == before


def test_overwrite_refuses_an_output_holding_another_input(tmp_path, gpt2_dir):
    # --overwrite removed the old output whole, the tokenizer files it was told to copy with it
    output = tmp_path / "model"
    (output / "tokenizer").mkdir(parents=True)
    (output / "tokenizer" / "README").write_text("the only copy")
    with pytest.raises(ValueError, match=r"--output .*model overlaps --tokenizer-dir .*model/tokenizer"):
        convert_gpt2(gpt2_dir, output, "--overwrite", "--tokenizer-dir", str(output / "tokenizer"))
    assert (output / "tokenizer" / "README").read_text() == "the only copy"


def test_a_linked_output_is_refused_before_converting(tmp_path, gpt2_dir):
    # the conversion finished, then renaming the link aside failed and left a stray directory
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept").write_text("kept")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ValueError, match=r"--output .*link is a symbolic link: name the directory itself"):
        convert_gpt2(gpt2_dir, tmp_path / "link", "--overwrite")
    assert snapshot(target) == {"kept": b"kept"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "link", "target"]


def test_the_working_directory_as_output_is_replaced_whole(tmp_path, gpt2_dir, monkeypatch):
    # "." has no name to stage beside: the rename failed (EBUSY) after the whole conversion
    work = tmp_path / "work"
    work.mkdir()
    (work / "old").write_text("an older model's file")
    monkeypatch.chdir(work)
    convert_gpt2(gpt2_dir, Path("."), "--overwrite")
    assert TNLGForCausalLM.from_pretrained(work).config.vocab_size == VOCAB
    assert not (work / "old").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "work"]


def test_consolidating_into_the_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="into the checkpoint itself"):
        consolidate(tmp_path, tmp_path)


def test_an_existing_model_is_kept_unless_overwrite_replaces_it_whole(tmp_path, gpt2_dir):
    output = tmp_path / "model"
    output.mkdir()
    (output / "generation_config.json").write_text("{}")  # an older model's file
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_gpt2(gpt2_dir, output)
    assert snapshot(output) == {"generation_config.json": b"{}"}
    convert_gpt2(gpt2_dir, output, "--overwrite")
    assert (output / "generation_config.json").read_bytes() != b"{}"  # one conversion's files only
    assert TNLGForCausalLM.from_pretrained(output).config.vocab_size == VOCAB
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_a_failed_conversion_leaves_the_previous_model(tmp_path, gpt2_dir, monkeypatch):
    output = tmp_path / "model"
    convert_gpt2(gpt2_dir, output)
    before = snapshot(output)

    def failing_copy(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(convert_script, "copy_tokenizer_files", failing_copy)
    with pytest.raises(OSError, match="disk full"):
        convert_gpt2(gpt2_dir, output, "--overwrite")
    assert snapshot(output) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_max_shard_size_is_read_once_in_binary_units_too(tmp_path, gpt2_dir):
    convert_gpt2(gpt2_dir, tmp_path / "model", "--max-shard-size", "0.05MiB")
    assert (tmp_path / "model" / "model.safetensors.index.json").is_file()


def test_a_bad_max_shard_size_touches_nothing(tmp_path, gpt2_dir, capsys):
    output = tmp_path / "model"
    convert_gpt2(gpt2_dir, output)
    before = snapshot(output)
    with pytest.raises(SystemExit) as exit_info:
        convert_gpt2(gpt2_dir, output, "--max-shard-size", "1 gigabyte")
    assert exit_info.value.code == 2 and "'1 gigabyte' is not a size" in capsys.readouterr().err
    assert snapshot(output) == before


@pytest.mark.parametrize(
    "flags",
    [
        ["--vocab-size", "50257"],
        ["--num-attention-heads", "4"],
        ["--hidden-act", "gelu"],
        ["--layer-norm-epsilon", "1e-6"],
        ["--checkpoint-version", "2"],
        ["--no-verify"],
        ["--tokenizer-dir", "/no/such/dir"],
    ],
)
def test_flags_this_conversion_does_not_read_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--from", "gpt2", "--input", "in", "--output", "out", *flags])
    assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err


def test_only_the_megatron_checkpoint_versions_are_accepted(capsys):
    common = ["--from", "megatron", "--input", "in", "--output", "out", "--checkpoint-version"]
    assert parse_args([*common, "1"]).checkpoint_version == 1.0
    with pytest.raises(SystemExit):
        parse_args([*common, "1.5"])
    assert "0, 1, 2 or 3" in capsys.readouterr().err


@pytest.mark.parametrize("arg", ["apply_layernorm_1p", "layernorm_zero_centered_gamma"])
def test_zero_centred_layernorm_weights_convert_exactly(tmp_path, gpt2, arg):
    # Megatron's LayerNorm1P normalizes with `weight + 1`: it stores the GPT-2 weights less one.
    shards = megatron_shards(gpt2)
    for name, tensor in shards[(0, 0)].items():
        if name.endswith("layernorm.weight"):
            shards[(0, 0)][name] = tensor - 1
    save_megatron_checkpoint(shards, tmp_path, num_heads=HEADS, **{arg: True})
    tnlg = from_megatron(tmp_path, vocab_size=VOCAB)
    input_ids = torch.randint(0, VOCAB, (2, 12))
    torch.testing.assert_close(tnlg(input_ids).logits, gpt2(input_ids).logits, atol=1e-5, rtol=0)
