"""Typed run configs: YAML sections, dotted overrides, unknown keys and wrong types named."""

from __future__ import annotations

import pytest

from tests.support import REPO
from tnlg.modeling import TNLGConfig
from tnlg.run.config import load_run_config
from tnlg.run.pretrain import stream_config
from tnlg.sharding import ParallelDims
from tnlg.sharding.deepspeed import zero_config_from_deepspeed


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: debug\n  overrides: {hidden_size: 128}\ntrain:\n  max_steps: 50\n")
    config = load_run_config(path, ["--train.max_steps", "20", "--zero.stage", "3", "--optimizer.lr=1e-3"])
    assert config.model.overrides == {"hidden_size": 128}
    assert (config.train.max_steps, config.zero.stage, config.optimizer.lr) == (20, 3, 1e-3)
    assert config.train.micro_batch_size == 8  # untouched default


def test_sources_become_typed_sections(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  sources:\n    - {name: web, paths: [a.jsonl], weight: 2}\n"
        "    - {name: pile, dataset: monology/pile-uncopyrighted, split: validation}\n"
    )
    config = load_run_config(path)
    web, _ = config.data.sources
    assert (web.name, web.paths, web.weight) == ("web", ["a.jsonl"], 2.0)
    streamed = stream_config(config.data, seed=0, split="train").sources_by_name["pile"]
    assert (streamed.dataset, streamed.split, streamed.paths) == (
        "monology/pile-uncopyrighted",
        "validation",
        (),
    )


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


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "configs" / "pretrain").glob("*.yaml")),
    ids=lambda p: p.stem,
)
def test_every_committed_run_config_loads(path):
    config = load_run_config(path)
    model = TNLGConfig.from_preset(config.model.preset, **config.model.overrides)
    assert config.data.seq_len <= model.max_position_embeddings
    config.zero.to_zero_config(config.train.mixed_precision)  # valid engine settings


def test_activation_checkpointing_is_a_typed_model_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  activation_checkpointing: {enabled: true}\n")
    section = load_run_config(path).model.activation_checkpointing
    assert (section.enabled, section.cpu_offload) == (True, False)
    assert not load_run_config(None).model.activation_checkpointing.enabled  # off unless asked for
    overridden = load_run_config(path, ["--model.activation_checkpointing.cpu_offload", "true"])
    assert overridden.model.activation_checkpointing.cpu_offload is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--model.activation_checkpointing.enabled", "often"],
            "activation_checkpointing.enabled: expected bool",
        ),
        (
            ["--model.activation_checkpointing.enabled", "1"],
            "activation_checkpointing.enabled: expected bool",
        ),
        (["--model.activation_checkpointing.offload", "true"], "did you mean .*cpu_offload"),
        (["--model.activation_checkpointing.cpu_offload", "true"], "cpu_offload needs .*enabled: true"),
        (["--model.activation_checkpointing", "true"], "model.activation_checkpointing: expected a mapping"),
    ],
)
def test_bad_activation_checkpointing_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(None, overrides)


@pytest.mark.parametrize("name", ["tnlg-17b", "mt-nlg-530b"])
def test_the_big_configs_are_sized_with_checkpointing_and_turn_it_on(name):
    config = load_run_config(REPO / "configs" / "pretrain" / f"{name}.yaml")
    assert config.model.activation_checkpointing.enabled


def test_the_example_deepspeed_config_parses():
    config = zero_config_from_deepspeed(
        REPO / "configs" / "deepspeed" / "zero3-bf16.json",
        mixed_precision="bf16",
    )
    assert (config.stage, config.mixed_precision, config.reduce_bucket_size) == (3, "bf16", 500_000_000)


def test_pretokenized_corpora_feed_training(tmp_path):
    from tnlg.data.pretokenized import PretokenizedStream, write_pretokenized
    from tnlg.data.tokenizer import byte_level_tokenizer
    from tnlg.run.pretrain import training_stream

    write_pretokenized(["some text to train on"] * 50, byte_level_tokenizer(), tmp_path / "corpus")
    config = load_run_config(
        None,
        [
            "--data.pretokenized",
            f"[{{prefix: {tmp_path / 'corpus'}, weight: 1}}]",
            "--data.seq_len",
            "16",
            "--train.micro_batch_size",
            "2",
        ],
    )
    stream = training_stream(config, byte_level_tokenizer(), rank=0, world=1)
    assert isinstance(stream, PretokenizedStream)
    assert next(iter(stream))["input_ids"].shape == (2, 16)


def test_parallel_section_gives_the_engine_its_layout():
    assert load_run_config(None).parallel.dims() is None  # data parallelism alone
    config = load_run_config(None, ["--parallel.tensor", "2", "--parallel.pipeline", "1"])
    assert config.parallel.dims() == ParallelDims(tensor=2, pipeline=1)
    assert config.to_dict()["parallel"] == {"tensor": 2, "pipeline": 1, "virtual_stages": 1}
    interleaved = load_run_config(None, ["--parallel.pipeline", "2", "--parallel.virtual_stages", "2"])
    assert interleaved.parallel.dims() == ParallelDims(pipeline=2, virtual_stages=2)


def test_virtual_stages_need_pipeline_ranks():
    with pytest.raises(ValueError, match=r"parallel\.virtual_stages=2 .*parallel\.pipeline >= 2"):
        load_run_config(None, ["--parallel.virtual_stages", "2"])
    with pytest.raises(ValueError, match=r"parallel\.virtual_stages must be an integer >= 1, got 0"):
        load_run_config(None, ["--parallel.pipeline", "2", "--parallel.virtual_stages", "0"])


INTERLEAVED = ["--parallel.pipeline", "2", "--parallel.virtual_stages", "2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--train.gradient_accumulation_steps", "5"],
            r"parallel\.virtual_stages 2 with train\.gradient_accumulation_steps 5: 5 micro-batches for 4 pipeline "
            r"stages .* multiple of its rounds, max\(1, count // 2\) = 2 here; e\.g\. 4 or 6 micro-batches",
        ),
        (
            ["--train.eval_batches", "7"],
            r"parallel\.virtual_stages 2 with train\.eval_batches 7: 7 micro-batches .* = 3 here; e\.g\. 6 or 8",
        ),
    ],
)
def test_interleaved_counts_torch_refuses_are_named_when_read(overrides, message):
    # Else torch refuses the step's count at step 1, the evaluation's at the first evaluation (after
    # steps that may not have been saved), either naming no setting.
    with pytest.raises(ValueError, match=message):
        load_run_config(None, [*INTERLEAVED, *overrides])


def test_interleaved_counts_the_schedule_takes_are_accepted(tmp_path):
    for steps in ("1", "3", "4", "6"):  # 1 and 3 are cut to 2 and 3 micro-batches: one round
        config = load_run_config(None, [*INTERLEAVED, "--train.gradient_accumulation_steps", steps])
        assert config.train.gradient_accumulation_steps == int(steps)
    # No evaluation, no evaluation's count to check: eval_every 0, or a corpus without validation text.
    load_run_config(None, [*INTERLEAVED, "--train.eval_batches", "7", "--train.eval_every", "0"])
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  sources:\n    - {name: web, paths: [a.jsonl]}\n")
    config = load_run_config(path, [*INTERLEAVED, "--train.eval_batches", "7"])
    assert stream_config(config.data, 0, "validation") is None  # what pretraining then evaluates: nothing


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--train.micro_batch_size", "3"],
            r"train\.gradient_accumulation_steps 1 with parallel\.pipeline 2: each batch is cut into 2 equal parts .*"
            r"train\.micro_batch_size 3 is not a multiple of 2",
        ),
        (
            [
                "--train.micro_batch_size",
                "3",
                "--train.gradient_accumulation_steps",
                "2",
                "--train.eval_batches",
                "1",
            ],
            r"train\.eval_batches 1 with parallel\.pipeline 2: .* make it one, or train\.eval_batches at least 2",
        ),
    ],
)
def test_batches_the_pipeline_cut_cannot_divide_are_named_when_read(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(None, ["--parallel.pipeline", "2", *overrides])


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "must be an integer >= 1, got 0"), ("1.5", "expected int, got 1.5"), ("true", "expected int")],
)
def test_bad_parallel_degrees_are_named(value, message):
    with pytest.raises(ValueError, match=rf"parallel\.tensor.*{message}"):
        load_run_config(None, ["--parallel.tensor", value])
