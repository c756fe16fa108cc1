"""The fine-tuning configs: every shipped YAML loads, overrides apply, and mistakes are named."""

from __future__ import annotations

import pytest

from tests.support import REPO
from tnlg.run.finetune_config import FinetuneConfig, load_finetune_config

CONFIGS = sorted((REPO / "configs" / "finetune").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds_its_task(path):
    config = load_finetune_config(path)
    assert isinstance(config, FinetuneConfig)
    task = config.task.format()
    assert task.max_length == config.task.max_length
    assert config.evaluation.generation.max_new_tokens < task.max_length
    assert config.to_dict()["data"]["dataset"] == config.data.dataset


def test_overrides_reach_nested_sections():
    config = load_finetune_config(
        CONFIGS[0], ["--lora.enabled", "true", "--evaluation.generation.num_beams", "4", "--zero.stage", "3"]
    )
    assert config.lora.enabled and config.evaluation.generation.num_beams == 4 and config.zero.stage == 3
    partial = load_finetune_config(None, ["--data.packing", "true"]).data  # no source: the embedded set
    assert (partial.dataset, partial.validation_split, partial.packing) == (
        "embedded:docstrings",
        "validation",
        True,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--task.kynd", "qa"], "unknown config key task.kynd"),
        (["--task.kind", "translation"], "task kind must be one of"),
        (["--task.columns", "{title: headline}"], r"columns maps unknown fields \['title'\]"),
        (["--data.on_long_example", "truncate"], "on_long_example must be 'stop' or 'skip'"),
        (["--data.paths", "[a.jsonl]", "--data.validation_split", "test"], "give the held-out files as"),
        (
            ["--task.max_length", "64", "--evaluation.generation.max_new_tokens", "63"],
            r"evaluation.generation.max_new_tokens 63 leaves 1 token of task.max_length 64",
        ),
    ],
)
def test_mistakes_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_finetune_config(None, overrides)


def test_fine_tuning_refuses_pipeline_stages_and_takes_tensor_slicing():
    with pytest.raises(
        ValueError, match=r"parallel.pipeline 2: fine-tuning runs with data parallelism and tensor"
    ):
        load_finetune_config(None, ["--parallel.pipeline", "2"])
    assert load_finetune_config(None, ["--parallel.tensor", "2"]).parallel.tensor == 2


def test_a_dataset_config_is_taken_for_a_datasets_dataset():
    # refused only where nothing reads it (files by format, an embedded set): a hub dataset's is applied
    config = load_finetune_config(
        None, ["--data.dataset", "abisee/cnn_dailymail", "--data.dataset_config", "3.0.0"]
    )
    assert (config.data.dataset, config.data.dataset_config) == ("abisee/cnn_dailymail", "3.0.0")


def test_a_dataset_config_for_a_saved_dataset_is_refused(tmp_path):
    # load_from_disk reads a save_to_disk directory whole: the configuration was accepted and dropped
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(
        ValueError, match=r"a dataset saved with save_to_disk .* has none: remove data.dataset_config"
    ):
        load_finetune_config(
            None, ["--data.dataset", str(tmp_path / "saved"), "--data.dataset_config", "3.0.0"]
        )


def test_both_validation_sources_are_named_before_the_files_rules(tmp_path):
    # with data.paths, the files' own rule said "give the held-out files as data.validation_paths", as given
    overrides = [
        "--data.paths",
        "[a.jsonl]",
        "--data.validation_paths",
        "[b.jsonl]",
        "--data.validation_split",
        "v",
    ]
    with pytest.raises(
        ValueError, match=r"data.validation_split 'v' and data.validation_paths are both given"
    ):
        load_finetune_config(None, overrides)
