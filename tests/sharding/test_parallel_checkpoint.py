"""Engine checkpoints across (tensor, data) layouts: a checkpoint saved with tensor slicing loads at any
other tensor degree, data degree and ZeRO stage with no conversion step, bit for bit; consolidation
assembles the whole tensors; a damaged or missing sub-checkpoint is a CheckpointError naming it."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.parallel_checkpoint_cases import SAVE_AT, STEPS, run_layout, try_load
from tnlg.modeling.tensor_parallel import TensorSlice
from tnlg.sharding.checkpoint import CheckpointError, SavedCheckpoint, read_manifest, saved_params
from tnlg.sharding.consolidate import consolidate
from tnlg.sharding.slice_runs import Cut, runs
from tnlg.tools.spawn import run_distributed

KEYS = ("master", "state.exp_avg", "state.exp_avg_sq")


def _consolidated(directory: Path) -> dict[str, torch.Tensor]:
    """Every parameter's master weights and Adam moments, whole, from any checkpoint layout."""
    saved = SavedCheckpoint(directory)
    return {f"{name}/{key}": saved.full_param(name, key) for name in saved.names for key in KEYS}


def _assert_equal(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name


def _assert_close(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(found[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------- the slice arithmetic
@pytest.mark.parametrize(
    ("shape", "dim", "parts"),
    [((12, 8), 0, 1), ((12, 8), 1, 1), ((24, 8), 0, 3), ((24,), 0, 3), ((4, 12, 3), 1, 1)],
)
def test_slice_runs_map_any_degree_onto_any_other(shape, dim, parts):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)

    def slices(degree):
        if degree == 1:
            return [full.flatten()]
        return [TensorSlice(dim, parts, degree, r).local(full).flatten() for r in range(degree)]

    for live_degree, saved_degree in itertools.product([1, 2, 4], repeat=2):
        saved = slices(saved_degree)
        for rank, live in enumerate(slices(live_degree)):
            n = live.numel()
            for start, end in [(0, n), (1, n - 1), (n // 3, 2 * n // 3), (n - 1, n)]:
                out = torch.full((end - start,), -1, dtype=full.dtype)
                for part, at, position, length in runs(
                    shape, Cut(dim, parts), live_degree, rank, saved_degree, start, end
                ):
                    out[position : position + length] = saved[part][at : at + length]
                assert torch.equal(out, live[start:end]), (live_degree, saved_degree, rank, start, end)


# ------------------------------------------------------------------------------- saved at tensor 2 x data 2
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tensor 2 x data 2, ZeRO-3: SAVE_AT steps, a checkpoint, then the rest (the reference continuation)."""
    directory = tmp_path_factory.mktemp("sliced") / "engine"
    result = run_distributed(run_layout, 4, 2, 3, str(directory), timeout=400)[0]
    return directory, result


@pytest.mark.slow
def test_the_sliced_checkpoint_layout(saved):
    directory, _ = saved
    manifest = read_manifest(directory)
    assert manifest["world_size"] == 4 and manifest["layout"] == {"tensor": 2, "pipeline": 1, "data": 2}
    assert [p["directory"] for p in manifest["parts"]] == ["tensor-00", "tensor-01"]
    for part in ("tensor-00", "tensor-01"):
        sub = read_manifest(directory / part)
        assert sub["world_size"] == 2 and sorted(sub["files"]) == [
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ]
    qkv = next(name for name in manifest["slices"] if "qkv" in name and name.endswith("weight"))
    assert manifest["slices"][qkv] == {"dim": 0, "parts": 3, "shape": [96, 32]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tensor", "world", "stage"),
    [(1, 4, 2), (2, 2, 1), (None, 1, 0)],
    ids=["tensor1-data4-stage2", "tensor2-data1-stage1", "one-process-stage0"],
)
def test_a_sliced_checkpoint_resumes_at_another_layout(saved, tmp_path, tensor, world, stage):
    directory, original = saved
    resaved = tmp_path / "resaved"
    if world == 1:
        resumed = run_layout(0, 1, tensor, stage, load=str(directory), resave=str(resaved))
    else:
        resumed = run_distributed(
            run_layout, world, tensor, stage, None, str(directory), str(resaved), timeout=400
        )[0]
    assert resumed["start"] == SAVE_AT
    _assert_equal(resumed["loaded"], original["saved"])  # the loaded weights, bit for bit
    _assert_equal(_consolidated(resaved), _consolidated(directory))  # and the Adam moments
    # Training goes on as at the saved layout, up to the rounding of another layout's reductions.
    assert len(resumed["losses"]) == STEPS - SAVE_AT
    assert resumed["losses"] == pytest.approx(original["losses"][SAVE_AT:], rel=1e-5, abs=1e-6)
    _assert_close(resumed["state"], original["state"])


@pytest.mark.slow
def test_tensor2_data2_to_tensor1_data4_and_back_is_exact(saved, tmp_path):
    directory, original = saved
    wide, back = tmp_path / "tensor1-data4", tmp_path / "tensor2-data2"
    there = run_distributed(run_layout, 4, 1, 2, None, str(directory), str(wide), timeout=400)[0]
    assert "parts" not in read_manifest(wide)  # tensor 1 writes the format of whole parameters
    again = run_distributed(run_layout, 4, 2, 3, None, str(wide), str(back), timeout=400)[0]
    assert "parts" in read_manifest(back)
    for state in (there["loaded"], again["loaded"]):
        _assert_equal(state, original["saved"])
    before = _consolidated(directory)
    _assert_equal(_consolidated(wide), before)
    _assert_equal(_consolidated(back), before)


@pytest.mark.slow
def test_consolidation_assembles_the_sliced_checkpoint(saved, tmp_path):
    from safetensors.torch import load_file

    directory, original = saved
    consolidate(directory, tmp_path / "model", dtype=None)
    tensors = load_file(tmp_path / "model" / "model.safetensors")
    expected = {key: value for key, value in original["saved"].items() if key in tensors}
    assert set(tensors) <= set(original["saved"])
    # Every parameter is there (tied ones under their first name), equal to the engine's bit for bit.
    assert len(expected) == len(tensors) and tensors
    _assert_equal(tensors, expected)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["num_attention_heads"] == 4


def _damaged(directory: Path, tmp_path: Path, damage: str) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(directory, copy)
    part = copy / "tensor-01"
    if damage == "missing rank file":
        (part / "rank-00001.safetensors").unlink()
    elif damage == "corrupt rank file":
        path = part / "rank-00000.safetensors"
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "missing sub-checkpoint":
        shutil.rmtree(part)
    elif damage == "edited sub-manifest":
        manifest = json.loads((part / "manifest.json").read_text())
        manifest["global_steps"] += 1
        (part / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "damaged top manifest":
        _list_first_part_only(copy)
    return copy


def _list_first_part_only(directory: Path) -> None:
    """Damage: the top manifest lists only its first part."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["parts"] = manifest["parts"][:1]
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing rank file", r"tensor-01/rank-00001\.safetensors is missing"),
        ("corrupt rank file", r"tensor-01/rank-00000\.safetensors: sha256 differs"),
        ("missing sub-checkpoint", r"tensor-01/manifest\.json is missing.*tensor rank 1"),
        ("edited sub-manifest", r"tensor-01/manifest\.json: sha256 differs"),
        ("damaged top manifest", r"one sub-checkpoint per tensor rank"),
    ],
)
def test_a_damaged_sub_checkpoint_is_named(saved, tmp_path, damage, message):
    directory = _damaged(saved[0], tmp_path, damage)
    # One process, no slicing: reads every tensor rank's sub-checkpoint.
    assert re.search(message, try_load(0, 1, None, 2, str(directory)) or "")
    with pytest.raises(CheckpointError, match=message):
        consolidate(directory, tmp_path / "model")


@pytest.mark.slow
def test_every_rank_of_a_sliced_load_raises_the_same_error(saved, tmp_path):
    directory = _damaged(saved[0], tmp_path, "missing rank file")
    errors = run_distributed(try_load, 4, 2, 2, str(directory), timeout=400)
    assert all(e is not None and "rank-00001.safetensors is missing" in e for e in errors), errors


# ------------------------------------------------------------------------------- pipeline stages
LAYERS = 4  # two pipeline stages hold two layers each


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The chain tensor x pipeline x data 2x1x2 (ZeRO-3) -> 1x1x4 (ZeRO-2) -> 1x2x2 (ZeRO-1) of the
    4-layer model: the first run saves after SAVE_AT steps and goes on (the reference continuation),
    each next one loads the previous checkpoint, saves what it loaded at once, and trains on."""
    root = tmp_path_factory.mktemp("pipeline")
    paths = {name: root / name for name in ("2x1x2", "1x1x4", "1x2x2")}
    runs = {
        "2x1x2": run_distributed(
            run_layout, 4, 2, 3, str(paths["2x1x2"]), None, None, 1, LAYERS, timeout=400
        )[0],
        "1x1x4": run_distributed(
            run_layout, 4, 1, 2, None, str(paths["2x1x2"]), str(paths["1x1x4"]), 1, LAYERS, timeout=400
        )[0],
        "1x2x2": run_distributed(
            run_layout, 4, 1, 1, None, str(paths["1x1x4"]), str(paths["1x2x2"]), 2, LAYERS, timeout=400
        )[0],
    }
    return paths, runs


def _assert_resumed(resumed: dict, original: dict) -> None:
    """Weights and Adam's state (moments and step) back bit for bit, then the saved layout's training."""
    assert resumed["start"] == SAVE_AT
    _assert_equal(resumed["loaded"], original["saved"])
    _assert_equal(resumed["loaded_moments"], original["saved_moments"])
    assert resumed["losses"] == pytest.approx(original["losses"][SAVE_AT:], rel=1e-5, abs=1e-6)
    _assert_close(resumed["state"], original["state"])


@pytest.mark.slow
def test_the_pipeline_checkpoint_layout(chain):
    paths, _ = chain
    manifest = read_manifest(paths["1x2x2"])
    assert manifest["layout"] == {"tensor": 1, "pipeline": 2, "data": 2}
    assert [
        (p["directory"], p["pipeline_stage"], p["tensor_rank"], p["stages"]) for p in manifest["parts"]
    ] == [
        ("pipeline-00-tensor-00", 0, 0, [0]),
        ("pipeline-01-tensor-00", 1, 0, [1]),
    ]
    first, last = (saved_params(read_manifest(paths["1x2x2"] / p["directory"])) for p in manifest["parts"])
    # Each stage saves its own layers; the tied embedding, held by both stages, is saved by the first only.
    assert "model.layers.1.mlp.fc_in.weight" in first and "model.layers.2.mlp.fc_in.weight" in last
    assert "model.final_layernorm.weight" in last
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    assert not set(first) & set(last)


@pytest.mark.slow
def test_the_chain_2x1x2_to_1x1x4_to_1x2x2_is_exact(chain):
    paths, runs = chain
    original = runs["2x1x2"]
    for layout in ("1x1x4", "1x2x2"):
        _assert_resumed(runs[layout], original)
    # What each load restored, saved again at once, holds the first checkpoint's weights and moments.
    before = _consolidated(paths["2x1x2"])
    _assert_equal(_consolidated(paths["1x1x4"]), before)
    _assert_equal(_consolidated(paths["1x2x2"]), before)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_at_tensor2_pipeline2(chain, tmp_path):
    """Pipeline 2 -> tensor 2 x pipeline 2 x data 1 (ZeRO-3): four parts, the tied embedding on two."""
    paths, runs = chain
    resaved = tmp_path / "2x2x1"
    resumed = run_distributed(
        run_layout, 4, 2, 3, None, str(paths["1x2x2"]), str(resaved), 2, LAYERS, timeout=400
    )[0]
    _assert_resumed(resumed, runs["2x1x2"])
    assert [p["directory"] for p in read_manifest(resaved)["parts"]] == [
        "pipeline-00-tensor-00",
        "pipeline-00-tensor-01",
        "pipeline-01-tensor-00",
        "pipeline-01-tensor-01",
    ]
    _assert_equal(_consolidated(resaved), _consolidated(paths["2x1x2"]))


@pytest.mark.slow
def test_a_pipeline_checkpoint_loads_and_consolidates_in_one_process(chain, tmp_path):
    from safetensors.torch import load_file

    from tnlg.modeling import TNLGForCausalLM

    paths, runs = chain
    original = runs["2x1x2"]
    resumed = run_layout(0, 1, None, 0, None, str(paths["1x2x2"]), None, 1, LAYERS)
    _assert_resumed(resumed, original)
    consolidate(paths["1x2x2"], tmp_path / "model", dtype=None)
    tensors = load_file(tmp_path / "model" / "model.safetensors")
    assert len(tensors) == len(original["saved"]) - 1  # the tied output layer under its first name only
    _assert_equal(tensors, {key: value for key, value in original["saved"].items() if key in tensors})
    model = TNLGForCausalLM.from_pretrained(tmp_path / "model")
    _assert_equal(dict(model.state_dict()), original["saved"])


def _without_stage_one(directory: Path, tmp_path: Path, damage: str) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(directory, copy)
    if damage == "missing part":
        shutil.rmtree(copy / "pipeline-01-tensor-00")
    else:  # the top manifest lists stage 0's part only
        _list_first_part_only(copy)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing part", r"pipeline-01-tensor-00/manifest\.json is missing.*pipeline stage 1, tensor rank 0"),
        ("part not listed", r"one sub-checkpoint per tensor rank 0\.\.0 of each pipeline stage 0\.\.1"),
    ],
)
def test_a_pipeline_checkpoint_missing_a_stage_is_named(chain, tmp_path, damage, message):
    directory = _without_stage_one(chain[0]["1x2x2"], tmp_path, damage)
    assert re.search(message, try_load(0, 1, None, 2, str(directory), 1, LAYERS) or "")
    with pytest.raises(CheckpointError, match=message):
        consolidate(directory, tmp_path / "model")


@pytest.mark.slow
def test_a_pipeline_checkpoint_of_another_model_fails_on_every_stage(chain):
    """Two stages of a 2-layer model: no stage holds layers 2-3 of the saved 4-layer model."""
    errors = run_distributed(try_load, 4, 1, 1, str(chain[0]["1x2x2"]), 2, 2, timeout=400)
    assert all(
        e is not None and "different model's parameters; unexpected: model.layers.2" in e for e in errors
    ), errors


@pytest.mark.parametrize(
    ("saved", "live", "process", "expected"),
    [
        ((1, 2, 2), (1, 2, 2), 3, (3, True)),  # the saved layout: each rank its own
        ((1, 2, 2), (1, 1, 4), 3, (0, False)),  # as many ranks and tensor 1 alike, but 4 replicas, not 2
        ((1, 2, 2), (2, 1, 2), 3, (1, True)),  # data replica 1: saved pipeline 0, data 1, tensor 0
        ((2, 1, 2), (1, 2, 2), 3, (2, True)),  # live pipeline 1, data 1: saved data 1 x tensor 2
    ],
    ids=["same", "other-data-degree", "pipeline-to-tensor", "tensor-to-pipeline"],
)
def test_a_run_resumes_each_replicas_data_position_across_pipeline_layouts(saved, live, process, expected):
    """`RunCheckpointer._data_state_rank` for layouts (tensor, pipeline, data) on 4 processes."""
    from types import SimpleNamespace

    from tnlg.run.checkpoint import RunCheckpointer
    from tnlg.sharding import ParallelDims

    tensor, pipeline, data = live
    data_rank = process // tensor % data  # the mesh is (pipeline, data, tensor), tensor innermost
    accelerator = SimpleNamespace(
        parallel_dims=ParallelDims(tensor=tensor, pipeline=pipeline, data=data),
        data_parallel_rank=data_rank,
        data_parallel_size=data,
        process_index=process,
        num_processes=4,
    )
    layout = dict(zip(("tensor", "pipeline", "data"), saved, strict=True))
    assert RunCheckpointer("unused", 1, accelerator)._data_state_rank(4, layout) == expected
