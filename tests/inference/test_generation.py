"""generate(): greedy with and without the cache, sampling, batched left padding, and the CLI."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.data.tokenizer import END_OF_TEXT, byte_level_tokenizer, load_tokenizer
from tnlg.inference.generation import generate_texts, load_model_and_tokenizer, load_tokenizer_for
from tnlg.inference.settings import GenerationSettings


@pytest.fixture
def model() -> TNLGForCausalLM:
    # Larger init so that a random model's greedy choices are far from ties (stable argmax).
    config = TNLGConfig.from_preset("debug", initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    return TNLGForCausalLM(config).eval()


def _greedy(model, input_ids, use_cache, **kwargs):
    config = GenerationConfig(max_new_tokens=12, do_sample=False, use_cache=use_cache, pad_token_id=0)
    return model.generate(input_ids, generation_config=config, **kwargs)


def test_greedy_output_identical_with_and_without_cache(model):
    input_ids = torch.randint(0, 512, (3, 5))
    with_cache = _greedy(model, input_ids, use_cache=True)
    without_cache = _greedy(model, input_ids, use_cache=False)
    assert with_cache.shape == (3, 17)
    assert torch.equal(with_cache, without_cache)


def test_greedy_tokens_are_the_argmax_of_a_full_forward(model):
    output = _greedy(model, torch.randint(0, 512, (1, 4)), use_cache=True)
    logits = model(output).logits
    assert torch.equal(logits[0, 3:-1].argmax(-1), output[0, 4:])


def test_left_padded_batch_generates_what_each_prompt_generates_alone(model):
    long, short = torch.randint(1, 512, (1, 9)), torch.randint(1, 512, (1, 4))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], dim=1)])
    mask = (torch.arange(9) >= torch.tensor([[0], [5]])).long()
    together = _greedy(model, batch, use_cache=True, attention_mask=mask)
    assert torch.equal(together[0:1, 9:], _greedy(model, long, use_cache=True)[:, 9:])
    assert torch.equal(together[1:2, 9:], _greedy(model, short, use_cache=True)[:, 4:])


def test_sampling_is_seeded_and_stays_in_vocabulary(model):
    config = GenerationConfig(max_new_tokens=10, do_sample=True, top_k=0, temperature=1.5, pad_token_id=0)
    input_ids = torch.randint(0, 512, (2, 3))
    torch.manual_seed(7)
    first = model.generate(input_ids, generation_config=config)
    torch.manual_seed(7)
    second = model.generate(input_ids, generation_config=config)
    torch.manual_seed(8)
    third = model.generate(input_ids, generation_config=config)
    assert torch.equal(first, second)
    assert not torch.equal(first, third)
    assert first.min() >= 0 and first.max() < 512


def test_generate_texts_from_a_preset_in_batches():
    model, tokenizer = load_model_and_tokenizer("debug")
    prompts = ["The quick brown fox", "Turing", "a much longer prompt than the others in the batch"]
    settings = GenerationSettings(max_new_tokens=6)
    batched = generate_texts(model, tokenizer, prompts, settings, batch_size=3)
    alone = [generate_texts(model, tokenizer, [p], settings)[0] for p in prompts]
    assert batched == alone
    assert len(batched) == 3
    # a tokenizer set up to pad on the right (as for training) still generates left-padded batches
    tokenizer.padding_side, tokenizer.pad_token = "right", None
    assert generate_texts(model, tokenizer, prompts, settings, batch_size=3) == alone
    assert (tokenizer.padding_side, tokenizer.pad_token) == ("right", None)  # and is left as it was


def test_load_model_refuses_unknown_names():
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a preset"):
        load_model_and_tokenizer("no-such-model")


def test_checkpoint_without_tokenizer_needs_one(tmp_path):
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug"))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_model_and_tokenizer(tmp_path)
    loaded, tokenizer = load_model_and_tokenizer(tmp_path, tokenizer="byte-level")
    assert len(tokenizer) == 257 and torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_sampling_with_and_without_cache_draws_the_same_tokens(model):
    config = dict(max_new_tokens=10, do_sample=True, top_k=0, temperature=1.5, pad_token_id=0)
    input_ids = torch.randint(1, 512, (2, 6))
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0  # left padding too
    torch.manual_seed(3)
    cached = model.generate(
        input_ids, attention_mask=mask, generation_config=GenerationConfig(use_cache=True, **config)
    )
    torch.manual_seed(3)
    uncached = model.generate(
        input_ids, attention_mask=mask, generation_config=GenerationConfig(use_cache=False, **config)
    )
    assert torch.equal(cached, uncached)


def test_load_tokenizer_for_pads_on_the_left_with_eos(tmp_path):
    assert load_tokenizer_for("debug").padding_side == "left"
    saved = byte_level_tokenizer()
    saved.pad_token, saved.padding_side = None, "right"
    saved.save_pretrained(tmp_path)
    loaded = load_tokenizer_for(tmp_path)
    assert loaded.padding_side == "left" and loaded.pad_token_id == loaded.eos_token_id == 256
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer_for(tmp_path / "empty")


def test_the_one_loader_resolves_a_models_tokenizer(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    byte_level_tokenizer(eos_token="<|end|>").save_pretrained(checkpoint)
    assert load_tokenizer(model=checkpoint).eos_token == "<|end|>"  # the checkpoint's own
    assert load_tokenizer(checkpoint).eos_token == "<|end|>"  # or named as a directory
    assert load_tokenizer("byte-level", model=checkpoint).eos_token == END_OF_TEXT  # a named one wins
    assert load_tokenizer(model="debug").eos_token == END_OF_TEXT  # a preset: byte-level
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        load_tokenizer(model=tmp_path / "empty")
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a preset"):
        load_tokenizer(checkpoint, model="no-such-model")
    with pytest.raises(FileNotFoundError, match="no tokenizer directory at gpt2"):
        load_tokenizer("gpt2", model="debug")  # a hub name: nothing is downloaded
    with pytest.raises(ValueError, match="no tokenizer to load"):
        load_tokenizer()


def test_tokenizer_too_large_for_the_model_is_refused(tmp_path):
    TNLGForCausalLM(TNLGConfig.from_preset("debug", vocab_size=200)).save_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="257 tokens"):
        load_model_and_tokenizer(tmp_path)


def test_generate_script_prints_one_line_per_prompt(capsys):
    from scripts.generate import main

    main(["--model", "debug", "--prompt", "hello", "--prompt", "world", "--max-new-tokens", "4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" -> ")[0] for line in lines] == ["'hello'", "'world'"]


def test_generation_draws_no_id_from_the_padded_part_of_the_vocabulary(monkeypatch):
    """The debug preset pads the vocabulary to 512 rows; the byte-level tokenizer has 257 ids. Rows
    257-511 have no token: sampling must not draw them (decoding would drop them silently)."""
    model, tokenizer = load_model_and_tokenizer("debug")
    assert len(tokenizer) < model.config.vocab_size
    generated = []
    generate = model.generate

    def keep(*args, **kwargs):
        generated.append(generate(*args, **kwargs))
        return generated[-1]

    monkeypatch.setattr(model, "generate", keep)
    torch.manual_seed(0)
    settings = GenerationSettings(max_new_tokens=16, do_sample=True, top_k=0, temperature=2.0)
    generate_texts(model, tokenizer, ["hello", "abc"], settings)
    assert generated[0].max() < len(tokenizer)
    # Without it, this draw reaches past the tokenizer (so the assertion above can fail).
    torch.manual_seed(0)
    batch = tokenizer(["hello", "abc"], return_tensors="pt", padding=True)
    plain = generate(**batch, generation_config=settings.to_generation_config(tokenizer))
    assert plain.max() >= len(tokenizer)
