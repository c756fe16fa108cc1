"""The loss keywords of Transformers' `ForCausalLMLoss` (`shift_labels`, `ignore_index`,
`num_items_in_batch`) mean the same on every loss path: the logits path (the reference), the fused
Triton head (under TRITON_INTERPRET=1 on CPU) and the vocabulary-parallel loss of a sliced head."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tnlg.modeling import TNLGConfig, TNLGForCausalLM, apply_tensor_parallel
from tnlg.tools.spawn import run_distributed

IGNORED = 7  # a token id used as ignore_index: the labels hold it where no loss is wanted


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (2, 12), labels with IGNORED on the first three positions, and labels already shifted
    that score only the first half of each row."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(8, 500, (2, 12), generator=generator)
    labels = ids.clone()
    labels[:, :3] = IGNORED
    shifted = torch.full_like(ids, -100)
    shifted[:, :6] = ids[:, 1:7]
    return ids, labels, shifted


def _keyword_sets() -> dict[str, dict[str, Any]]:
    _, _, shifted = _batch()
    return {
        "shift_labels": {"shift_labels": shifted},
        "ignore_index": {"ignore_index": IGNORED},
        "ignore_index_and_num_items": {"ignore_index": IGNORED, "num_items_in_batch": torch.tensor(9)},
        "both": {"shift_labels": shifted.masked_fill(shifted == -100, IGNORED), "ignore_index": IGNORED},
    }


def _pair(fused_kernels: str) -> tuple[TNLGForCausalLM, TNLGForCausalLM]:
    """A model on the path under test and a reference on the logits path, with the same weights."""
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels=fused_kernels)).eval()
    reference = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels="none")).eval()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _loss_and_grad(model: TNLGForCausalLM, keywords: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and the gradient of a replicated parameter (the final LayerNorm's weight)."""
    ids, labels, _ = _batch()
    model.zero_grad()
    loss = model(ids, labels=labels, **keywords).loss
    loss.backward()
    return loss.detach(), model.model.final_layernorm.weight.grad.clone()


@pytest.mark.parametrize("name", list(_keyword_sets()))
def test_the_fused_head_honours_the_loss_keywords(name):
    keywords = _keyword_sets()[name]
    fused, reference = _pair("triton")
    loss, grad = _loss_and_grad(fused, keywords)
    expected, expected_grad = _loss_and_grad(reference, keywords)
    plain, _ = _loss_and_grad(reference, {})
    assert not torch.allclose(expected, plain)  # the keywords change the loss: the test can tell
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def vocab_parallel_keywords_case(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """Each keyword set's loss and replicated gradient, sliced over the world and on one process."""
    model, reference = _pair("none")
    apply_tensor_parallel(model, dist.new_group(list(range(world_size))))
    results = {}
    for name, keywords in _keyword_sets().items():
        results[name] = [*_loss_and_grad(model, keywords), *_loss_and_grad(reference, keywords)]
    return results


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_vocab_parallel_loss_honours_the_loss_keywords(world_size):
    for results in run_distributed(vocab_parallel_keywords_case, world_size, timeout=180):
        for name, (loss, grad, expected, expected_grad) in results.items():
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6, msg=name)
