"""What a load leaves of the live engine's settings: a stage 3 state dict (freed storage) is refused,
a checkpoint's hyperparameters only reach the param groups holding the same parameters, another
optimizer's state is refused, the configured loss scaling wins over another mode's saved scale, and a
save interrupted before its manifest leaves no checkpoint that loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tnlg.sharding.checkpoint as checkpoint_module
from tnlg.sharding import ZeroConfig, ZeroEngine, initialize
from tnlg.sharding.checkpoint import CheckpointError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def _engine(optimizer_of, **config) -> ZeroEngine:
    model = _model()
    return initialize(model, optimizer_of(model), ZeroConfig(**config))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _train_one_step(engine: ZeroEngine) -> None:
    loss = engine(torch.randn(2, 4).to(engine.compute_dtype)).float().sum()
    engine.backward(loss)
    engine.step()


def _saved(tmp_path, optimizer_of=_adamw, **config) -> str:
    engine = _engine(optimizer_of, **config)
    _train_one_step(engine)
    engine.save_checkpoint(tmp_path / "saved")
    engine.close()
    return str(tmp_path / "saved")


# ---------------------------------------------------------------------------------------- state dicts
def test_engine_state_dict_at_stage_3_is_refused_naming_full_state_dict():
    engine = _engine(_adamw, stage=3, param_persistence_threshold=0)
    with pytest.raises(RuntimeError, match=r"full_state_dict\(\)"):
        engine.state_dict()
    assert set(engine.full_state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_engine_state_dict_at_stage_2_holds_the_live_parameters():
    engine = _engine(_adamw, stage=2)
    _train_one_step(engine)
    state = engine.state_dict()
    for name, tensor in engine.full_state_dict().items():
        assert torch.equal(state[f"module.{name}"], tensor), name


# ---------------------------------------------------------------------------------------- param groups
def _decay_split(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}]
    return torch.optim.AdamW(groups, lr=1e-3)


def _hyperparameters(engine: ZeroEngine) -> list[tuple[float, float]]:
    return [(g["weight_decay"], g["lr"]) for g in engine.base_optimizer.param_groups]


def test_loading_into_other_param_groups_keeps_the_live_hyperparameters(tmp_path):
    saved = _saved(tmp_path, stage=1)  # one group: weight_decay 0.1, lr 1e-3
    engine = _engine(_decay_split, stage=1)
    engine.load_checkpoint(saved)
    assert _hyperparameters(engine) == [(0.1, 1e-3), (0.0, 5e-4)]


def test_loading_into_the_same_param_groups_restores_the_saved_hyperparameters(tmp_path):
    saved = _saved(tmp_path, optimizer_of=_decay_split, stage=1)
    engine = _engine(_decay_split, stage=2)
    for group in engine.base_optimizer.param_groups:
        group.update(lr=7e-3, weight_decay=0.5)
    engine.load_checkpoint(saved)
    assert _hyperparameters(engine) == [(0.1, 1e-3), (0.0, 5e-4)]


@pytest.mark.parametrize("stage", [1, 3])
def test_every_saved_hyperparameter_comes_back_in_its_type(tmp_path, stage):
    # only int and float values came back: betas (a list in JSON) and amsgrad (a bool) stayed the live
    # group's, so the group was a mix of two optimizers (and amsgrad's saved max moment went unused)
    saved = _saved(
        tmp_path,
        optimizer_of=lambda m: torch.optim.AdamW(
            m.parameters(), lr=1e-2, betas=(0.5, 0.6), eps=1e-3, amsgrad=True
        ),
        stage=stage,
    )
    engine = _engine(_adamw, stage=stage)
    engine.load_checkpoint(saved)
    (group,) = engine.base_optimizer.param_groups
    assert (group["lr"], group["betas"], group["eps"], group["amsgrad"]) == (1e-2, (0.5, 0.6), 1e-3, True)
    _train_one_step(engine)  # the restored amsgrad steps with the restored max moment


def test_a_checkpoint_without_optimizer_state_clears_the_engines_own(tmp_path):
    # a checkpoint saved before the first step: the trained engine kept its moments and step count
    engine = _engine(_adamw, stage=2)
    engine.save_checkpoint(tmp_path / "untrained")
    _train_one_step(engine)
    assert engine.base_optimizer.state[engine.groups[0].master]
    engine.load_checkpoint(tmp_path / "untrained")
    assert not engine.base_optimizer.state.get(engine.groups[0].master)
    fresh = _engine(_adamw, stage=2)
    fresh.load_checkpoint(tmp_path / "untrained")
    for each in (engine, fresh):
        torch.manual_seed(1)  # the same batch
        _train_one_step(each)
    for name, value in fresh.full_state_dict().items():
        assert torch.equal(engine.full_state_dict()[name], value), name


# ---------------------------------------------------------------------------------------- optimizer class
def test_another_optimizers_state_is_refused_naming_both(tmp_path):
    saved = _saved(tmp_path, stage=1)
    engine = _engine(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), stage=1)
    with pytest.raises(CheckpointError, match=r"AdamW.*SGD"):
        engine.load_checkpoint(saved)
    assert engine.base_optimizer.param_groups[0]["lr"] == 0.1


def test_adam_resumes_an_adamw_checkpoint(tmp_path):
    saved = _saved(tmp_path, stage=1)
    engine = _engine(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), stage=2)
    engine.load_checkpoint(saved)
    assert set(engine.base_optimizer.state[engine.groups[0].master]) == {"exp_avg", "exp_avg_sq", "step"}


# ---------------------------------------------------------------------------------------- loss scaling
def test_a_bf16_checkpoint_keeps_the_fp16_engines_initial_scale(tmp_path):
    saved = _saved(tmp_path, stage=2, mixed_precision="bf16")
    engine = _engine(_adamw, stage=2, mixed_precision="fp16", initial_loss_scale=2.0**16)
    engine.load_checkpoint(saved)
    assert engine.loss_scale == 2.0**16


def test_a_static_loss_scale_is_kept_over_a_dynamic_checkpoints(tmp_path):
    saved = _saved(tmp_path, stage=2, mixed_precision="fp16")
    engine = _engine(_adamw, stage=2, mixed_precision="fp16", static_loss_scale=128.0)
    engine.load_checkpoint(saved)
    assert engine.loss_scale == 128.0


def test_a_dynamic_fp16_checkpoint_restores_its_scale(tmp_path):
    saved = _saved(tmp_path, stage=2, mixed_precision="fp16", initial_loss_scale=2.0**10)
    engine = _engine(_adamw, stage=2, mixed_precision="fp16")
    engine.load_checkpoint(saved)
    assert engine.loss_scale == 2.0**10


# ---------------------------------------------------------------------------------------- interrupted saves
def test_a_save_interrupted_before_its_manifest_leaves_no_loadable_checkpoint(tmp_path, monkeypatch):
    engine = _engine(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), stage=1)
    _train_one_step(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    _train_one_step(engine)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("interrupted before the manifest")

    monkeypatch.setattr(checkpoint_module, "write_json_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.undo()
    for verify in (True, False):
        with pytest.raises(CheckpointError, match="manifest"):
            engine.load_checkpoint(tmp_path / "ckpt", verify=verify)


# ---------------------------------------------------------------------------------------- clipping
def _accumulated_step(clip_at_micro_step: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step of two accumulated micro-batches, clip_grad_norm_(0.5) called after the
    backward of micro-step `clip_at_micro_step`."""
    model = _model()
    settings = {
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
    }
    engine = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), settings)
    torch.manual_seed(1)
    for micro_step in range(2):
        engine.backward(engine(torch.randn(2, 4)).sum())
        if micro_step == clip_at_micro_step:
            engine.clip_grad_norm_(0.5)
        engine.step()
    return engine.get_global_grad_norm(), engine.full_state_dict()


def test_a_clip_inside_the_accumulation_window_clips_the_complete_gradients():
    at_boundary_norm, at_boundary = _accumulated_step(clip_at_micro_step=1)
    early_norm, early = _accumulated_step(clip_at_micro_step=0)
    assert early_norm == at_boundary_norm
    for name, tensor in at_boundary.items():
        assert torch.equal(early[name], tensor), name
