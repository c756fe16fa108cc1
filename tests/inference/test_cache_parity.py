"""The KV cache changes what generate() computes, never what it produces.

A guard for [Note: the cache's name] (modeling/transformers_compat.py): a Transformers release that
hands the model its cache under a name the model does not read makes each cached step see only its
newest token, which gives other tokens and no error. Cached and uncached generate() must agree token for
token for greedy, seeded sampling and beam search on a left-padded batch; the sharded path's guard is in
test_distributed_generation.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tnlg import TNLGConfig, TNLGForCausalLM

DECODINGS = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 1.5},
    "beam-search": {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
}
NEW_TOKENS = 10
PROMPT_LENGTH = 9


@pytest.fixture
def model() -> TNLGForCausalLM:
    torch.manual_seed(0)
    # A wide init keeps a random model's choices far from ties, so the cache's rounding cannot flip one.
    config = TNLGConfig.from_preset("debug", initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    return TNLGForCausalLM(config).eval()


def _left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 9, 6 and 3 tokens, left padded with id 0 to 9."""
    input_ids = torch.randint(1, 512, (3, PROMPT_LENGTH))
    attention_mask = (torch.arange(PROMPT_LENGTH) >= torch.tensor([[0], [3], [6]])).long()
    return input_ids * attention_mask, attention_mask


def _generate(model: TNLGForCausalLM, use_cache: bool, decoding: dict) -> torch.Tensor:
    input_ids, attention_mask = _left_padded_batch()
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, use_cache=use_cache, pad_token_id=0, **decoding)
    torch.manual_seed(11)  # the same draws for both runs when sampling
    return model.generate(input_ids, attention_mask=attention_mask, generation_config=config)


@pytest.mark.parametrize("decoding", DECODINGS)
def test_cached_generate_equals_uncached_token_for_token(model, decoding):
    torch.manual_seed(1)
    cached = _generate(model, True, DECODINGS[decoding])
    torch.manual_seed(1)
    uncached = _generate(model, False, DECODINGS[decoding])
    rows = 3 * DECODINGS[decoding].get("num_return_sequences", 1)
    assert cached.shape == (rows, PROMPT_LENGTH + NEW_TOKENS)
    assert torch.equal(cached, uncached)


def test_cached_generate_feeds_the_model_one_token_and_the_grown_cache_per_step(model):
    """The cache is really used (not silently rebuilt each step): after the prompt, each forward gets one
    new token per row and a cache holding every token before it."""
    steps: list[tuple[int, int | None]] = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache")
        steps.append((kwargs["input_ids"].shape[1], None if cache is None else cache.get_seq_length()))

    handle = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        torch.manual_seed(1)
        _generate(model, True, DECODINGS["greedy"])
    finally:
        handle.remove()
    assert [length for length, _ in steps] == [PROMPT_LENGTH] + [1] * (NEW_TOKENS - 1)
    assert [cached for _, cached in steps[1:]] == list(range(PROMPT_LENGTH, PROMPT_LENGTH + NEW_TOKENS - 1))
