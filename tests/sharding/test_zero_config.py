"""ZeroConfig: field validation, `zero_config_from`, and the DeepSpeed JSON parser."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest

from tnlg.sharding import ZeroConfig, parse_deepspeed
from tnlg.sharding.deepspeed import zero_config_from, zero_config_from_deepspeed


def hf_zero3() -> dict:
    """A ZeRO-3 config as users write it for the HF Trainer (fp16 and bf16 both "auto")."""
    return {
        "fp16": {
            "enabled": "auto",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "none"},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": 2.5e7,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def zero(**section) -> dict:
    return {"zero_optimization": section}


def zero2() -> dict:
    """A plain ZeRO-2 config with explicit fp16 settings and sizes written as floats."""
    return {
        "train_batch_size": 256,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 4},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 5e8,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
    }


def test_defaults_and_stage_properties():
    config = ZeroConfig()
    assert (config.stage, config.mixed_precision, config.static_loss_scale) == (0, "no", None)
    assert (config.offload_optimizer, config.offload_param) == ("none", "none")
    flags = [
        (c.partitions_optimizer, c.partitions_gradients, c.partitions_parameters)
        for c in (ZeroConfig(stage=s) for s in range(4))
    ]
    assert flags == [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]


def test_frozen_keyword_only_and_replace():
    config = ZeroConfig(stage=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stage = 3
    with pytest.raises(TypeError):
        ZeroConfig(2)
    changed = config.replace(stage=3, offload_param="cpu")
    assert (changed.stage, changed.offload_param, config.stage) == (3, "cpu", 2)
    with pytest.raises(ValueError, match=r"ZeroConfig\.stage"):
        config.replace(stage=7)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("stage", 4, "one of [0, 1, 2, 3]"),
        ("stage", 2.0, "one of [0, 1, 2, 3]"),
        ("stage", True, "one of [0, 1, 2, 3]"),
        ("mixed_precision", "fp32", "one of ['no', 'bf16', 'fp16']"),
        ("offload_optimizer", "nvme", "one of ['none', 'cpu']"),
        ("offload_param", None, "one of ['none', 'cpu']"),
        ("reduce_bucket_size", 0, "integer >= 1"),
        ("reduce_bucket_size", 5e8, "integer >= 1"),
        ("prefetch_bucket_size", -1, "integer >= 0"),
        ("max_live_parameters", 0, "integer >= 1"),
        ("param_persistence_threshold", -1, "integer >= 0"),
        ("loss_scale_window", 0, "integer >= 1"),
        ("hysteresis", True, "integer >= 1"),
        ("overlap_comm", 1, "True or False"),
        ("reshard_after_forward", "yes", "True or False"),
        ("gradient_clipping", -1.0, "number >= 0.0"),
        ("gradient_clipping", float("inf"), "finite number >= 0.0"),
        ("initial_loss_scale", 0.0, "number > 0.0"),
        ("min_loss_scale", float("nan"), "number > 0.0"),
        ("static_loss_scale", 0, "number > 0.0"),
    ],
)
def test_invalid_field_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(
        ValueError, match=re.escape(f"ZeroConfig.{field} must be") + ".*" + re.escape(allowed)
    ):
        ZeroConfig(**{field: value})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"min_loss_scale": 8.0, "initial_loss_scale": 4.0}, "min_loss_scale"),
        ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer needs stage 1, 2 or 3"),
        ({"stage": 2, "offload_param": "cpu"}, "offload_param needs stage 3"),
    ],
)
def test_inconsistent_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**changes)


def test_cpu_offload_is_a_valid_config():
    assert ZeroConfig(stage=1, offload_optimizer="cpu").offload_optimizer == "cpu"
    assert ZeroConfig(stage=3, offload_optimizer="cpu", offload_param="cpu").offload_param == "cpu"


def test_hf_zero3_maps_every_field_and_lists_ignored_keys():
    config, ignored = parse_deepspeed(hf_zero3(), mixed_precision="bf16", gradient_clipping=1.0)
    expected = ZeroConfig(
        stage=3,
        mixed_precision="bf16",
        gradient_clipping=1.0,
        prefetch_bucket_size=25_000_000,
        param_persistence_threshold=10_000,
        max_live_parameters=1_000_000_000,
        offload_optimizer="cpu",
        loss_scale_counting="deepspeed",  # every DeepSpeed JSON's
    )
    assert config == expected
    assert type(config.max_live_parameters) is int  # 1e9 in JSON
    # optimizer, scheduler and the batch keys are applied now (sharding/deepspeed/reader.py), not ignored.
    assert ignored == [
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "wall_clock_breakdown",
    ]


def test_zero2_json_file_and_ignored_keys_warning(tmp_path, caplog):
    path = tmp_path / "ds_zero2.json"
    path.write_text(json.dumps(zero2(), indent=2))
    with caplog.at_level(logging.INFO, logger="tnlg.sharding.deepspeed"):
        config = zero_config_from_deepspeed(path)
    assert config == ZeroConfig(
        stage=2,
        mixed_precision="fp16",
        gradient_clipping=1.0,
        initial_loss_scale=4096.0,
        hysteresis=4,
        reduce_bucket_size=200_000_000,
        overlap_comm=False,
        loss_scale_counting="deepspeed",
    )
    [record] = caplog.records
    assert record.levelno == logging.INFO  # known keys that cannot change results; unknown ones are errors
    assert "ignoring keys that cannot change training results: zero_optimization.allgather_partitions" in (
        record.getMessage()
    )


def test_built_in_keys_and_null_offload_are_not_warned_about(caplog):
    with caplog.at_level(logging.WARNING):
        config = zero_config_from_deepspeed(zero(stage=3, contiguous_gradients=True, offload_param=None))
    assert config == ZeroConfig(stage=3, loss_scale_counting="deepspeed")
    assert caplog.records == []


def test_auto_values_without_keywords_take_defaults():
    config, _ = parse_deepspeed(hf_zero3())
    assert (config.mixed_precision, config.gradient_clipping) == ("no", 0.0)
    assert config.reduce_bucket_size == ZeroConfig().reduce_bucket_size


def test_auto_fp16_takes_loss_scaling_from_the_section_and_keywords():
    fp16 = {"enabled": "auto", "initial_scale_power": "auto", "loss_scale_window": 500, "min_loss_scale": 2}
    config, _ = parse_deepspeed({"fp16": fp16}, mixed_precision="fp16", initial_scale_power=10)
    assert config == ZeroConfig(
        mixed_precision="fp16",
        initial_loss_scale=1024.0,
        loss_scale_window=500,
        min_loss_scale=2,
        loss_scale_counting="deepspeed",
    )


def test_positive_loss_scale_is_static():
    config, _ = parse_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}})
    assert (config.mixed_precision, config.static_loss_scale) == ("fp16", 128)


@pytest.mark.parametrize(
    ("ds", "auto"),
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": "auto"}}, {"mixed_precision": "fp16"}),
    ],
)
def test_bf16_and_fp16_both_enabled_is_an_error(ds, auto):
    with pytest.raises(ValueError, match=r"bf16\.enabled and fp16\.enabled are both true"):
        parse_deepspeed(ds, **auto)


@pytest.mark.parametrize(
    ("ds", "key"),
    [
        (zero(stage=4), r"zero_optimization\.stage: ZeroConfig\.stage must be one of \[0, 1, 2, 3\]"),
        (zero(stage3_prefetch_bucket_size="big"), r"zero_optimization\.stage3_prefetch_bucket_size"),
        (zero(overlap_comm="true"), r"zero_optimization\.overlap_comm"),
        (zero(offload_param={"device": "nvme"}), r"zero_optimization\.offload_param\.device.*NVMe"),
        (zero(offload_optimizer={"device": "gpu"}), r"zero_optimization\.offload_optimizer\.device"),
        (zero(stage=2, offload_param={"device": "cpu"}), "offload_param needs stage 3"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, r"fp16\.hysteresis"),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, r"fp16\.loss_scale"),
        ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, r"fp16\.initial_scale_power"),
        ({"fp16": {"enabled": True, "initial_scale_power": "x"}}, r"fp16\.initial_scale_power"),
        ({"bf16": {"enabled": "yes"}}, r"bf16\.enabled must be true, false or \"auto\""),
        ({"gradient_clipping": -1}, r"gradient_clipping: ZeroConfig\.gradient_clipping must be"),
        ({"zero_optimization": 3}, r"zero_optimization must be an object"),
        ({"bf16": True}, r"bf16 must be an object"),
        (zero(offload_optimizer="cpu"), r"zero_optimization\.offload_optimizer must be an object"),
    ],
)
def test_invalid_deepspeed_value_names_the_key(ds, key):
    with pytest.raises(ValueError, match="invalid DeepSpeed config: .*" + key):
        parse_deepspeed(ds)


def test_auto_keywords_are_checked():
    with pytest.raises(TypeError, match="mixed_precison"):
        parse_deepspeed(hf_zero3(), mixed_precison="bf16")
    with pytest.raises(ValueError, match=r"ZeroConfig\.mixed_precision"):
        parse_deepspeed(hf_zero3(), mixed_precision="fp8")


@pytest.mark.parametrize(
    ("text", "message"),
    [('{"zero_optimization": {"stage": 2,}}', "is not valid JSON"), ("[1, 2]", "must be a JSON object")],
)
def test_bad_json_file_names_the_file(tmp_path, text, message):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
        zero_config_from_deepspeed(str(path))


def test_zero_config_from(tmp_path):
    assert zero_config_from(None) == ZeroConfig()
    config = ZeroConfig(stage=1)
    assert zero_config_from(config) is config
    fields = {"stage": 2, "mixed_precision": "bf16"}
    assert zero_config_from(fields) == ZeroConfig(**fields)
    assert zero_config_from({"gradient_clipping": "auto"}) == ZeroConfig()
    assert zero_config_from(zero2()).reduce_bucket_size == 200_000_000
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(hf_zero3()))
    assert zero_config_from(path).stage == zero_config_from(str(path)).stage == 3
    with pytest.raises(ValueError, match="not ZeroConfig fields: stag3"):
        zero_config_from({"stage": 2, "stag3": 3})
    with pytest.raises(TypeError, match="got int"):
        zero_config_from(3)
