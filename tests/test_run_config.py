"""Typed run configs: YAML sections, dotted overrides, unknown keys and wrong types named."""

from __future__ import annotations

import pytest

from tnlg.config import load_run_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: debug\n  overrides: {hidden_size: 128}\ntrain:\n  max_steps: 50\n")
    config = load_run_config(path, ["--train.max_steps", "20", "--zero.stage", "3", "--optimizer.lr=1e-3"])
    assert config.model.overrides == {"hidden_size": 128}
    assert (config.train.max_steps, config.zero["stage"], config.optimizer.lr) == (20, 3, 1e-3)
    assert config.train.micro_batch_size == 8  # untouched default


def test_sources_become_typed_sections(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  sources:\n    - {name: web, paths: [a.jsonl], weight: 2}\n")
    source = load_run_config(path).data.sources[0]
    assert (source.name, source.paths, source.weight) == ("web", ["a.jsonl"], 2.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.max_step", "3"], "unknown config key train.max_step"),
        (["--trian.max_steps", "3"], "unknown config key trian"),
        (["--train.max_steps", "many"], "train.max_steps: expected int"),
        (["--train.max_steps"], "has no value"),
        (["max_steps", "3"], "expected an override like"),
    ],
)
def test_bad_keys_and_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(None, overrides)
