"""Saves that must not lose or corrupt a model directory: a save Transformers refuses keeps the previous
model, a model cut into pipeline stages or tensor slices or with a config from_pretrained would refuse
is refused before anything is touched, and a tensor-parallel load is checked whichever way Transformers
is asked for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers.modeling_utils
from transformers.distributed import DistributedConfig

from tnlg.modeling import TNLGConfig, TNLGForCausalLM, apply_tensor_parallel
from tnlg.tools.spawn import run_distributed


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    other = b.state_dict()
    return all(torch.equal(tensor, other[name]) for name, tensor in a.state_dict().items())


def _invalid_generation_config(model: TNLGForCausalLM) -> TNLGForCausalLM:
    # Transformers validates the generation config inside save_pretrained and refuses this one.
    model.generation_config.do_sample = False
    model.generation_config.temperature = 0.5
    return model


def test_a_save_transformers_refuses_keeps_the_previous_model(tmp_path, debug_config):
    previous = TNLGForCausalLM(debug_config)
    previous.save_pretrained(tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match="GenerationConfig is invalid"):
        _invalid_generation_config(TNLGForCausalLM(debug_config)).save_pretrained(tmp_path)
    assert _snapshot(tmp_path) == before
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path, verify_checksums="strict"), previous)


def test_a_save_failing_halfway_restores_the_previous_files(tmp_path, debug_config, monkeypatch):
    previous = TNLGForCausalLM(debug_config)
    previous.save_pretrained(tmp_path)
    before = _snapshot(tmp_path)
    write_shard = transformers.modeling_utils.safe_save_file
    calls = []

    def disk_full_after_one_shard(*args, **kwargs):
        calls.append(args)
        if len(calls) > 1:
            raise OSError("No space left on device")
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full_after_one_shard)
    with pytest.raises(OSError, match="No space left"):
        TNLGForCausalLM(debug_config).save_pretrained(tmp_path, max_shard_size="100KB")
    assert _snapshot(tmp_path) == before  # no shard of the failed save, no file set aside
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path, verify_checksums="strict"), previous)


def test_a_successful_save_leaves_only_the_new_weights(tmp_path, debug_config):
    TNLGForCausalLM(debug_config).save_pretrained(tmp_path, max_shard_size="100KB")
    latest = TNLGForCausalLM(debug_config)
    latest.save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tnlg_checksums.json",
    ]
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path, verify_checksums="strict"), latest)


def test_a_pipeline_stage_is_refused_before_the_directory_is_touched(tmp_path, debug_config):
    whole = TNLGForCausalLM(debug_config)
    whole.save_pretrained(tmp_path)
    before = _snapshot(tmp_path)
    stage = TNLGForCausalLM(debug_config)
    stage.split_pipeline([0], 2)
    with pytest.raises(
        RuntimeError, match=r"pipeline stages .*holds stages \[0\] of 2.*accelerator\.save_model"
    ):
        stage.save_pretrained(tmp_path)
    assert _snapshot(tmp_path) == before


def test_a_pipeline_stage_saves_the_whole_state_dict_it_is_given(tmp_path, debug_config):
    whole = TNLGForCausalLM(debug_config)
    stage = TNLGForCausalLM(debug_config)
    stage.load_state_dict(whole.state_dict())
    stage.split_pipeline([1], 2)
    stage.save_pretrained(tmp_path, state_dict=whole.state_dict())  # as the engine's consolidation does
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path), whole)


def _shrunk_below_its_token_ids(**token_ids: int) -> TNLGForCausalLM:
    # GPT-2's padded vocabulary (bos = eos = 50256) moved to a smaller tokenizer's.
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug", vocab_size=50304, **token_ids))
    model.resize_token_embeddings(1000, mean_resizing=False)
    return model


def test_a_vocabulary_shrunk_below_the_token_ids_is_refused_before_anything_is_written(
    tmp_path, debug_config
):
    # It was saved, and from_pretrained then refused the directory it had written.
    TNLGForCausalLM(debug_config).save_pretrained(tmp_path / "used")
    before = _snapshot(tmp_path / "used")
    model = _shrunk_below_its_token_ids()
    for directory in (tmp_path / "new", tmp_path / "used"):
        with pytest.raises(ValueError) as raised:
            model.save_pretrained(directory)
        message = str(raised.value)
        assert message.startswith("save_pretrained refused, nothing written")
        assert (
            "bos_token_id 50256 and TNLGConfig.eos_token_id 50256 are outside the vocabulary [0, 1000)"
            in message
        )
        assert "below vocab_size, or None" in message
    assert not (tmp_path / "new").exists() and _snapshot(tmp_path / "used") == before
    model.config.bos_token_id = model.config.eos_token_id = 999  # the fix the message names
    # generate() would never stop on the generation config's eos 50256: refused alike
    with pytest.raises(
        ValueError, match=r"model\.generation_config\.bos_token_id 50256 and model\.generation"
    ):
        model.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = 999
    model.save_pretrained(tmp_path / "new")
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path / "new"), model)


def test_a_pad_token_id_past_the_shrunk_vocabulary_is_named(tmp_path):
    model = _shrunk_below_its_token_ids(bos_token_id=0, eos_token_id=0, pad_token_id=40000)
    with pytest.raises(
        ValueError, match=r"TNLGConfig\.pad_token_id 40000 is outside the vocabulary \[0, 1000\)"
    ):
        model.save_pretrained(tmp_path)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def sliced_save_case(rank: int, world_size: int, directory: str) -> str:
    """Each rank slices the saved model over the world and tries to save it over the directory."""
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    apply_tensor_parallel(model, dist.group.WORLD)
    try:
        model.save_pretrained(directory, is_main_process=rank == 0)
    except RuntimeError as error:
        return str(error)
    return "saved"


def test_a_tensor_sliced_model_is_refused_on_every_rank(tmp_path, debug_config):
    TNLGForCausalLM(debug_config).save_pretrained(tmp_path)
    before = _snapshot(tmp_path)
    for error in run_distributed(sliced_save_case, 2, str(tmp_path), timeout=120):
        assert "tensor slices (apply_tensor_parallel, degree 2)" in error
        assert "full_state_dict" in error
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "how",
    [
        {"tp_plan": "auto", "tp_size": 3},
        {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=3)},
        {"distributed_config": DistributedConfig(tp_size=3)},
    ],
    ids=["keywords", "distributed_config", "distributed_config_size_only"],
)
def test_a_tensor_parallel_load_checks_the_degree_however_it_is_asked(tmp_path, debug_config, how):
    TNLGForCausalLM(debug_config).save_pretrained(tmp_path)  # 4 heads
    with pytest.raises(ValueError, match="tensor-parallel degree 3 does not divide num_attention_heads"):
        TNLGForCausalLM.from_pretrained(tmp_path, **how)
