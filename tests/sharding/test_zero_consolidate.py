"""Consolidating an engine checkpoint into a Transformers model, offline and streaming."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.support import REPO
from tests.support.zero_tnlg_cases import debug_model
from tnlg import TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding import consolidate as consolidate_module
from tnlg.sharding.consolidate import consolidate, parse_size
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)


def _train_and_save(rank, world_size, stage, directory):
    model = debug_model()
    config = ZeroConfig(stage=stage, reduce_bucket_size=20_000, param_persistence_threshold=1_000)
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    engine.save_checkpoint(directory)
    state = engine.full_state_dict()
    dist.barrier()
    return state


@pytest.fixture(scope="module", params=[2, 3], ids=["stage2", "stage3"])
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"stage{request.param}") / "engine"
    state = run_distributed(_train_and_save, 2, request.param, str(directory))[0]
    return directory, state


def test_consolidation_streams_shard_by_shard_and_loads_with_from_pretrained(
    checkpoint, tmp_path, monkeypatch
):
    directory, trained = checkpoint
    written_sizes = []
    real_save_file = consolidate_module.save_file

    def recording_save_file(tensors, path, metadata=None):
        written_sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        real_save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(consolidate_module, "save_file", recording_save_file)
    largest_tensor = max(t.numel() * 4 for t in trained.values())
    limit = max(largest_tensor, 150_000)
    consolidate(directory, tmp_path, max_shard_size=limit)
    assert len(written_sizes) > 2  # several shards, each written and released before the next
    assert max(written_sizes) <= limit  # never more than one shard's tensors in memory at once
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = TNLGForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name  # the fp32 master weights, exactly


def test_the_convert_script_consolidates_to_bf16(checkpoint, tmp_path):
    directory, trained = checkpoint
    command = [
        sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "--from", "zero",
        "--input", str(directory.parent), "--output", str(tmp_path), "--dtype", "bfloat16",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    model = TNLGForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16
    torch.testing.assert_close(
        model.lm_head.weight, trained["lm_head.weight"].to(torch.bfloat16), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("size", "expected"), [(123, 123), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2**31)]
)
def test_shard_sizes_parse(size, expected):
    assert parse_size(size) == expected


def test_a_bad_shard_size_is_named():
    with pytest.raises(ValueError, match="'lots' is not a size"):
        parse_size("lots")
