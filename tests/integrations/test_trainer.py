"""ZeroTrainer: `transformers.Trainer` on the ZeRO engine trains like the plain Trainer (DDP), saves a
model `from_pretrained` loads, and resumes from its checkpoints exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.trainer_cases import train
from tests.support.zero_tnlg_cases import debug_model
from tnlg import TNLGForCausalLM
from tnlg.tools.spawn import run_distributed

STAGES = (0, 1, 2, 3)


def _every_stage(rank: int, world_size: int, directory: str) -> dict:
    runs = {"ddp": train(rank, world_size, None, f"{directory}/ddp")}
    for stage in STAGES:
        runs[stage] = train(rank, world_size, stage, f"{directory}/stage{stage}")
    # The Trainer's torch_compile reaches the engine as Accelerate's dynamo settings: compiled blocks.
    runs["compiled"] = train(rank, world_size, 3, f"{directory}/compiled", compile_backend="aot_eager")
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trainer")
    return run_distributed(_every_stage, 2, str(directory), timeout=900)[0], directory


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_losses_and_norms_equal_the_plain_trainer(runs, stage):
    results, _ = runs
    assert results[stage]["accelerator"] == "ZeroAccelerator"
    assert results["ddp"]["steps"] == [1, 2, 3, 4]
    assert results[stage]["steps"] == results["ddp"]["steps"]
    assert results[stage]["losses"] == pytest.approx(results["ddp"]["losses"], rel=1e-5)
    assert results[stage]["norms"] == pytest.approx(results["ddp"]["norms"], rel=1e-5)
    assert results[stage]["lrs"] == pytest.approx(results["ddp"]["lrs"], rel=1e-7)
    assert results["ddp"]["losses"][-1] < results["ddp"]["losses"][0]


@pytest.mark.slow
def test_torch_compile_compiles_the_blocks_inside_the_engine(runs):
    results, _ = runs
    assert results[3]["compiled_blocks"] == []
    assert results["compiled"]["compiled_blocks"] == ["model.layers.0", "model.layers.1"]
    assert results["compiled"]["compiles"] >= 1 and results[3]["compiles"] == 0  # compiled code ran
    assert results["compiled"]["losses"] == pytest.approx(results[3]["losses"], rel=1e-5)
    assert results["compiled"]["norms"] == pytest.approx(results[3]["norms"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_save_model_writes_the_trained_weights(runs, stage):
    _, directory = runs
    ddp = TNLGForCausalLM.from_pretrained(directory / "ddp" / "final").state_dict()
    sharded = TNLGForCausalLM.from_pretrained(directory / f"stage{stage}" / "final").state_dict()
    for name, tensor in ddp.items():
        # Adam normalizes tiny gradients: reduction-order noise reaches ~1e-5; one step of lr 1e-2 is 1e-2.
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-4, msg=name)
    checkpoint = directory / f"stage{stage}" / "checkpoint-2"
    assert (checkpoint / "engine" / "manifest.json").is_file()  # the layout of run checkpoints and save_state
    assert (checkpoint / "scheduler.json").is_file()


def _from_pretrained_shards(rank: int, world_size: int, directory: str, saved: str) -> dict:
    return train(rank, world_size, 3, directory, save_final=False, pretrained=saved)


@pytest.mark.slow
def test_a_meta_model_from_pretrained_trains_like_the_loaded_model(runs, tmp_path):
    """The Trainer gets a meta-device model; the engine fills each rank's shards from the checkpoint."""
    results, _ = runs
    saved = tmp_path / "saved"
    debug_model().save_pretrained(saved)  # the weights every other run starts from
    result = run_distributed(_from_pretrained_shards, 2, str(tmp_path / "run"), str(saved), timeout=300)[0]
    assert result["steps"] == results[3]["steps"]
    assert result["losses"] == pytest.approx(results[3]["losses"], rel=1e-6)
    assert result["norms"] == pytest.approx(results[3]["norms"], rel=1e-6)


def _resumed(rank: int, world_size: int, directory: str, stage: int) -> dict:
    train(rank, world_size, stage, directory, save_final=False, stop_after=2)
    return train(rank, world_size, stage, directory, max_steps=4, resume=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_resume_from_a_checkpoint_continues_exactly(runs, stage, tmp_path):
    results, _ = runs
    resumed = run_distributed(_resumed, 2, str(tmp_path), stage, timeout=600)[0]
    # The history of steps 1-2 comes back from checkpoint-2's trainer state; steps 3-4 are new.
    assert resumed["steps"] == [1, 2, 3, 4]
    assert resumed["losses"] == pytest.approx(results[stage]["losses"], rel=1e-6)
    assert resumed["norms"] == pytest.approx(results[stage]["norms"], rel=1e-6)


def _selection(rank: int, world_size: int, directory: str) -> dict:
    import os

    from transformers import TrainingArguments

    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.sharding.checkpoint import CheckpointError
    from tnlg.trainer import ZeroTrainer

    def make(**arguments):
        args = TrainingArguments(output_dir=directory, use_cpu=True, report_to=[], **arguments)
        return ZeroTrainer(model=debug_model(), args=args)

    found = {"none": type(make().accelerator).__name__}
    os.environ["TNLG_ZERO_STAGE"] = "2"
    trainer = make()
    found["environment"] = (type(trainer.accelerator).__name__, trainer.accelerator.zero_config.stage)
    try:  # the argument beside the variable: one of them would be ignored
        ZeroTrainer(model=debug_model(), args=TrainingArguments(output_dir=directory, use_cpu=True, report_to=[]),
                    zero_config={"stage": 1})  # fmt: skip
    except ValueError as error:
        found["both"] = str(error)
    trainer.create_optimizer()
    trainer.model_wrapped, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    try:
        trainer._load_optimizer_and_scheduler(directory)
    except FileNotFoundError as error:
        found["no engine checkpoint"] = str(error)
    old = Path(directory) / "old-layout"  # a checkpoint-N of before the layouts were one: engine in zero/
    (old / "zero").mkdir(parents=True)
    (old / "zero" / "manifest.json").write_text("{}")
    try:
        trainer._load_optimizer_and_scheduler(str(old))
    except CheckpointError as error:
        found["old layout"] = str(error)
    try:
        make(fsdp="full_shard")
    except ValueError as error:
        found["fsdp"] = str(error)
    del os.environ["TNLG_ZERO_STAGE"]  # train passes zero_config, which the variable must not contradict
    found["bf16"] = train(rank, world_size, 2, f"{directory}/bf16", bf16=True, save_final=False)
    return found


@pytest.mark.slow
def test_the_engine_is_selected_by_argument_or_environment_and_conflicts_are_named(tmp_path):
    found = run_distributed(_selection, 1, str(tmp_path), timeout=300)[0]
    assert found["none"] == "Accelerator"  # nothing asks for ZeRO: the plain Trainer
    assert found["environment"] == ("ZeroAccelerator", 2)
    assert (
        "TNLG_ZERO_STAGE=2 is set, but ZeroTrainer(zero_config=...) states the ZeRO engine's settings"
        in found["both"]
    )
    assert "has no engine/ engine checkpoint" in found["no engine checkpoint"]
    assert "DeepSpeed" not in found["no engine checkpoint"]
    assert "old ZeroTrainer layout: rename" in found["old layout"]
    assert "old-layout/zero to" in found["old layout"]
    assert "remove the DeepSpeed / FSDP settings" in found["fsdp"]
    bf16 = found["bf16"]  # TrainingArguments(bf16=True) selects the engine's bf16 parameters
    assert bf16["parameter_dtype"] == "torch.bfloat16"
    assert bf16["losses"][-1] < bf16["losses"][0]


def _best_model(rank: int, world_size: int, directory: str, stage: int, save_only_model: bool) -> dict:
    from transformers import TrainingArguments

    from tests.support.trainer_cases import dataset
    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.sharding import ZeroConfig
    from tnlg.trainer import ZeroTrainer

    args = TrainingArguments(
        output_dir=directory, use_cpu=True, report_to=[], per_device_train_batch_size=2, max_steps=4,
        learning_rate=5e-2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False,
        # An eval set unlike the training data: the training steps make its loss worse after a point,
        # so the best checkpoint is not simply the last one.
        disable_tqdm=True, save_only_model=save_only_model,
    )  # fmt: skip
    rows = torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(3))
    held_out = [{"input_ids": row, "labels": row} for row in rows]
    trainer = ZeroTrainer(
        model=debug_model(), args=args, train_dataset=dataset(1), eval_dataset=held_out,
        zero_config=ZeroConfig(stage=stage),
    )  # fmt: skip
    trainer.train()
    return {"best": trainer.state.best_model_checkpoint, "state": trainer.engine.full_state_dict()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "save_only_model"),
    # save_only_model: the checkpoints hold the consolidated weights alone, loaded as the plain Trainer loads them
    [(3, False), (2, True)],
)
def test_load_best_model_at_end_restores_the_best_checkpoint_shards(tmp_path, stage, save_only_model):
    result = run_distributed(_best_model, 1, str(tmp_path), stage, save_only_model, timeout=300)[0]
    assert (Path(result["best"]) / "engine").is_dir() != save_only_model
    best = TNLGForCausalLM.from_pretrained(result["best"]).state_dict()
    last = TNLGForCausalLM.from_pretrained(tmp_path / "checkpoint-4").state_dict()
    assert Path(result["best"]).name != "checkpoint-4"  # else the test could not tell restored from last
    assert not all(torch.equal(best[name], last[name]) for name in best)
    for name, tensor in best.items():
        torch.testing.assert_close(result["state"][name], tensor, rtol=0, atol=0, msg=name)


def _save_only_model_refusals(rank: int, world_size: int, directory: str) -> dict:
    from transformers import TrainingArguments

    from tests.support.trainer_cases import dataset
    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.sharding import ZeroConfig
    from tnlg.trainer import ZeroTrainer

    found = {}
    args = TrainingArguments(
        output_dir=directory, use_cpu=True, report_to=[], eval_strategy="steps", save_strategy="steps",
        load_best_model_at_end=True, save_only_model=True,
    )  # fmt: skip
    try:  # stage 3 takes no full state dict into its module: refused when built, not after training
        ZeroTrainer(model=debug_model(), args=args, eval_dataset=dataset(1), zero_config=ZeroConfig(stage=3))
    except ValueError as error:
        found["best at stage 3"] = str(error)
    train(rank, world_size, 2, f"{directory}/weights", save_final=False, stop_after=2, save_only_model=True)
    try:
        train(
            rank, world_size, 2, f"{directory}/weights", save_final=False, resume=True, save_only_model=True
        )
    except FileNotFoundError as error:
        found["resume"] = str(error)
    return found


@pytest.mark.slow
def test_what_save_only_model_checkpoints_cannot_do_is_refused_by_name(tmp_path):
    found = run_distributed(_save_only_model_refusals, 1, str(tmp_path), timeout=300)[0]
    assert (
        "save_only_model=True with load_best_model_at_end=True under ZeRO stage 3" in found["best at stage 3"]
    )
    assert "checkpoint-2 has no engine/ engine checkpoint" in found["resume"]
    assert "it was saved with save_only_model=True" in found["resume"]
    assert "no optimizer or scheduler state" in found["resume"]


def test_save_only_model_best_weights_under_tensor_slicing_are_refused():
    from types import SimpleNamespace

    from tnlg.sharding import ParallelDims
    from tnlg.trainer import _refuse_best_weights_it_cannot_load

    accelerator = SimpleNamespace(zero_config=SimpleNamespace(stage=2), parallel_dims=ParallelDims(tensor=2))
    args = SimpleNamespace(save_only_model=True, load_best_model_at_end=True)
    with pytest.raises(ValueError, match=r"under tensor slicing \(2 slices\): those checkpoints hold only"):
        _refuse_best_weights_it_cannot_load(accelerator, args)
    args.load_best_model_at_end = False  # the checkpoints alone are fine: from_pretrained loads them
    _refuse_best_weights_it_cannot_load(accelerator, args)
