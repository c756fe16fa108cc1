"""ZeroTrainer settles the engine's settings against TrainingArguments as the HF Trainer does for a
DeepSpeed JSON: one clipping value, batch keys that match (or "auto"), and no second scheduler."""

from __future__ import annotations

import json

import pytest

from tnlg.tools.spawn import run_distributed

STAGE1 = {"zero_optimization": {"stage": 1}}


def _written(directory: str, config: dict) -> str:
    """`config` as a DeepSpeed JSON file of its own in `directory`."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=directory, delete=False) as file:
        json.dump(config, file)
    return file.name


def _outcome(directory: str, zero_config, **arguments) -> str | object:
    """The trainer's accelerator, or the error building the trainer raised."""
    from transformers import TrainingArguments

    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.trainer import ZeroTrainer

    if isinstance(zero_config, dict):
        zero_config = _written(directory, zero_config)
    args = TrainingArguments(output_dir=directory, use_cpu=True, report_to=[], **arguments)
    try:
        return ZeroTrainer(model=debug_model(), args=args, zero_config=zero_config).accelerator
    except ValueError as error:
        return str(error)


def _clipping(rank: int, world_size: int, directory: str) -> dict:
    from tnlg.sharding import ZeroConfig

    def clipping(zero_config, **arguments):
        found = _outcome(directory, zero_config, **arguments)
        return found if isinstance(found, str) else found.zero_config.gradient_clipping

    return {
        "zero mismatch": clipping(ZeroConfig(stage=1, gradient_clipping=0.01), max_grad_norm=0.0),
        "zero default mismatch": clipping(ZeroConfig(stage=1, gradient_clipping=0.01)),
        "zero agrees": clipping(ZeroConfig(stage=1, gradient_clipping=0.01), max_grad_norm=0.01),
        "zero unset": clipping(ZeroConfig(stage=1), max_grad_norm=0.5),
        "json mismatch": clipping({**STAGE1, "gradient_clipping": 0.1}, max_grad_norm=1.0),
        "json auto": clipping({**STAGE1, "gradient_clipping": "auto"}, max_grad_norm=0.25),
    }


def test_max_grad_norm_and_the_configured_clipping_are_one_value(tmp_path):
    found = run_distributed(_clipping, 1, str(tmp_path))[0]
    assert (
        "max_grad_norm=0.0" in found["zero mismatch"] and "gradient_clipping 0.01" in found["zero mismatch"]
    )
    assert "max_grad_norm=1.0" in found["zero default mismatch"]
    assert found["zero agrees"] == 0.01
    assert found["zero unset"] == 0.5
    assert "max_grad_norm=1.0" in found["json mismatch"] and "gradient_clipping 0.1" in found["json mismatch"]
    assert found["json auto"] == 0.25


def _batch_keys(rank: int, world_size: int, directory: str) -> dict:
    def outcome(config, **arguments):
        found = _outcome(directory, {**STAGE1, **config}, **arguments)
        return found if isinstance(found, str) else found.gradient_accumulation_steps

    return {
        "agree": outcome({"gradient_accumulation_steps": 4}, gradient_accumulation_steps=4),
        "auto": outcome({"gradient_accumulation_steps": "auto"}, gradient_accumulation_steps=4),
        "accumulation": outcome({"gradient_accumulation_steps": 1}, gradient_accumulation_steps=4),
        "micro": outcome({"train_micro_batch_size_per_gpu": 8}, per_device_train_batch_size=2),
        "global": outcome(
            {"train_batch_size": 4}, per_device_train_batch_size=2, gradient_accumulation_steps=4
        ),
    }


def test_the_jsons_batch_keys_are_checked_against_training_arguments(tmp_path):
    found = run_distributed(_batch_keys, 1, str(tmp_path))[0]
    assert (
        found["agree"] == 1 and found["auto"] == 1
    )  # the Trainer accumulates; its Accelerator steps each time
    assert "gradient_accumulation_steps 1" in found["accumulation"]
    assert "TrainingArguments.gradient_accumulation_steps = 4" in found["accumulation"]
    assert "train_micro_batch_size_per_gpu 8" in found["micro"]
    assert "per_device_train_batch_size = 2" in found["micro"]
    assert "train_batch_size 4" in found["global"] and "= 8" in found["global"]


def _scheduler(rank: int, world_size: int, directory: str) -> str:
    section = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.5, "warmup_num_steps": 10},
    }
    return _outcome(directory, {**STAGE1, "scheduler": section})


def test_a_json_scheduler_section_is_refused_under_the_trainer(tmp_path):
    found = run_distributed(_scheduler, 1, str(tmp_path))[0]
    assert isinstance(found, str)
    assert "scheduler section (WarmupLR)" in found and "lr_scheduler_type" in found


def _clipped_training(rank: int, world_size: int, directory: str) -> float:
    import torch
    from transformers import TrainingArguments

    from tests.support.trainer_cases import dataset
    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.trainer import ZeroTrainer

    args = TrainingArguments(
        output_dir=directory, per_device_train_batch_size=2, max_steps=1, max_grad_norm=0.01, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant",
    )  # fmt: skip
    model = debug_model()
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = ZeroTrainer(
        model=model, args=args, train_dataset=dataset(1),
        zero_config=_written(directory, {**STAGE1, "gradient_clipping": 0.01}), optimizers=(optimizer, None),
    )  # fmt: skip
    trainer.train()
    after = torch.cat([p.detach().reshape(-1) for p in trainer.engine.module.parameters()])
    return (after - before).norm().item()


def test_the_one_clipping_value_clips_the_trainers_step(tmp_path):
    update = run_distributed(_clipped_training, 1, str(tmp_path), timeout=300)[0]
    assert update == pytest.approx(0.01, rel=1e-3)  # SGD at lr 1: the clipped gradient


def _precision(rank: int, world_size: int, directory: str) -> dict:
    from tnlg.sharding import ZeroConfig

    return {
        "zero_config": _outcome(directory, ZeroConfig(stage=2, mixed_precision="bf16"), fp16=True),
        "json": _outcome(directory, {**STAGE1, "bf16": {"enabled": True}}, fp16=True),
    }


def test_a_precision_conflict_names_what_the_user_set_on_each_side(tmp_path):
    found = run_distributed(_precision, 1, str(tmp_path))[0]
    assert found["zero_config"].startswith(
        "TrainingArguments.fp16=True conflicts with ZeroConfig.mixed_precision='bf16', which enables bf16"
    )
    assert found["json"].startswith("TrainingArguments.fp16=True conflicts with bf16.enabled: true in ")
    assert "which enables bf16" in found["json"]


def _full_eval(rank: int, world_size: int, directory: str) -> dict:
    from tnlg.sharding import ZeroConfig

    return {
        name: _outcome(directory, ZeroConfig(stage=2), **{name: True})
        for name in ("bf16_full_eval", "fp16_full_eval", "auto_find_batch_size")
    }


def test_a_full_eval_cast_is_refused_naming_the_setting(tmp_path):
    # The Trainer casts the whole model for it; after training that failed on the engine's gradients.
    found = run_distributed(_full_eval, 1, str(tmp_path))[0]
    assert "bf16_full_eval=True casts the whole model" in found["bf16_full_eval"]
    assert "set fp16=True" in found["fp16_full_eval"]
    assert "auto_find_batch_size=True retries training" in found["auto_find_batch_size"]


def _trained_twice(rank: int, world_size: int, directory: str) -> str | None:
    from transformers import TrainingArguments

    from tests.support.trainer_cases import dataset
    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.trainer import ZeroTrainer

    args = TrainingArguments(
        output_dir=directory, per_device_train_batch_size=2, max_steps=1, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = ZeroTrainer(model=debug_model(), args=args, train_dataset=dataset(1), zero_config={"stage": 2})
    trainer.train()
    try:
        trainer.train()
    except RuntimeError as error:
        return str(error)
    return None


def test_a_second_train_is_refused_rather_than_rebuilt_from_the_closed_engine(tmp_path):
    found = run_distributed(_trained_twice, 1, str(tmp_path))[0]
    assert found is not None and "ZeroTrainer.train() was called again" in found


def _save_on_each_node(rank: int, world_size: int, directory: str, nodes: int) -> str | object:
    import os
    import socket

    from accelerate.state import AcceleratorState

    from tnlg.sharding import ZeroConfig

    # Two nodes: each of the 2 processes has a host name of its own and is its machine's first.
    if nodes == 2:
        socket.gethostname = lambda: f"node-{rank}"  # this rank's process only
    os.environ["LOCAL_RANK"] = "0" if nodes == 2 else str(rank)
    AcceleratorState._reset_state(True)
    found = _outcome(directory, ZeroConfig(stage=2), save_on_each_node=True)
    return found if isinstance(found, str) else type(found).__name__


@pytest.mark.slow
def test_save_on_each_node_on_two_nodes_is_refused_when_the_trainer_is_built(tmp_path):
    # checkpoint-N/engine is written once, for storage every node shares; the second node would lack it.
    for found in run_distributed(_save_on_each_node, 2, str(tmp_path), 2):
        assert "TrainingArguments(save_on_each_node=True) with processes on 2 nodes" in found
        assert "set save_on_each_node=False" in found
    # On one node the shared files are already on the only storage there is.
    assert run_distributed(_save_on_each_node, 2, str(tmp_path), 1) == ["ZeroAccelerator"] * 2
