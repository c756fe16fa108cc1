"""scripts/generate.py and GenerationSettings: sampling settings without sampling and a batch size
below 1 are refused before the model loads, never dropped or failed on mid-run."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from scripts.generate import main, parse_args
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.inference.generation import generate_texts
from tnlg.inference.settings import GenerationSettings
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.run.cli import exit_on_input_error
from tnlg.run.finetune_config import check_generation


@pytest.mark.parametrize("flag", ["--temperature", "--top-k", "--top-p"])
def test_sampling_flags_without_do_sample_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--prompt", "hi", flag, "1"])
    assert exit_info.value.code == 2 and f"{flag} shape sampling only" in capsys.readouterr().err
    assert getattr(parse_args(["--prompt", "hi", "--do-sample", flag, "1"]), flag[2:].replace("-", "_")) == 1


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--num-beams", "0"], "--num-beams 0: must be >= 1"),
        (["--do-sample", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    ],
)
def test_generation_settings_out_of_range_are_refused_before_the_model_loads(flags, named, capsys):
    # Transformers refused them after the model had loaded
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "debug", "--prompt", "hi", *flags])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("size", ["0", "-1"])
def test_a_batch_size_below_one_is_refused(size, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--prompt", "hi", "--batch-size", size])
    assert f"--batch-size {size}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        generate_texts(None, byte_level_tokenizer(), ["hi"], batch_size=int(size))


def test_sampling_settings_apply_with_do_sample_and_are_refused_without():
    tokenizer = byte_level_tokenizer()
    sampled = GenerationSettings(do_sample=True, temperature=0.7, top_k=5).to_generation_config(tokenizer)
    assert (sampled.temperature, sampled.top_k) == (0.7, 5)
    assert sampled.top_p == GenerationConfig().top_p  # left to Transformers' default
    with pytest.raises(ValueError, match=r"temperature is 0\.7"):
        GenerationSettings(temperature=0.7).to_generation_config(tokenizer)
    with pytest.raises(ValueError, match=r"top_p is 1\.5"):
        GenerationSettings(do_sample=True, top_p=1.5).to_generation_config(tokenizer)


def test_the_run_config_check_refuses_sampling_settings_without_do_sample():
    check_generation(GenerationSettings(), "evaluation.generation")  # defaults: Transformers'
    check_generation(GenerationSettings(do_sample=True, top_p=0.9), "evaluation.generation")
    with pytest.raises(ValueError, match=r"evaluation\.generation\.top_p must be left unset"):
        check_generation(GenerationSettings(top_p=0.9), "evaluation.generation")


def _sharded_precision(monkeypatch, tmp_path, mixed_precision: str | None, *flags: str) -> str:
    """The mixed precision scripts/generate.py loads a sharded model in, given a DeepSpeed JSON enabling
    `mixed_precision` (None: no --zero-config) and `flags`; nothing is loaded. The script hands
    load_sharded_model a settled ZeroConfig, and no dtype to settle it with again."""
    import scripts.generate as script

    seen = {}

    def load(model, config, *, tokenizer=None, dtype=None, device=None):
        assert dtype is None, "the precision is settled in the script, once"
        seen["mixed_precision"] = config.mixed_precision
        return object(), byte_level_tokenizer()

    monkeypatch.setattr(script, "load_sharded_model", load)
    monkeypatch.setattr(script, "generate_on_ranks", lambda engine, tokenizer, prompts, *_: list(prompts))
    arguments = ["--model", str(tmp_path), "--prompt", "hi", "--device", "cpu", "--zero-stage", "0", *flags]
    if mixed_precision is not None:
        deepspeed = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
        deepspeed[mixed_precision] = {"enabled": True}
        path = tmp_path / "deepspeed.json"
        path.write_text(json.dumps(deepspeed))
        arguments += ["--zero-config", str(path)]
    exit_on_input_error(script.main)(arguments)
    return seen["mixed_precision"]


def test_the_zero_configs_precision_holds_unless_dtype_is_given(monkeypatch, tmp_path):
    assert _sharded_precision(monkeypatch, tmp_path, "bf16") == "bf16"
    assert _sharded_precision(monkeypatch, tmp_path, "bf16", "--dtype", "bfloat16") == "bf16"
    assert _sharded_precision(monkeypatch, tmp_path, None, "--dtype", "float16") == "fp16"
    assert _sharded_precision(monkeypatch, tmp_path, None, "--dtype", "float32") == "no"
    assert _sharded_precision(monkeypatch, tmp_path, None) == "no"


@pytest.mark.parametrize(("dtype", "enabled"), [("float32", "bf16"), ("bfloat16", "fp16")])
def test_a_dtype_that_disagrees_with_the_zero_config_is_refused(
    monkeypatch, tmp_path, capsys, dtype, enabled
):
    with pytest.raises(SystemExit) as exit_info:
        _sharded_precision(monkeypatch, tmp_path, enabled, "--dtype", dtype)
    error = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(error) == 1
    assert f"--dtype {dtype}" in error[0] and "deepspeed.json" in error[0] and enabled in error[0]


@pytest.mark.parametrize(
    ("content", "problem"),
    [("{bad", "is not valid JSON"), ('{"model_type": "gpt2"}', "is a 'gpt2' model's config")],
)
def test_a_model_directory_whose_config_is_not_tnlgs_is_named(tmp_path, content, problem):
    # Transformers raised an OSError naming no cause for a damaged one, and read a GPT-2 config as TNLG's
    from tnlg.inference.generation import load_model_and_tokenizer

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=rf"config.json {problem}"):
        load_model_and_tokenizer(tmp_path, tokenizer="byte-level")


@pytest.mark.parametrize(
    ("prompts", "new_tokens", "named"),
    [
        ([""], 3, "prompt 0 ('') has no tokens"),
        (["ab", ""], 3, "prompt 1 ('') has no tokens"),  # in a batch it was continued as '' silently
        (["x" * 125], 5, "prompt 0 has 125 tokens: generating max_new_tokens 5 more needs 129 positions, past the model's 128"),
    ],
)  # fmt: skip
def test_a_prompt_that_cannot_be_continued_is_refused_before_generating(prompts, new_tokens, named, capsys):
    # an empty prompt failed deep inside generate() with an IndexError; an over-long one after the
    # whole batch was generated, naming a sequence length and no flag
    arguments = ["--model", "debug", "--max-new-tokens", str(new_tokens)]
    with pytest.raises(SystemExit) as exited:
        exit_on_input_error(main)(
            [*arguments, *(flag for prompt in prompts for flag in ("--prompt", prompt))]
        )
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_a_prompt_that_fills_the_positions_with_its_new_tokens_generates():
    # the last new token is never fed back: 124 + 5 tokens need 128 positions, not 129
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug")).eval()
    (completion,) = generate_texts(
        model, byte_level_tokenizer(), ["x" * 124], GenerationSettings(max_new_tokens=5)
    )
    assert isinstance(completion, str)
