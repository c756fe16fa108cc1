"""ZeroAccelerator's lifecycle calls as Accelerate users make them: free_memory() closes the engine so the
next model gets its own (backward, clipping and saving went on acting on the first), a second model while
one is prepared, add_param_group, prepare_model / prepare_optimizer for training and save_model's pickled
files are refused by name (each was taken and not applied), and a plain module saves in shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.accelerate_cases import refusal
from tests.support.zero_tnlg_cases import debug_model
from tnlg.accelerate import ZeroAccelerator
from tnlg.sharding import ZeroConfig
from tnlg.tools.spawn import run_distributed


def _clipped_training(accelerator: ZeroAccelerator, seed: int) -> dict:
    """Three clipped steps of a fresh debug model (seeded `seed`) prepared on `accelerator`."""
    torch.manual_seed(seed)
    model = debug_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(accelerator.process_index))
    norms, losses = [], []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.05)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"norms": norms, "losses": losses, "model": model, "optimizer": optimizer}


def _lifecycle(rank: int, world_size: int, directory: str) -> dict:
    fresh = _clipped_training(ZeroAccelerator(zero_config=ZeroConfig(stage=2)), seed=1)
    accelerator = ZeroAccelerator(zero_config=ZeroConfig(stage=2))
    first = _clipped_training(accelerator, seed=0)
    second_model = debug_model()
    refusals = {
        "second": refusal(
            lambda: accelerator.prepare(second_model, torch.optim.SGD(second_model.parameters(), lr=0.1))
        ),
        "add_param_group": refusal(
            lambda: first["optimizer"].add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        ),
        "prepare_model": refusal(lambda: accelerator.prepare_model(debug_model())),
        "prepare_optimizer": refusal(
            lambda: accelerator.prepare_optimizer(torch.optim.SGD(second_model.parameters(), lr=0.1))
        ),
        "pickles": refusal(lambda: accelerator.save_model(first["model"], f"{directory}/bin", safe_serialization=False)),
    }  # fmt: skip
    evaluation_only = type(accelerator.prepare_model(debug_model(), evaluation_mode=True)).__name__
    old_engine = accelerator.engine
    accelerator.free_memory()
    second = _clipped_training(accelerator, seed=1)
    plain = _plain_module_saved(directory)
    return {
        "fresh": {k: fresh[k] for k in ("norms", "losses")},
        "second": {k: second[k] for k in ("norms", "losses")},
        "engines": len(accelerator.engines), "old_closed": old_engine.closed,
        "refusals": refusals, "evaluation_only": evaluation_only, "plain": plain,
        "bin_written": Path(f"{directory}/bin").exists(),
    }  # fmt: skip


def _plain_module_saved(directory: str) -> dict:
    """A plain nn.Module trained by the engine, saved in shards of at most 300 bytes."""
    accelerator = ZeroAccelerator(zero_config=ZeroConfig(stage=3))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    engine, _ = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    expected = {name: tensor.clone() for name, tensor in accelerator.get_state_dict(engine).items()}
    accelerator.save_model(engine, f"{directory}/plain", max_shard_size=300)
    output = Path(directory) / "plain"
    loaded = {}
    for shard in sorted(output.glob("*.safetensors")):
        loaded.update(load_file(shard))
    index = json.loads((output / "model.safetensors.index.json").read_text())
    return {
        "files": sorted(path.name for path in output.iterdir()),
        # the consolidated state is the main process's (an empty dict elsewhere)
        "equal": expected.keys() == loaded.keys()
        and all(torch.equal(expected[k], loaded[k]) for k in expected),
        "indexed": sorted(index["weight_map"]) == sorted(loaded),
    }


@pytest.mark.slow
def test_free_memory_starts_over_and_what_the_engine_cannot_apply_is_refused(tmp_path):
    for rank, result in enumerate(run_distributed(_lifecycle, 2, str(tmp_path), timeout=600)):
        # after free_memory the second model trains and clips exactly as on a fresh accelerator
        assert result["second"] == result["fresh"] and min(result["second"]["norms"]) > 0
        assert result["engines"] == 1 and result["old_closed"]
        refusals = result["refusals"]
        assert "one model with the ZeRO engine at a time" in refusals["second"]
        assert "add_param_group" in refusals["add_param_group"]
        assert "prepare_model trains a model under DDP" in refusals["prepare_model"]
        assert "prepare_optimizer" in refusals["prepare_optimizer"]
        assert "safetensors only" in refusals["pickles"] and not result["bin_written"]
        assert result["evaluation_only"] != "DistributedDataParallel"
        plain = result["plain"]
        assert plain["indexed"] and (plain["equal"] if rank == 0 else True)
        assert "model.safetensors.index.json" in plain["files"] and "tnlg_checksums.json" in plain["files"]
        assert sum(name.endswith(".safetensors") for name in plain["files"]) > 1
