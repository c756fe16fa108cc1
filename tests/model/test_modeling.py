"""TNLGForCausalLM: loss, attention implementations, masks, KV cache, init, checkpointing, Auto classes."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

from tests.support.positions import watch_positions
from tnlg import TNLGConfig, TNLGForCausalLM, TNLGModel
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.modeling.modeling_tnlg import TNLGMLP
from tnlg.modeling.transformers_compat import enable_checkpointing, output_cache


def test_loss_is_shifted_cross_entropy_ignoring_minus_100(debug_model):
    input_ids = torch.randint(0, 512, (3, 20))
    labels = input_ids.clone()
    labels[0, :7] = -100
    labels[2, 12:] = -100
    output = debug_model(input_ids, labels=labels)
    logits = output.logits[:, :-1].reshape(-1, 512)
    targets = labels[:, 1:].reshape(-1)
    keep = targets != -100
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert output.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert output.logits.shape == (3, 20, 512)


def test_sdpa_attention_equals_eager(debug_config):
    reference = TNLGForCausalLM._from_config(debug_config, attn_implementation="eager").eval()
    other = TNLGForCausalLM._from_config(debug_config, attn_implementation="sdpa").eval()
    other.load_state_dict(reference.state_dict())
    input_ids = torch.randint(0, 512, (2, 33))
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0
    torch.testing.assert_close(
        other(input_ids, attention_mask=mask).logits,
        reference(input_ids, attention_mask=mask).logits,
        atol=1e-5,
        rtol=1e-5,
    )


def test_causality_future_tokens_do_not_change_past_logits(debug_model):
    input_ids = torch.randint(0, 512, (1, 16))
    changed = input_ids.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 512
    a, b = debug_model(input_ids).logits, debug_model(changed).logits
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_left_padded_batch_equals_unpadded_sequences(debug_config, implementation):
    model = TNLGForCausalLM._from_config(debug_config, attn_implementation=implementation).eval()
    long, short = torch.randint(0, 512, (1, 12)), torch.randint(0, 512, (1, 7))
    pad = torch.full((1, 5), 3)
    batch = torch.cat([long, torch.cat([pad, short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    logits = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0:1], model(long).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1:2, 5:], model(short).logits, atol=1e-5, rtol=1e-5)


def test_kv_cache_step_by_step_equals_full_forward(debug_model):
    input_ids = torch.randint(0, 512, (2, 14))
    full = debug_model(input_ids).logits
    cache = DynamicCache(config=debug_model.config)
    prefix = debug_model(input_ids[:, :9], cache=cache, use_cache=True)
    assert output_cache(prefix) is cache
    steps = [prefix.logits]
    for t in range(9, 14):
        steps.append(debug_model(input_ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert cache.get_seq_length() == 14
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_the_cache_passed_by_its_old_name_is_the_same_cache(debug_model):
    """`past_key_values` (the name Transformers 5.17's generate() and older user code pass) is read as
    `cache`, not dropped ([Note: the cache's name]); passing both is refused."""
    input_ids = torch.randint(0, 512, (1, 6))
    cache = DynamicCache(config=debug_model.config)
    debug_model(input_ids[:, :5], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 5
    by_old_name = debug_model(input_ids[:, 5:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(by_old_name[:, -1], debug_model(input_ids).logits[:, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pass the key-value cache once"):
        debug_model(input_ids[:, 5:], cache=cache, past_key_values=cache)


def test_sequence_longer_than_positions_is_refused(debug_model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        debug_model(torch.zeros(1, 129, dtype=torch.long))


def test_hidden_states_and_attentions_are_returned(debug_config):
    model = TNLGForCausalLM._from_config(debug_config, attn_implementation="eager").eval()
    output = model(torch.randint(0, 512, (2, 6)), output_hidden_states=True, output_attentions=True)
    assert len(output.hidden_states) == debug_config.num_hidden_layers + 1
    assert len(output.attentions) == debug_config.num_hidden_layers
    assert output.attentions[0].shape == (2, 4, 6, 6)
    # Each row of attention probabilities sums to one and puts no weight on the future.
    torch.testing.assert_close(output.attentions[0].sum(-1), torch.ones(2, 4, 6))
    assert output.attentions[0].triu(diagonal=1).abs().max() == 0


def test_gpt2_style_init():
    config = TNLGConfig(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = TNLGForCausalLM(config)
    block = model.model.layers[3]
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert block.self_attn.out_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp.fc_out.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.self_attn.qkv_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.model.embed_positions.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.fc_in.bias.abs().max() == 0
    assert torch.equal(block.input_layernorm.weight, torch.ones(256))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gradient_checkpointing_gives_the_same_gradients(debug_config, monkeypatch):
    model = TNLGForCausalLM(debug_config).train()
    input_ids = torch.randint(0, 512, (2, 16))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = gradients()
    enable_checkpointing(model, {"use_reentrant": False})  # by the release's name for the switch
    calls = []
    mlp_forward = TNLGMLP.forward
    monkeypatch.setattr(TNLGMLP, "forward", lambda self, x: calls.append(1) or mlp_forward(self, x))
    checkpointed = gradients()
    # Each block's MLP runs in forward and again when backward recomputes it: activations were not kept.
    assert len(calls) == 2 * debug_config.num_hidden_layers
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


def test_checkpointing_recomputes_the_forward_with_the_hooks_outside(debug_config, monkeypatch):
    """On every Transformers release ([Note: checkpointing the forward]): a block's forward hooks run once
    per training step, not again in the recomputation, and `every_n_layers` checkpoints only those blocks."""
    model = TNLGForCausalLM(debug_config).train()
    layers = debug_config.num_hidden_layers
    assert layers >= 2
    hooks = []
    for block in model.model.layers:
        block.register_forward_pre_hook(lambda module, args: hooks.append(module))
    calls = []
    mlp_forward = TNLGMLP.forward
    monkeypatch.setattr(TNLGMLP, "forward", lambda self, x: calls.append(1) or mlp_forward(self, x))
    input_ids = torch.randint(0, 512, (2, 16))

    def step():
        hooks.clear()
        calls.clear()
        model(input_ids, labels=input_ids).loss.backward()

    enable_checkpointing(model, {"use_reentrant": False}, every_n_layers=2)
    step()
    checkpointed = [block.gradient_checkpointing for block in model.model.layers]
    assert checkpointed == [index % 2 == 0 for index in range(layers)]
    assert len(hooks) == layers and len(calls) == layers + sum(checkpointed)
    enable_checkpointing(model, {"use_reentrant": False})
    step()
    assert len(hooks) == layers and len(calls) == 2 * layers


def test_checkpointed_training_forward_leaves_a_cache_unwritten(debug_config):
    """Under activation checkpointing each block is handed the cache by the name Transformers clears
    ([Note: the cache's name]): were it another, backward's recomputation would write it a second time."""
    model = TNLGForCausalLM(debug_config).train()
    enable_checkpointing(model, {"use_reentrant": False})
    input_ids = torch.randint(0, 512, (2, 8))
    cache = DynamicCache(config=debug_config)
    model(input_ids, cache=cache, use_cache=True).logits.sum().backward()
    assert cache.get_seq_length() == 0


def test_resize_token_embeddings_keeps_rows_and_tying(debug_model):
    old = debug_model.model.embed_tokens.weight.detach().clone()
    debug_model.resize_token_embeddings(600)
    assert debug_model.config.vocab_size == 600
    assert debug_model.model.embed_tokens.weight.shape == (600, 64)
    assert debug_model.lm_head.weight is debug_model.model.embed_tokens.weight
    torch.testing.assert_close(debug_model.model.embed_tokens.weight[:512], old)
    assert debug_model(torch.tensor([[599, 1]])).logits.shape == (1, 2, 600)


def test_auto_classes_build_tnlg(debug_config):
    assert type(AutoModelForCausalLM.from_config(debug_config)) is TNLGForCausalLM
    assert type(AutoModel.from_config(debug_config)) is TNLGModel


def test_dropout_is_active_only_in_training(debug_config):
    config = TNLGConfig.from_preset("debug", hidden_dropout=0.5, attention_dropout=0.5, embedding_dropout=0.5)
    model = TNLGForCausalLM(config)
    input_ids = torch.randint(0, 512, (1, 8))
    model.eval()
    torch.testing.assert_close(model(input_ids).logits, model(input_ids).logits)
    model.train()
    assert not torch.allclose(model(input_ids).logits, model(input_ids).logits)


def test_exactly_one_of_input_ids_and_embeddings(debug_model):
    with pytest.raises(ValueError, match="exactly one"):
        debug_model.model()
    embeds = debug_model.model.embed_tokens(torch.tensor([[1, 2, 3]]))
    torch.testing.assert_close(
        debug_model(inputs_embeds=embeds).logits, debug_model(torch.tensor([[1, 2, 3]])).logits
    )


def test_token_type_ids_are_refused_by_name(debug_model):
    # They were ignored without a word: GPT-2 adds token-type embeddings, so a converted model differed.
    input_ids = torch.randint(0, 512, (2, 6))
    for forward in (debug_model, debug_model.model):
        with pytest.raises(ValueError, match="token_type_ids given, but TNLG has no token-type embeddings"):
            forward(input_ids, token_type_ids=torch.zeros_like(input_ids))
    torch.testing.assert_close(
        debug_model(input_ids, token_type_ids=None).logits, debug_model(input_ids).logits
    )


def test_the_paths_that_feed_token_type_ids_still_work(debug_model):
    # A tokenizer batch carries them only when asked; generate() refuses them in its own words; the
    # Trainer keeps only the dataset columns forward's signature names, which leaves them out.
    tokenizer = byte_level_tokenizer()
    batch = tokenizer(["ab", "abc"], return_tensors="pt", padding=True)
    assert "token_type_ids" not in batch
    assert debug_model.generate(**batch, max_new_tokens=2).shape == (2, 5)
    with pytest.raises(ValueError, match="token_type_ids"):
        debug_model.generate(**batch, token_type_ids=torch.zeros_like(batch["input_ids"]), max_new_tokens=2)
    assert "token_type_ids" not in inspect.signature(debug_model.forward).parameters


def test_bf16_forward_and_backward_run(debug_config):
    model = TNLGForCausalLM(debug_config).to(torch.bfloat16)
    input_ids = torch.randint(0, 512, (2, 8))
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert loss.dtype == torch.float32  # the loss upcasts logits
    assert model.model.layers[0].self_attn.qkv_proj.weight.grad.dtype == torch.bfloat16


def test_tuple_outputs_with_return_dict_false(debug_model):
    input_ids = torch.randint(0, 512, (1, 5))
    loss, logits, *_ = debug_model(input_ids, labels=input_ids, return_dict=False)
    torch.testing.assert_close(logits, debug_model(input_ids).logits)
    assert loss.ndim == 0


def test_a_cache_is_built_only_where_it_can_be_used(debug_config):
    """A loss, or a training forward, keeps no KV cache unless asked: every layer's keys and values would
    be held for nothing. An evaluation forward without labels returns one, as Transformers models do."""
    model = TNLGForCausalLM(debug_config)
    input_ids = torch.randint(0, 512, (1, 5))
    assert output_cache(model.train()(input_ids)) is None
    assert output_cache(model(input_ids, use_cache=True)) is not None
    with torch.no_grad():
        assert output_cache(model.eval()(input_ids, labels=input_ids)) is None
        assert output_cache(model(input_ids)) is not None


def test_mask_that_skips_the_cached_tokens_is_refused(debug_model):
    cache = output_cache(debug_model(torch.randint(0, 512, (1, 4)), use_cache=True))
    with pytest.raises(ValueError, match="cache holds 4"):
        debug_model(torch.tensor([[7]]), attention_mask=torch.ones(1, 1), cache=cache)


def test_labels_with_logits_to_keep_are_refused(debug_model):
    input_ids = torch.randint(0, 512, (1, 5))
    with pytest.raises(ValueError, match="logits_to_keep"):
        debug_model(input_ids, labels=input_ids, logits_to_keep=1)


def test_only_the_callers_positions_are_searched_for_packed_sequences(debug_model, monkeypatch):
    """Transformers finds sequences packed in a row by reading a value back from the device: the mask
    once per forward, flash attention in every layer. Positions the model counts itself (0, 1, ...) hold
    one sequence a row, so neither is handed them."""
    seen = watch_positions(monkeypatch, debug_model.model.layers[0])
    ids = torch.randint(0, debug_model.config.vocab_size, (2, 12))
    counted = debug_model(input_ids=ids, labels=ids)
    assert seen.searched == [] and seen.block_given == [None]
    positions = torch.arange(12).unsqueeze(0)
    given = debug_model(input_ids=ids, labels=ids, position_ids=positions)
    assert len(seen.searched) == 1  # the caller's positions may pack several sequences: still searched
    assert seen.block_given[1] is positions
    torch.testing.assert_close(given.logits, counted.logits, rtol=0, atol=0)
