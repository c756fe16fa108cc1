"""Model files: every writer records each weight file's sha256 and every reader checks it; a file that
cannot be read is one error naming the file and the problem, from every loader (from_pretrained, the
engine's sharded loader, engine checkpoints, consolidation)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scripts.convert_checkpoint import main as convert_main
from tests.support.pretrained_cases import load_error, load_sharded
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling import CheckpointFileError
from tnlg.modeling import loading as loading_module
from tnlg.sharding import ZeroConfig, initialize, meta_from_pretrained
from tnlg.sharding.checkpoint import CheckpointError
from tnlg.sharding.consolidate import consolidate
from tnlg.tools.convert import load_tensors
from tnlg.tools.spawn import run_distributed

CHECKSUMS = "tnlg_checksums.json"


def _flip_a_bit(path: Path, at: int = -5) -> None:
    """One bit of a tensor's data (the end of the file), leaving the header valid."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def _pickle_as(path: Path) -> None:
    """A torch.save pickle (zip) under a .safetensors name."""
    torch.save({"weight": torch.zeros(3)}, path)


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("model-*.safetensors"))


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    other = b.state_dict()
    return all(torch.equal(tensor, other[name]) for name, tensor in a.state_dict().items())


@pytest.fixture
def sharded(tmp_path, debug_model) -> Path:
    directory = tmp_path / "sharded"
    debug_model.save_pretrained(directory, max_shard_size="100KB")
    assert len(_shards(directory)) > 2
    return directory


@pytest.fixture
def single(tmp_path, debug_model) -> Path:
    directory = tmp_path / "single"
    debug_model.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------- checksums
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_save_pretrained_records_the_sha256_of_every_weight_file(request, layout):
    directory = request.getfixturevalue(layout)
    record = json.loads((directory / CHECKSUMS).read_text())["files"]
    weights = sorted(p.name for p in directory.glob("*.safetensors"))
    assert sorted(record) == weights
    for name, entry in record.items():
        content = (directory / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}
    if layout == "sharded":  # the index stays exactly Transformers' own
        assert set(json.loads((directory / "model.safetensors.index.json").read_text())) == {
            "metadata",
            "weight_map",
        }


def test_a_save_with_a_given_state_dict_is_recorded_too(tmp_path, debug_model):
    """What ZeroAccelerator.save_model and ZeroTrainer.save_model call with the consolidated state."""
    debug_model.save_pretrained(tmp_path, state_dict=debug_model.state_dict(), max_shard_size="100KB")
    assert sorted(json.loads((tmp_path / CHECKSUMS).read_text())["files"]) == [
        p.name for p in _shards(tmp_path)
    ]
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path), debug_model)


def test_a_changed_shard_loads_with_a_warning_naming_it_or_is_refused_when_strict(
    sharded, debug_model, caplog
):
    # [Note: checksums]: the directory is the user's, and tools rewrite weight files; strict on request.
    victim = _shards(sharded)[1]
    _flip_a_bit(victim)
    with caplog.at_level(logging.WARNING, logger="tnlg.modeling.loading"):
        loaded = TNLGForCausalLM.from_pretrained(sharded)
    assert not _same_weights(loaded, debug_model)  # the file as it is now
    assert (
        f"{victim} does not match the sha256 recorded" in caplog.text and "loading it as it is" in caplog.text
    )
    with pytest.raises(
        CheckpointFileError, match=rf"{victim.name} does not match the sha256 recorded"
    ) as raised:
        TNLGForCausalLM.from_pretrained(sharded, verify_checksums="strict")
    assert raised.value.path == victim
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tnlg.modeling.loading"):
        TNLGForCausalLM.from_pretrained(sharded, verify_checksums=False)  # no hashing, no warning
    assert "sha256" not in caplog.text


def test_a_file_rewritten_by_another_tool_loads_as_transformers_would(single, debug_model, caplog):
    # Transformers' own common test rewrites model.safetensors (save_file of the state dict) and reloads.
    state = {name: tensor + 1 for name, tensor in load_file(single / "model.safetensors").items()}
    save_file(state, single / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="tnlg.modeling.loading"):
        loaded = TNLGForCausalLM.from_pretrained(single)
    assert f"{single / 'model.safetensors'} does not match the sha256" in caplog.text
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_checkpoint_without_a_record_loads_unverified(single, debug_model):
    (single / CHECKSUMS).unlink()  # as plain Transformers saves it
    assert _same_weights(TNLGForCausalLM.from_pretrained(single), debug_model)


@pytest.mark.parametrize("load", ["from_pretrained", "meta_from_pretrained"])
def test_a_folder_without_config_json_is_named(single, load):
    # Transformers alone builds the default config, then fails on every tensor's shape.
    (single / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"single has no config.json"):
        if load == "from_pretrained":
            TNLGForCausalLM.from_pretrained(single)
        else:
            meta_from_pretrained(TNLGForCausalLM, single)


def test_a_shard_the_record_does_not_list_is_named(sharded, caplog):
    record = json.loads((sharded / CHECKSUMS).read_text())
    dropped = _shards(sharded)[0].name
    del record["files"][dropped]
    (sharded / CHECKSUMS).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="tnlg.modeling.loading"):
        TNLGForCausalLM.from_pretrained(sharded)
    assert f"{dropped} has no entry in" in caplog.text
    with pytest.raises(CheckpointFileError, match=rf"{dropped} has no entry in .*{CHECKSUMS}"):
        TNLGForCausalLM.from_pretrained(sharded, verify_checksums="strict")


def test_a_missing_shard_is_refused_whatever_the_setting(sharded):
    victim = _shards(sharded)[0]
    victim.unlink()
    with pytest.raises(CheckpointFileError, match=rf"{victim.name} is missing"):
        TNLGForCausalLM.from_pretrained(sharded)


def test_a_damaged_record_is_named(single):
    (single / CHECKSUMS).write_text('{"files": {"model.safetensors": {"sha256": "x"')
    with pytest.raises(CheckpointFileError, match=rf"{CHECKSUMS} is not valid JSON"):
        TNLGForCausalLM.from_pretrained(single)


def test_a_sharded_save_over_a_single_file_replaces_it(tmp_path, debug_config):
    """Transformers leaves the old model.safetensors next to new shards, and from_pretrained prefers it."""
    first, second = TNLGForCausalLM(debug_config), TNLGForCausalLM(debug_config)
    first.save_pretrained(tmp_path)
    second.save_pretrained(tmp_path, max_shard_size="100KB")
    assert not (tmp_path / "model.safetensors").exists()
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path), second)
    first.save_pretrained(tmp_path)  # and back: the stale index and shards go
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert _same_weights(TNLGForCausalLM.from_pretrained(tmp_path), first)


def test_the_record_keeps_another_variants_files(tmp_path, debug_model):
    debug_model.save_pretrained(tmp_path, variant="v2")
    debug_model.save_pretrained(tmp_path)
    assert sorted(json.loads((tmp_path / CHECKSUMS).read_text())["files"]) == [
        "model.safetensors",
        "model.v2.safetensors",
    ]
    _flip_a_bit(tmp_path / "model.v2.safetensors")
    TNLGForCausalLM.from_pretrained(tmp_path, verify_checksums="strict")  # the default variant is intact
    with pytest.raises(CheckpointFileError, match=r"model\.v2\.safetensors does not match the sha256"):
        TNLGForCausalLM.from_pretrained(tmp_path, variant="v2", verify_checksums="strict")


def test_load_tensors_verifies_the_record(sharded, caplog):
    _flip_a_bit(_shards(sharded)[0])
    with caplog.at_level(logging.WARNING, logger="tnlg.modeling.loading"):
        load_tensors(sharded)
    assert f"{_shards(sharded)[0].name} does not match the sha256" in caplog.text


def _load_and_list_hashed(rank: int, world_size: int, path: str) -> list[str]:
    """The files this rank hashed while loading the checkpoint into stage 3 shards."""
    hashed, real = [], loading_module.sha256_of

    def recording(file: Path) -> str:
        hashed.append(Path(file).name)
        return real(file)

    loading_module.sha256_of = recording
    try:
        load_sharded(rank, world_size, path, 3)
    finally:
        loading_module.sha256_of = real
    return hashed


@pytest.mark.slow
def test_sharded_loading_hashes_each_file_once_across_the_ranks(sharded):
    hashed = run_distributed(_load_and_list_hashed, 2, str(sharded))
    assert sorted(hashed[0] + hashed[1]) == [p.name for p in _shards(sharded)]
    assert hashed[0] and hashed[1]


@pytest.mark.slow
def test_strict_sharded_loading_refuses_a_changed_file_on_every_rank(sharded):
    victim = _shards(sharded)[1]  # hashed by rank 1 only: rank 0 must fail too
    _flip_a_bit(victim)
    errors = run_distributed(load_error, 2, str(sharded), "strict")
    assert all(f"{victim.name} does not match the sha256 recorded" in error for error in errors), errors
    assert run_distributed(load_error, 2, str(sharded)) == ["loaded", "loaded"]  # the default: a warning


def test_meta_from_pretrained_can_skip_the_check(sharded, debug_model):
    _flip_a_bit(_shards(sharded)[1])
    model = meta_from_pretrained(TNLGForCausalLM, sharded, verify_checksums=False)
    engine = initialize(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
    assert set(engine.full_state_dict()) == set(debug_model.state_dict())


# ---------------------------------------------------------------------------------------------- unreadable files
def _index_not_json(directory: Path) -> Path:
    index = directory / "model.safetensors.index.json"
    _truncate(index)
    return index


def _truncated_shard(directory: Path) -> Path:
    _truncate(_shards(directory)[0])
    return _shards(directory)[0]


def _pickled_shard(directory: Path) -> Path:
    _pickle_as(_shards(directory)[0])
    return _shards(directory)[0]


def _missing_shard(directory: Path) -> Path:
    victim = _shards(directory)[-1]
    victim.unlink()
    return victim


DAMAGE = {
    "index not JSON": (_index_not_json, "is not valid JSON"),
    "truncated shard": (_truncated_shard, r"cannot be read as safetensors: .*truncated or damaged"),
    "pickle renamed": (
        _pickled_shard,
        "cannot be read as safetensors: it is a zip archive, the format of torch.save",
    ),
    "missing shard": (_missing_shard, "is missing"),
}


@pytest.mark.parametrize("record", [True, False], ids=["recorded", "plain"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_from_pretrained_names_the_unreadable_file(sharded, damage, record):
    if not record:
        (sharded / CHECKSUMS).unlink()
    damage_fn, message = DAMAGE[damage]
    victim = damage_fn(sharded)
    assert victim.name == "model.safetensors.index.json" or victim.name.startswith("model-0000")
    with pytest.raises(CheckpointFileError, match=message) as raised:
        TNLGForCausalLM.from_pretrained(sharded)
    assert str(raised.value).startswith(str(victim))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_sharded_loading_names_the_unreadable_file(sharded, damage):
    damage_fn, message = DAMAGE[damage]
    victim = damage_fn(sharded)
    error = load_error(0, 1, str(sharded))
    assert error.startswith(str(victim)), error
    assert re.search(message, error), error


def test_a_pickle_named_model_safetensors_is_named(single):
    _pickle_as(single / "model.safetensors")
    with pytest.raises(
        CheckpointFileError, match=r"model\.safetensors cannot be read as safetensors: it is a zip"
    ):
        TNLGForCausalLM.from_pretrained(single)
    assert "model.safetensors cannot be read as safetensors: it is a zip" in load_error(0, 1, str(single))
    with pytest.raises(CheckpointFileError, match="it is a zip archive"):
        load_tensors(single)


# ---------------------------------------------------------------------------------------------- engine checkpoints
def _save_engine(rank: int, world_size: int, directory: str) -> None:
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    initialize(model, optimizer, ZeroConfig(stage=2, mixed_precision="no")).save_checkpoint(directory)


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("engine") / "ckpt"
    run_distributed(_save_engine, 2, str(directory))
    return directory


@pytest.fixture
def engine_checkpoint(two_rank_checkpoint, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(two_rank_checkpoint, copy)
    return copy


def _load_engine_here(directory: Path) -> None:
    """One process loads the 2-rank checkpoint (its slices of both rank files)."""
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    initialize(model, optimizer, ZeroConfig(stage=2, mixed_precision="no")).load_checkpoint(directory)


def _edit_manifest(directory: Path, edit) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _pickled_rank_file(directory: Path) -> None:
    """A pickle in place of rank 1's file, the manifest updated to match it: only its format is wrong."""
    path = directory / "rank-00001.safetensors"
    _pickle_as(path)
    content = path.read_bytes()
    _edit_manifest(
        directory,
        lambda m: m["files"].update(
            {path.name: {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}}
        ),
    )


ENGINE_DAMAGE = {
    "manifest cut short": (
        lambda d: _truncate(d / "manifest.json", 0.6),
        r"manifest\.json is not valid JSON",
    ),
    "manifest without groups": (
        lambda d: _edit_manifest(d, lambda m: m.pop("groups")),
        r"manifest\.json is incomplete or damaged: groups \(absent, expected list\)",
    ),
    "manifest layout damaged": (
        lambda d: _edit_manifest(d, lambda m: m["groups"][0]["params"][0].pop("unit")),
        r"manifest\.json is damaged: its parameter layout cannot be read \(KeyError\('unit'\)\)",
    ),
    "manifest a list": (
        lambda d: (d / "manifest.json").write_text("[]"),
        r"manifest\.json holds a JSON list, not an engine manifest",
    ),
    "missing rank file": (
        lambda d: (d / "rank-00001.safetensors").unlink(),
        r"rank-00001\.safetensors is missing from the checkpoint",
    ),
    "pickle renamed": (
        _pickled_rank_file,
        r"rank-00001\.safetensors cannot be read as safetensors: it is a zip archive",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(ENGINE_DAMAGE))
def test_engine_load_names_the_damaged_file(engine_checkpoint, damage):
    damage_fn, message = ENGINE_DAMAGE[damage]
    damage_fn(engine_checkpoint)
    with pytest.raises(CheckpointError, match=message):
        _load_engine_here(engine_checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("damage", [*ENGINE_DAMAGE, "bit flip"])
def test_the_convert_script_names_the_damaged_file(engine_checkpoint, tmp_path, damage):
    damage_fn, message = ENGINE_DAMAGE.get(
        damage,
        (lambda d: _flip_a_bit(d / "rank-00001.safetensors"), r"rank-00001\.safetensors: sha256 differs"),
    )
    damage_fn(engine_checkpoint)
    with pytest.raises(CheckpointError, match=message):
        convert_main(["--from", "zero", "--input", str(engine_checkpoint), "--output", str(tmp_path / "out")])


@pytest.mark.slow
def test_consolidation_records_checksums_that_from_pretrained_verifies(engine_checkpoint, tmp_path):
    output = tmp_path / "model"
    output.mkdir()
    stale = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    with torch.no_grad():  # weights of its own (the checkpoint's model was built with the same seed)
        for parameter in stale.parameters():
            parameter.add_(1.0)
    stale.save_pretrained(output)  # a previous model in the output directory: must not be what loads
    written = consolidate(engine_checkpoint, output, max_shard_size="100KB")
    assert output / CHECKSUMS in written and not (output / "model.safetensors").exists()
    shards = _shards(output)
    assert sorted(json.loads((output / CHECKSUMS).read_text())["files"]) == [p.name for p in shards]
    loaded = TNLGForCausalLM.from_pretrained(output)
    for name, tensor in load_file(shards[0]).items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not _same_weights(loaded, stale)
    _flip_a_bit(shards[-1])
    with pytest.raises(CheckpointFileError, match=rf"{shards[-1].name} does not match the sha256"):
        TNLGForCausalLM.from_pretrained(output, verify_checksums="strict")
