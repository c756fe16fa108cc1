"""LoRA's adapters start from the run's seed: the same on every rank and in every rerun, whether the
base model is loaded from a checkpoint or initialized."""

from __future__ import annotations

import pytest
import torch

from tests.support.finetune_cases import save_base_model
from tnlg.run.finetune_config import LoraSection
from tnlg.run.lora import lora_model

pytest.importorskip("peft")


def adapters(architecture, init_from, seed: int) -> dict[str, torch.Tensor]:
    model = lora_model(architecture, init_from, LoraSection(enabled=True, r=4), seed)
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_A" in name}


@pytest.mark.parametrize("loaded", [True, False], ids=["from a checkpoint", "initialized"])
def test_the_adapters_are_drawn_from_the_seed_whatever_the_generator_held(tmp_path, loaded):
    from tnlg import TNLGConfig

    base = save_base_model(tmp_path / "base")
    architecture = TNLGConfig.from_pretrained(base)
    init_from = str(base) if loaded else None
    torch.manual_seed(123)  # a rank or a rerun whose generator was used differently before
    first = adapters(architecture, init_from, seed=7)
    torch.manual_seed(456)
    again = adapters(architecture, init_from, seed=7)
    other_seed = adapters(architecture, init_from, seed=8)
    assert first and first.keys() == again.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other_seed[name]) for name in first)
