"""The GPT-2 export (tnlg.tools.convert.to_gpt2, `convert_checkpoint.py --to gpt2`): a plain
GPT2LMHeadModel directory that computes what the TNLG model computes, loadable without tnlg."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import GPT2LMHeadModel

from tests.support import REPO
from tests.support.parallel_checkpoint_cases import run_layout
from tests.support.tensor_parallel_cases import VOCAB, make_model
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.tools.convert import export_gpt2, gpt2_config, tnlg_state_to_gpt2
from tnlg.tools.spawn import run_distributed

SCRIPT = REPO / "scripts" / "convert_checkpoint.py"


def tiny(tied: bool = True) -> TNLGForCausalLM:
    """The tiny TNLG of the tensor-parallel tests (biases and LayerNorms off their init), its last token
    the end of text."""
    model = make_model(tie_word_embeddings=tied, eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1)
    return model.eval()


def prompts(vocab_size: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab_size - 1, (3, 10), generator=torch.Generator().manual_seed(1))


def assert_same_function(tnlg: torch.nn.Module, gpt2: torch.nn.Module) -> None:
    """Logits within 1e-5 (fp32) and the same greedy continuation."""
    vocab_size = tnlg.config.vocab_size
    ids = prompts(vocab_size)
    with torch.no_grad():
        ours, theirs = tnlg(ids).logits, gpt2(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": vocab_size - 1}
    assert torch.equal(tnlg.generate(ids, **settings), gpt2.generate(ids, **settings))


@pytest.mark.parametrize("tied", [True, False])
def test_an_exported_model_is_gpt2_computing_the_same_function(tmp_path, tied):
    model = tiny(tied)
    written = export_gpt2(model, tmp_path / "gpt2", max_shard_size="30KB")
    assert len([path for path in written if path.suffix == ".safetensors"]) > 1  # sharded, with an index
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and "auto_map" not in config
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert not (
        tmp_path / "gpt2" / "tnlg_checksums.json"
    ).exists()  # nothing of tnlg's in a plain GPT-2 folder
    gpt2 = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    assert_same_function(model, gpt2)
    assert (gpt2.lm_head.weight is gpt2.transformer.wte.weight) == tied


def test_the_export_loads_where_tnlg_cannot_be_imported(tmp_path):
    model = tiny()
    export_gpt2(model, tmp_path / "gpt2")
    ids = prompts()
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / "expected.pt")
    # A fresh interpreter in which `import tnlg` fails: only Transformers reads the folder.
    code = f"""
import importlib.abc, sys
class NoTnlg(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "tnlg" or name.startswith("tnlg."):
            raise ImportError("tnlg is not installed here")
sys.meta_path.insert(0, NoTnlg())
import torch
from transformers import AutoModelForCausalLM
expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "gpt2")!r}).eval()
with torch.no_grad():
    logits = model(expected["ids"]).logits
print(type(model).__name__, (logits - expected["logits"]).abs().max().item(), "tnlg" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    name, difference, imported = result.stdout.split()
    assert name == "GPT2LMHeadModel" and float(difference) <= 1e-5 and imported == "False"


def test_a_run_directory_exports_from_the_command_line(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "run" / "model")
    (tmp_path / "run" / "model" / "tokenizer_config.json").write_text("{}")  # copied along
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--to", "gpt2", "--input", str(tmp_path / "run"), "--output", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert (tmp_path / "out" / "generation_config.json").is_file()
    assert_same_function(model, GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval())
    # The same output again is refused by name, and what is there stays.
    before = sorted(path.name for path in (tmp_path / "out").iterdir())
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--to", "gpt2", "--input", str(tmp_path / "run"), "--output", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert again.returncode == 2 and "already exists and is not an empty directory" in again.stderr
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == before


def test_what_gpt2_cannot_hold_is_refused_by_name(tmp_path):
    model = tiny()
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.qkv_proj.lora_A.weight"] = torch.zeros(4, model.config.hidden_size)
    with pytest.raises(ValueError, match=r"no place in a GPT-2 model: .*lora_A\.weight.*merge_and_unload"):
        tnlg_state_to_gpt2(state)
    model.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"saved has no config.json"):
        export_gpt2(tmp_path / "saved", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with torch.device("meta"):
        meta = TNLGForCausalLM(model.config)
    with pytest.raises(ValueError, match="meta device"):
        export_gpt2(meta, tmp_path / "meta")


@pytest.mark.parametrize("preset", ["tnlg-17b", "mt-nlg-530b"])
def test_the_large_presets_map_onto_gpt2_on_the_meta_device(preset):
    config = TNLGConfig.from_preset(preset)
    with torch.device("meta"):
        tnlg = TNLGForCausalLM(config)
        gpt2 = GPT2LMHeadModel(gpt2_config(config))
    exported = gpt2_config(config)
    assert (
        exported.n_layer,
        exported.n_embd,
        exported.n_head,
        exported.n_positions,
        exported.vocab_size,
    ) == (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.max_position_embeddings,
        config.vocab_size,
    )
    renamed = tnlg_state_to_gpt2(tnlg.state_dict(), tied=True)
    expected = {name: tensor.shape for name, tensor in gpt2.state_dict().items() if name != "lm_head.weight"}
    assert {name: tensor.shape for name, tensor in renamed.items()} == expected


@pytest.mark.slow
def test_a_tensor_2_x_pipeline_2_checkpoint_exports_to_gpt2(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    results = run_distributed(run_layout, 4, 2, 2, str(checkpoint), None, None, 2, 4, timeout=600)
    saved = results[0]["saved"]  # the whole model at the checkpoint, from the live engine
    config = TNLGConfig.from_pretrained(checkpoint)
    model = TNLGForCausalLM(config).eval()
    model.load_state_dict(saved)
    export_gpt2(checkpoint, tmp_path / "gpt2")
    assert not list(tmp_path.glob(".gpt2.consolidating-*"))  # the consolidated staging copy is gone
    assert_same_function(model, GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval())
