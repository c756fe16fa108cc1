"""Sequences packed in a row (positions restarting at 0, no attention mask) stay apart in every forward:
with labels or without, with the cache an evaluation forward builds or one asked for."""

from __future__ import annotations

import pytest
import torch

from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.transformers_compat import output_cache


@pytest.fixture(params=["eager", "sdpa"])
def model(request) -> TNLGForCausalLM:
    config = TNLGConfig.from_preset("debug", fused_kernels="none")
    return TNLGForCausalLM._from_config(config, attn_implementation=request.param).eval()


def _packed() -> tuple[torch.Tensor, torch.Tensor]:
    """Two documents of 4 tokens in one row, and their positions."""
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(5))
    return ids, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])


@torch.no_grad()
def test_packed_logits_do_not_depend_on_labels(model):
    ids, positions = _packed()
    without_labels = model(ids, position_ids=positions)
    with_labels = model(ids, position_ids=positions, labels=ids)
    assert output_cache(without_labels) is not None  # an evaluation forward still returns its cache
    torch.testing.assert_close(without_labels.logits, with_labels.logits, rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("use_cache", [None, True])
def test_the_second_packed_document_equals_it_alone(model, use_cache):
    ids, positions = _packed()
    packed = model(ids, position_ids=positions, use_cache=use_cache).logits
    alone = model(ids[:, 4:], use_cache=use_cache).logits
    torch.testing.assert_close(packed[:, 4:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, :4], model(ids[:, :4]).logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_filled_cache_still_lets_the_next_token_see_the_prefix(model):
    """Only an empty cache is left out of the mask: decoding on from a filled one attends to it."""
    ids = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(6))
    cache = output_cache(model(ids[:, :5], use_cache=True))
    step = model(ids[:, 5:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], rtol=1e-5, atol=1e-5)
