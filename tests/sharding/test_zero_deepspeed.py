"""DeepSpeed JSON configs are applied, never silently dropped: unknown keys, the optimizer and scheduler
sections, gradient accumulation and batch sizes, in the engine and through ZeroAccelerator."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

from tests.support import REPO
from tests.support.zero_deepspeed_cases import (
    ACCUMULATION,
    GLOBAL_BATCH,
    STEPS,
    accelerate_json_accumulation,
    accelerator_refusals,
    adamw,
    engine_with_schedule,
    every_stage,
    micro_steps,
    save_and_resume,
    train_reference,
    zero,
)
from tests.support.zero_models import make_model
from tnlg.sharding import (
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    ZeroConfig,
    initialize,
    load_deepspeed,
    parse_deepspeed,
)
from tnlg.sharding.deepspeed import engine_settings, zero_config_from, zero_config_from_deepspeed
from tnlg.tools.spawn import run_distributed

CONFIGS = REPO / "configs" / "deepspeed"


# ------------------------------------------------------------------------------------------- the keys
@pytest.mark.parametrize(
    ("ds", "named"),
    [
        ({"gradient_clippin": 1.0}, "gradient_clippin (did you mean 'gradient_clipping'?)"),
        ({"zero_optimizaton": {"stage": 3}}, "zero_optimizaton (did you mean 'zero_optimization'?)"),
        (zero(stgae=3), "zero_optimization.stgae (did you mean 'stage'?)"),
        ({"bf16": {"enabeld": True}}, "bf16.enabeld (did you mean 'enabled'?)"),
        (
            {"fp16": {"enabled": True, "loss_scale_windw": 9}},
            "fp16.loss_scale_windw (did you mean 'loss_scale_window'?)",
        ),
        (
            zero(stage=3, offload_optimizer={"device": "cpu", "pin_memroy": True}),
            "zero_optimization.offload_optimizer.pin_memroy (did you mean 'pin_memory'?)",
        ),
        (adamw(weight_decya=0.1), "optimizer.params.weight_decya (did you mean 'weight_decay'?)"),
        ({"optimizer": {"type": "AdamW", "parms": {}}}, "optimizer.parms (did you mean 'params'?)"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 9}}},
            "scheduler.params.warmup_num_step (did you mean 'warmup_num_steps'?)",
        ),
        ({"zero_optimization": {"stage": 1, "frobnicate": 1}}, "zero_optimization.frobnicate;"),
        # Each offload section has its own keys, as in DeepSpeed (whose configs refuse the other's).
        (
            zero(stage=3, offload_param={"device": "cpu", "ratio": 0.5}),
            "zero_optimization.offload_param.ratio;",
        ),
        (
            zero(stage=3, offload_optimizer={"device": "cpu", "max_in_cpu": 10}),
            "zero_optimization.offload_optimizer.max_in_cpu;",
        ),
    ],
)
def test_unknown_keys_at_every_level_are_errors_naming_the_path_and_the_likely_key(ds, named):
    with pytest.raises(ValueError, match="invalid DeepSpeed config: unknown keys .*" + re.escape(named)):
        zero_config_from_deepspeed(ds)


def test_a_stage_typo_no_longer_trains_at_stage_0():
    model = make_model()
    with pytest.raises(ValueError, match=r"zero_optimization\.stgae \(did you mean 'stage'\?\)"):
        initialize(model, torch.optim.AdamW(model.parameters()), zero(stgae=3))


def test_every_unknown_key_is_named_in_one_error_and_a_file_error_names_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"stpes_per_print": 1, **zero(stage=2, reduce_bucket_sise=5)}))
    with pytest.raises(ValueError) as error:
        zero_config_from(path)
    message = str(error.value)
    assert message.startswith(f"{path}: invalid DeepSpeed config: unknown keys ")
    assert "stpes_per_print (did you mean 'steps_per_print'?)" in message
    assert "zero_optimization.reduce_bucket_sise (did you mean 'reduce_bucket_size'?)" in message


def test_keys_safe_to_ignore_are_logged_once_at_info_with_the_reason(caplog):
    ds = {
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        **zero(
            stage=3,
            sub_group_size=1e9,
            contiguous_gradients=True,
            offload_param={"device": "cpu", "pin_memory": True},
        ),
    }
    with caplog.at_level(logging.INFO, logger="tnlg.sharding"):
        config, ignored = parse_deepspeed(ds)
    assert (config.stage, config.offload_param) == (3, "cpu")
    assert ignored == [
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_optimization.sub_group_size",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.offload_param.pin_memory",
    ]
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert "steps_per_print (progress-log cadence)" in record.getMessage()
    assert (
        "zero_optimization.sub_group_size (the optimizer steps each rank's shard whole" in record.getMessage()
    )


@pytest.mark.parametrize(
    ("ds", "named"),
    [
        ({"prescale_gradients": True}, "prescale_gradients = true is not supported .*set it to False"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor = 2.0 .*set it to 1.0"),
        (
            {"bf16": {"enabled": True}, "communication_data_type": "fp32"},
            "communication_data_type = \"fp32\" .*compute dtype, here bf16.*set it to 'bf16'",
        ),
        (zero(stage=2, zero_quantized_gradients=True), "zero_optimization.zero_quantized_gradients = true"),
        (zero(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.5}), "offload_optimizer.ratio = 0.5"),
        (zero(stage=2, load_from_fp32_weights=False), "load_from_fp32_weights = false"),
        (zero(stage=2, cpu_offload=True), "cpu_offload = true .*use offload_optimizer.device = cpu"),
        ({"amp": {"enabled": True}}, 'amp = {"enabled": true} .*set it to {"enabled": false}'),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity = "),
        ({"compile": {"deepcompile": True}}, 'compile = {"deepcompile": true} .*model.compile.enabled'),
        (
            {"checkpoint": {"use_node_local_storage": True, "tag_validation": "Warn"}},
            'checkpoint = {"use_node_local_storage": true, .*node-local storage is not implemented',
        ),
        ({"checkpoint": {"load_universal": True}}, 'not the universal format.*"load_universal": false'),
        ({"autotuning": {"enabled": True}}, "writes the autotuning metric and exits"),
        ({"bf16": {"enabled": True, "check_grad_overflow": False}}, "bf16.check_grad_overflow = false"),
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
            'data_types.grad_accum_dtype = "fp32" .*compute dtype.s buffers, here bf16.*set it to .bf16.',
        ),
        ({"data_types": {"buffer_dtype": "bf16"}}, 'data_types.buffer_dtype = "bf16" .*set it to null'),
        (adamw(max_grad_norm=1.0), "optimizer.params.max_grad_norm = 1.0 .*gradient_clipping\\); remove it"),
        (adamw(bias_correction=False), "optimizer.params.bias_correction = false"),
        (adamw(amsgrad=True), "optimizer.params.amsgrad needs torch_adam"),
        (adamw(betas=[0.9]), "optimizer.params.betas must be two numbers"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
            "scheduler.params.last_batch_iteration = 5",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {}}},
            "WarmupDecayLR needs params.total_num_steps",
        ),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, "warmup_type must be"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an integer >= 1"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bf16 and bfloat16"),
    ],
)
def test_what_tnlg_does_not_do_is_refused_naming_the_key_and_the_value_to_use(ds, named):
    with pytest.raises(ValueError, match="invalid DeepSpeed config: .*" + named):
        load_deepspeed(ds)


@pytest.mark.parametrize(
    "ds",
    [
        {"prescale_gradients": False, "gradient_predivide_factor": 1},
        {"bf16": {"enabled": True, "check_grad_overflow": True}, "communication_data_type": "bf16"},
        {"amp": {"enabled": False, "opt_level": "O1"}, "elasticity": None},
        {"compile": {"deepcompile": False, "offload_activation": False}},
        {"checkpoint": {"use_node_local_storage": False, "tag_validation": "Fail", "load_universal": False}},
        {"autotuning": {"enabled": False, "fast": True}},
        zero(stage=2, load_from_fp32_weights=True, offload_optimizer={"device": "cpu", "ratio": 1}),
    ],
)
def test_those_keys_at_the_value_tnlg_behaves_like_are_accepted(ds):
    load_deepspeed(ds)


@pytest.mark.parametrize(
    ("ds", "message"),
    [
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type 'Lamb' is not supported; tnlg builds Adam, AdamW"),
        (
            {"scheduler": {"type": "OneCycle", "params": {}}},
            "scheduler.type 'OneCycle' is not supported; tnlg builds WarmupLR, WarmupDecayLR, WarmupCosineLR",
        ),
    ],
)
def test_unsupported_optimizer_and_scheduler_types_list_the_supported_ones(ds, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_deepspeed(ds)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"stage": 2, "zero_optimization": {}},
            r"mixes ZeroConfig fields \(stage\) and DeepSpeed keys \(zero_optimization\)",
        ),
        ({"stage": 2, "stag3": 3}, r"not ZeroConfig fields: stag3 \(did you mean 'stage'\?\)"),
        (
            {"gradient_clipping": 1.0, "stgae": 2},
            r"not ZeroConfig fields or DeepSpeed keys: stgae \(did you mean 'stage'\?\)",
        ),
        ({"overlap_com": True}, r"overlap_com \(did you mean 'overlap_comm'\?\)"),
    ],
)
def test_zero_config_from_refuses_a_dict_that_mixes_or_misspells_keys(config, message):
    with pytest.raises(ValueError, match=message):
        zero_config_from(config)


def test_a_json_file_of_zero_config_fields_is_read_as_fields(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text('{"stage": 2, "overlap_comm": false}')
    assert zero_config_from(path) == ZeroConfig(stage=2, overlap_comm=False)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_every_committed_deepspeed_config_loads(path):
    loaded = load_deepspeed(path, mixed_precision="bf16")
    assert loaded.zero.stage in (1, 2, 3)
    loaded.batch_sizes(world_size=8)


# ------------------------------------------------------------------------------------------ overrides
def test_zero_config_from_deepspeed_overrides_fill_unset_fields_and_refuse_disagreeing_ones(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                **zero(stage=3, reduce_bucket_size="auto", overlap_comm=True),
                "fp16": {"enabled": True, "initial_scale_power": 12},
            }
        )
    )
    names = {"stage": "--zero.stage", "initial_loss_scale": "--zero.initial_loss_scale"}
    config = zero_config_from_deepspeed(
        path,
        overrides={"stage": 3, "reduce_bucket_size": 1000, "gradient_clipping": 1.0},
        override_names=names,
    )
    assert (config.stage, config.reduce_bucket_size, config.gradient_clipping) == (3, 1000, 1.0)
    with pytest.raises(
        ValueError, match=re.escape(f"--zero.stage 1 conflicts with zero_optimization.stage 3 in {path}")
    ):
        zero_config_from_deepspeed(path, overrides={"stage": 1}, override_names=names)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "--zero.initial_loss_scale 65536.0 conflicts with fp16.initial_scale_power 12 (= initial_loss_scale 4096.0)"
        ),
    ):
        zero_config_from_deepspeed(path, overrides={"initial_loss_scale": 65536.0}, override_names=names)
    with pytest.raises(ValueError, match=r"--zero.stage: ZeroConfig\.stage must be one of"):
        zero_config_from_deepspeed(path, overrides={"stage": 7}, override_names=names)
    with pytest.raises(TypeError, match=r"stgae \(did you mean 'stage'\?\)"):
        zero_config_from_deepspeed(path, overrides={"stgae": 3})
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        zero_config_from_deepspeed(zero(stage=2), overrides={"offload_param": "cpu"})


# ------------------------------------------------------------------------------------------ batch keys
@pytest.mark.parametrize(
    ("keys", "world", "expected"),
    [
        ({}, 2, (1, None, None)),
        ({"gradient_accumulation_steps": 4}, 2, (4, None, None)),
        ({"train_batch_size": 32}, 2, (1, 16, 32)),
        ({"train_micro_batch_size_per_gpu": 4}, 2, (1, 4, 8)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (4, 4, 32)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (4, 4, 32)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2, (4, 4, 32)),
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
            2,
            (4, 4, 32),
        ),
    ],
)
def test_batch_keys_are_derived_as_deepspeed_derives_them(keys, world, expected):
    sizes = load_deepspeed(keys).batch_sizes(world)
    assert (
        sizes.gradient_accumulation_steps,
        sizes.train_micro_batch_size_per_gpu,
        sizes.train_batch_size,
    ) == expected


@pytest.mark.parametrize(
    ("keys", "numbers"),
    [
        (
            {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
            "10 != train_micro_batch_size_per_gpu 3 x gradient_accumulation_steps 2 x world size 1 (= 6)",
        ),
        (
            {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4},
            "2 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 0",
        ),
    ],
)
def test_inconsistent_batch_keys_name_the_three_numbers(keys, numbers):
    model = make_model()
    with pytest.raises(ValueError, match="train_batch_size " + re.escape(numbers)):
        initialize(model, torch.optim.AdamW(model.parameters()), keys)


# ------------------------------------------------------------------------------------------ optimizer
@pytest.mark.parametrize(
    ("section", "kind", "expected"),
    [
        (
            {"type": "Adam"},
            torch.optim.AdamW,
            {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        ),
        (
            {"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}},
            torch.optim.Adam,
            {"weight_decay": 0.1},
        ),
        ({"type": "AdamW", "params": {"adam_w_mode": False}}, torch.optim.AdamW, {"weight_decay": 0.0}),
        ({"type": "ADAMW", "params": {"torch_adam": True}}, torch.optim.AdamW, {"weight_decay": 0.01}),
        (
            {"type": "Adam", "params": {"torch_adam": True, "amsgrad": True, "lr": 0.5}},
            torch.optim.AdamW,
            {"amsgrad": True, "lr": 0.5},
        ),
    ],
)
def test_the_optimizer_section_builds_what_deepspeed_builds(section, kind, expected):
    model = make_model()
    engine = initialize(model, None, {"optimizer": section, **zero(stage=1)})
    assert not engine.inference_only
    optimizer = engine.optimizer.optimizer
    assert type(optimizer) is kind
    [group] = optimizer.param_groups
    assert {key: group[key] for key in expected} == expected
    assert not any(p.requires_grad for p in model.frozen.parameters())  # left out of the optimizer


def test_an_optimizer_passed_with_an_optimizer_section_is_an_error():
    model = make_model()
    with pytest.raises(
        ValueError, match=r"has an optimizer section \(AdamW\) and an optimizer was passed too \(SGD\)"
    ):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), adamw())


def test_auto_optimizer_values_parse_but_are_refused_when_tnlg_builds_them():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}, **zero(stage=2)}
    assert zero_config_from_deepspeed(ds).stage == 2
    with pytest.raises(ValueError, match=re.escape('optimizer.params.lr, weight_decay is "auto"')):
        initialize(make_model(), None, ds)


def test_a_scheduler_section_needs_an_optimizer():
    ds = {"scheduler": {"type": "WarmupLR", "params": {}}}
    with pytest.raises(ValueError, match=r"scheduler section \(WarmupLR\) but no optimizer"):
        initialize(make_model(), None, ds)


# ------------------------------------------------------------------------------------------ schedules
def _lrs(scheduler, steps: int) -> list[float]:
    """The lr at construction, then after each of `steps` steps."""
    lrs = [scheduler.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
    return lrs


def _optimizer(lr: float = 0.5, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr)


def test_warmup_lr_follows_deepspeeds_formula():
    # DeepSpeed: iteration -1 at construction (min lr), then i = 0, 1, ...: min + (max - min) * i / W.
    linear = WarmupLR(
        _optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4, warmup_type="linear"
    )
    assert _lrs(linear, 6) == pytest.approx([0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1])
    log = WarmupLR(
        _optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4
    )  # log(i + 1) / log(W)
    assert _lrs(log, 5) == pytest.approx([0.1, 0.1, 0.6, 0.1 + math.log(3) / math.log(4), 1.1, 1.1])
    # warmup_num_steps is at least 2; warmup_max_lr defaults to the optimizer's lr
    assert _lrs(WarmupLR(_optimizer(lr=0.5), warmup_num_steps=1), 3) == pytest.approx([0.0, 0.0, 0.5, 0.5])


def test_warmup_decay_lr_follows_deepspeeds_formula():
    schedule = WarmupDecayLR(_optimizer(), 10, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    lrs = _lrs(schedule, 13)  # lrs[k + 1] is iteration k
    assert lrs[1:5] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert lrs[5:] == pytest.approx([1.0, 5 / 6, 4 / 6, 0.5, 2 / 6, 1 / 6, 0.0, 0.0, 0.0])
    assert WarmupDecayLR(_optimizer(lr=0.5), 10).max_lrs == [
        0.001
    ]  # DeepSpeed's default, not the optimizer's


def test_warmup_cosine_lr_follows_deepspeeds_formula():
    schedule = WarmupCosineLR(
        _optimizer(lr=2.0),
        10,
        warmup_min_ratio=0.1,
        warmup_num_steps=4,
        cos_min_ratio=0.0,
        warmup_type="linear",
    )
    lrs = _lrs(schedule, 13)
    assert lrs[0] == 0.0  # DeepSpeed's ratio before the first step
    assert lrs[1:5] == pytest.approx([2 * (0.1 + 0.9 * i / 4) for i in range(4)])
    cosine = [2 * (1 + math.cos(math.pi * min(1.0, (i - 3) / 6))) / 2 for i in range(4, 13)]
    assert lrs[5:] == pytest.approx(cosine)
    assert lrs[-3:] == pytest.approx([0.0, 0.0, 0.0])  # held at the floor past total_num_steps


def test_a_schedule_resumes_from_its_json_state_dict():
    first = WarmupDecayLR(
        _optimizer(groups=2), 10, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 2.0], warmup_num_steps=3
    )
    _lrs(first, 4)
    state = json.loads(json.dumps(first.state_dict()))
    second = WarmupDecayLR(
        _optimizer(groups=2), 10, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 2.0], warmup_num_steps=3
    )
    second.load_state_dict(state)
    assert second.last_batch_iteration == first.last_batch_iteration == 3
    first.step()
    second.step()
    assert second.get_last_lr() == first.get_last_lr()
    with pytest.raises(ValueError, match="warmup_min_lr has 3 values for 2 param groups"):
        WarmupLR(_optimizer(groups=2), warmup_min_lr=[0.0, 0.1, 0.2])


# ------------------------------------------------------------------------------ accumulation, trained
@pytest.fixture(scope="module")
def reference():
    return train_reference()


@pytest.fixture(scope="module", params=(1, 2), ids=lambda n: f"world{n}")
def world(request):
    return request.param, run_distributed(every_stage, request.param, timeout=600)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_accumulating_micro_steps_equals_one_step_on_the_whole_batch(world, reference, stage):
    """The JSON's accumulation, optimizer, scheduler and clipping, through backward + step on every
    micro-batch, train exactly like one process stepping once per global batch."""
    world_size, results = world
    run = results[stage]
    assert run["optimizer"] == "AdamW"  # DeepSpeed's "Adam": decoupled weight decay
    assert (run["micro"], run["accumulation"]) == (GLOBAL_BATCH // (ACCUMULATION * world_size), ACCUMULATION)
    assert run["boundaries"] == run["stepped"] == [False, False, False, True] * STEPS
    assert run["global_steps"] == STEPS
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert max(reference["norms"]) > 0.5  # clipping was active
    assert run["lrs"] == pytest.approx(reference["lrs"], rel=1e-12)
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(run["state"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_stages_0_and_1_reduce_only_at_the_boundary(world, stage):
    world_size, results = world
    reductions = results[stage]["reductions"]
    if world_size == 1:
        assert reductions == [0] * len(reductions)  # one process communicates nothing
        return
    boundary = reductions[ACCUMULATION - 1 :: ACCUMULATION]
    inside = [n for i, n in enumerate(reductions) if i % ACCUMULATION != ACCUMULATION - 1]
    assert min(boundary) > 0
    if stage <= 1:
        assert inside == [0] * len(inside)
    else:  # stages 2-3 keep only their gradient shard: every micro-step reduces into it
        assert min(inside) > 0


def test_the_scheduler_is_not_stepped_after_an_overflow_skip():
    engine = engine_with_schedule(fp16={"enabled": True, "initial_scale_power": 60, "hysteresis": 1})
    micro_steps(engine, 0, 2)
    assert engine.step_was_skipped and engine.global_steps == 1
    assert engine.lr_scheduler.last_batch_iteration == -1  # as built: DeepSpeed steps it only after updates


@pytest.mark.slow
def test_a_checkpoint_keeps_the_schedule_and_is_taken_only_at_a_boundary(tmp_path):
    result = run_distributed(save_and_resume, 1, str(tmp_path / "checkpoint"))[0]
    assert "inside an accumulation window (1 of 2 micro-steps accumulated)" in result["mid_window"]
    assert result["iteration"] == 1  # two updates before the save: iterations -1 (built), 0, 1
    assert result["rest"] == pytest.approx(result["uninterrupted"][4:], rel=1e-6)
    assert result["resumed_lr"] == pytest.approx(result["lr"])
    assert "has no lr_scheduler.json" in result["schedule_missing"]


# ------------------------------------------------------------------------------------------ Accelerate
@pytest.mark.slow
def test_the_accelerator_adopts_the_json_accumulation_and_the_engine_does_not_accumulate_again(tmp_path):
    path = tmp_path / "ds.json"
    ds = {
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 8,
        **zero(stage=3),
    }
    path.write_text(json.dumps(ds))
    result = run_distributed(accelerate_json_accumulation, 2, str(path), 3, timeout=600)[0]
    from_json, given = result["json"], result["given"]
    assert (from_json["accelerator_accumulation"], from_json["engine_accumulation"], from_json["micro"]) == (
        2,
        1,
        2,
    )
    assert from_json["global_steps"] == given["global_steps"] == [0, 1, 1, 2, 2, 3]
    assert from_json["losses"] == pytest.approx(given["losses"], rel=1e-6)


def test_the_accelerator_refuses_what_disagrees_with_the_json():
    result = run_distributed(accelerator_refusals, 1)[0]
    assert "sets 2 steps but the Accelerator was given gradient_accumulation_steps=4" in result["steps"]
    assert "sets 4 steps but the Accelerator was given gradient_accumulation_steps=1" in result["plugin"]
    assert (
        "train_batch_size 8 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 3 x world size 1"
        in result["batch"]
    )
    assert result["auto"] == 4
    assert (
        "optimizer section (AdamW) and prepare() takes the optimizer as an object (it was given a SGD)"
        in result["optimizer"]
    )
    assert "scheduler section (WarmupLR) and prepare() was given a StepLR" in result["scheduler"]
    assert result["scheduler_alone"] == "accepted"
    assert "the Accelerator's mixed_precision='fp16' conflicts with" in result["precision"]
    assert "which enables bf16" in result["precision"]


def test_data_types_at_what_the_engine_does_are_accepted_and_typos_named():
    # gradients accumulate, and parameters live, in the compute dtype; every buffer keeps its own dtype
    same = {
        "grad_accum_dtype": "bfloat16",
        "param_dtype": "bf16",
        "buffer_dtype": None,
        "keep_in_fp32_modules": [],
    }
    assert load_deepspeed({"bf16": {"enabled": True}, "data_types": same}).zero.mixed_precision == "bf16"
    assert load_deepspeed({"data_types": {"grad_accum_dtype": "float32"}}).zero.mixed_precision == "no"
    # DeepSpeed lower-cases communication_data_type
    assert (
        load_deepspeed({"bf16": {"enabled": True}, "communication_data_type": "BF16"}).zero.mixed_precision
        == "bf16"
    )
    with pytest.raises(
        ValueError, match=r"unknown keys data_types\.grad_acum_dtype \(did you mean 'grad_accum_dtype'"
    ):
        load_deepspeed({"data_types": {"grad_acum_dtype": "fp32"}})
    with pytest.raises(
        ValueError, match=r"keep_in_fp32_modules must be \"auto\" or a list of name patterns, got 3"
    ):
        load_deepspeed({"data_types": {"keep_in_fp32_modules": 3}})


@pytest.mark.parametrize(
    ("json_config", "refused"),
    [
        ({"data_types": {"grad_accum_dtype": "fp32"}}, 'data_types.grad_accum_dtype = "fp32"'),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, None),
        ({"communication_data_type": "fp32"}, 'communication_data_type = "fp32"'),
    ],
)
def test_dtype_keys_are_checked_at_the_precision_a_launcher_fills(json_config, refused):
    # a JSON that enables no precision was checked at fp32 when read: the fp32 accumulation was then
    # accepted and the run trained in the launcher's bf16, and bf16 accumulation refused
    settings = engine_settings(json_config, mixed_precision="bf16")
    if refused is None:
        assert settings.with_mixed_precision("bf16", "--mixed_precision bf16").zero.mixed_precision == "bf16"
        return
    with pytest.raises(
        ValueError, match=re.escape(refused) + r".*here bf16.*the precision --mixed_precision bf16 gives"
    ):
        settings.with_mixed_precision("bf16", "--mixed_precision bf16")


def test_an_engine_built_at_fp32_checks_the_dtype_keys_its_json_left_open():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r'data_types.grad_accum_dtype = "bf16" .*here fp32'):
        initialize(model, torch.optim.AdamW(model.parameters()), {"data_types": {"grad_accum_dtype": "bf16"}})


def test_the_readers_that_return_a_bare_zero_config_check_its_dtype_keys():
    # a ZeroConfig keeps no dtype keys, so they are checked where it is returned, at its precision
    fp32_reduction_of_bf16 = {"zero_optimization": {"stage": 2}, "communication_data_type": "bf16"}
    for read in (zero_config_from, zero_config_from_deepspeed, parse_deepspeed):
        with pytest.raises(ValueError, match=r'communication_data_type = "bf16" .*here fp32'):
            read(fp32_reduction_of_bf16)
    accumulating_in_fp32 = {"data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(ValueError, match=r'grad_accum_dtype = "fp32" .*here bf16'):
        zero_config_from_deepspeed(accumulating_in_fp32, overrides={"mixed_precision": "bf16"})
