"""Settings that would not be applied, or would fail only after training, are refused when the
config is read, each by its dotted name."""

from __future__ import annotations

import json

import pytest

from tnlg.run.config import load_run_config
from tnlg.run.finetune_config import load_finetune_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--evaluation.batch_size", "0"], "evaluation.batch_size must be >= 1"),
        (["--evaluation.max_examples", "-5"], "evaluation.max_examples must be >= 1"),
        (["--evaluation.generation.num_beams", "0"], "evaluation.generation.num_beams must be >= 1"),
        (
            ["--evaluation.generation.max_new_tokens", "0"],
            "evaluation.generation.max_new_tokens must be >= 1",
        ),
        (["--evaluation.generation.top_p", "0"], "evaluation.generation.top_p must be in (0, 1]"),
        (["--evaluation.generation.temperature", "0"], "evaluation.generation.temperature must be"),
        (["--lora.enabled", "true", "--parallel.tensor", "2"], "lora.enabled with parallel.tensor 2"),
        (["--lora.r", "4"], "lora.r is set but lora.enabled is false"),
        (["--lora.enabled", "true", "--lora.r", "0"], "lora.r must be >= 1"),
        (["--lora.enabled", "true", "--lora.alpha", "0"], "lora.alpha must be > 0"),
        (["--lora.enabled", "true", "--lora.dropout", "1.0"], "lora.dropout must be in [0, 1)"),
        (["--data.paths", "[a.jsonl]", "--data.split", "test"], "data.split 'test' names a split"),
        (["--data.paths", "[a.jsonl]", "--data.dataset", "embedded:qa"], "is an embedded set, read instead"),
        (["--data.max_examples", "0"], "data.max_examples must be >= 1"),
        (["--train.seed", "-1"], "train.seed must be an integer in [0, 2**32), got -1"),
        (
            [
                "--data.dataset",
                "embedded:qa",
                "--data.validation_split",
                "test",
                "--data.validation_paths",
                "[f.jsonl]",
            ],
            "data.validation_split 'test' and data.validation_paths are both given",
        ),
        (["--data.dataset_config", "3.0.0"], "the embedded set 'embedded:docstrings' has none"),
        (
            ["--data.paths", "[a.jsonl]", "--data.dataset_config", "x"],
            "read by their format's builder have none",
        ),
        (
            ["--data.dataset", "csv", "--data.paths", "[a.txt]", "--data.dataset_config", "x"],
            "the csv builder have",
        ),
    ],
)
def test_fine_tuning_mistakes_are_refused_when_read(overrides, message):
    with pytest.raises(ValueError) as raised:
        load_finetune_config(None, overrides)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.overrides.num_hiden_layers", "2"], "did you mean model.overrides.num_hidden_layers?"),
        (["--model.preset", "debgu"], "model.preset must be one of"),
        (["--data.pretokenized", "[{prefix: a, weight: 0}]"], "weight must be a finite number > 0"),
        (["--data.pretokenized", "[{prefix: a, weight: -1}, {prefix: b}]"], "'a': weight must be"),
        (["--data.pretokenized", "[{prefix: a, weight: .inf}]"], "weight must be a finite number > 0"),
        (["--data.sources", "[{name: s, paths: [a.jsonl], weight: 0}]"], "source 's': weight must be"),
        (["--data.sources", "[{name: s, paths: [a.jsonl], weight: .nan}]"], "source 's': weight must be"),
        (["--train.seed", "-1"], "train.seed must be an integer in [0, 2**32), got -1"),
        (["--train.seed", str(2**32)], "train.seed must be an integer in [0, 2**32)"),
        (
            ["--data.pretokenized", "[{prefix: a}]", "--data.sources", "[{name: s, paths: [a.jsonl]}]"],
            "data.sources and data.pretokenized are both given",
        ),
        (["--data.pretokenized", "[{prefix: a}]", "--data.shuffle_buffer", "64"], "data.shuffle_buffer 64"),
        (["--data.pretokenized", "[{prefix: a}]", "--data.on_bad_record", "fatal"], "data.on_bad_record"),
        (["--data.on_bad_record", "ignore"], "data.on_bad_record must be one of"),
        (["--data.sources", "[{name: s, paths: [a.jsonl], split: test}]"], "split 'test' names a split"),
        (["--data.sources", "[{name: s, paths: [a.jsonl], dataset_config: en}]"], "dataset_config 'en'"),
        (  # refused only once the stream was built, after the engine
            ["--data.sources", "[{name: s, paths: [a.jsonl]}, {name: s, paths: [b.jsonl]}]"],
            "data.sources names must be unique (named more than once: ['s'])",
        ),
        (
            ["--data.validation_sources", "[{name: v, paths: [a.jsonl]}, {name: v, paths: [b.jsonl]}]"],
            "data.validation_sources names must be unique",
        ),
        (["--optimizer.lr", "inf"], "optimizer.lr must be >= 0 and finite"),
        (["--optimizer.lr", "nan"], "optimizer.lr must be >= 0 and finite"),
        (["--optimizer.lr", "-1e-3"], "optimizer.lr must be >= 0 and finite"),
        (["--optimizer.weight_decay", "inf"], "optimizer.weight_decay must be >= 0 and finite"),
        (["--optimizer.eps", "inf"], "optimizer.eps must be > 0 and finite"),
        (
            ["--train.collective_timeout_minutes", "0"],
            "collective_timeout_minutes must be a finite number > 0",
        ),
        (["--train.collective_timeout_minutes", "inf"], "collective_timeout_minutes must be a finite number"),
    ],
)
def test_pretraining_mistakes_are_refused_when_read(overrides, message):
    with pytest.raises(ValueError) as raised:
        load_run_config(None, overrides)
    assert message in str(raised.value)


def test_a_known_override_key_is_kept():
    assert load_run_config(None, ["--model.overrides.num_hidden_layers", "3"]).model.overrides == {
        "num_hidden_layers": 3
    }


def test_yaml_boolean_spellings_are_text_in_text_fields(tmp_path):
    # YAML 1.1 reads `no` as False: a text field gets what the user typed, a boolean field the boolean
    assert load_run_config(None, ["--train.mixed_precision", "no"]).train.mixed_precision == "no"
    config = tmp_path / "run.yaml"
    config.write_text(
        "train: {mixed_precision: no, overwrite: yes}\n"
        "model: {activation_checkpointing: {enabled: on}, overrides: {use_cache: off}}\n"
    )
    loaded = load_run_config(config)
    assert loaded.train.mixed_precision == "no"
    assert loaded.train.overwrite is True
    assert loaded.model.activation_checkpointing.enabled is True
    assert loaded.model.overrides == {"use_cache": False}
    finetune = load_finetune_config(
        None, ["--train.mixed_precision", "no", "--evaluation.before_training", "yes"]
    )
    assert finetune.train.mixed_precision == "no"
    assert finetune.evaluation.before_training is True


def test_a_yes_in_a_number_field_is_still_refused():
    with pytest.raises(ValueError, match=r"train\.max_steps: expected int, got True"):
        load_run_config(None, ["--train.max_steps", "yes"])


@pytest.mark.parametrize(("written", "refused"), [(2, True), (8, False), ("auto", False)])
def test_a_deepspeed_micro_batch_must_be_the_runs(tmp_path, written, refused):
    from tnlg.run.loop import check_deepspeed_micro_batch

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": written})
    )
    config = load_run_config(None, ["--zero.deepspeed", str(path), "--train.micro_batch_size", "8"])
    settings = config.zero.engine_settings(config.train.mixed_precision)
    if refused:
        with pytest.raises(
            ValueError, match=r"sets train_micro_batch_size_per_gpu 2 but train\.micro_batch_size is 8"
        ):
            check_deepspeed_micro_batch(settings, config.train.micro_batch_size)
    else:
        check_deepspeed_micro_batch(settings, config.train.micro_batch_size)
