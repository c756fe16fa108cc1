"""`model.activation_checkpointing`: turned on before the engine is built (meta device, ZeRO-3 hooks),
with its CPU offload of saved activations; losses equal those of the run without it."""

from __future__ import annotations

import pytest
import torch

from tests.support.run_cases import build_debug_run
from tnlg import TNLGForCausalLM
from tnlg.run.activations import (
    HostActivations,
    enable_activation_checkpointing,
    is_activation_checkpointing,
    offloaded_activations,
)
from tnlg.run.build import meta_model
from tnlg.tools.spawn import run_distributed

VARIANTS = {"plain": [], "checkpointed": ["true", "false"], "offloaded": ["true", "true"]}


def test_checkpointing_is_enabled_on_the_meta_device_model(debug_config):
    model = meta_model(debug_config)
    assert not is_activation_checkpointing(model)
    enable_activation_checkpointing(model)
    assert is_activation_checkpointing(model)
    assert all(block.gradient_checkpointing for block in model.model.layers)
    assert model.model.layers[0].self_attn.qkv_proj.weight.is_meta  # nothing was materialized


def test_a_model_without_checkpointed_layers_is_refused():
    with pytest.raises(ValueError, match="does not support activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def _offloaded_bytes(config, checkpointing: bool) -> int:
    """Bytes the offload hooks moved in one forward of a fresh model of `config` (then its backward)."""
    torch.manual_seed(0)
    model = TNLGForCausalLM(config).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    hooks = HostActivations(pin_memory=False)
    with hooks:
        loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    return hooks.packed_bytes


def test_with_checkpointing_the_offload_moves_each_block_input_and_no_block_internals(debug_config):
    deeper = debug_config.to_dict() | {"num_hidden_layers": debug_config.num_hidden_layers + 2}
    deeper = type(debug_config).from_dict(deeper)
    block_input = 2 * 16 * debug_config.hidden_size * 4  # (B, T, H) fp32
    # Two more checkpointed blocks: exactly their two inputs more (the non-reentrant checkpoint saves
    # them through the hooks; what the blocks compute is recomputed, not saved).
    extra = _offloaded_bytes(deeper, True) - _offloaded_bytes(debug_config, True)
    assert extra == 2 * block_input
    assert _offloaded_bytes(deeper, False) - _offloaded_bytes(debug_config, False) > 10 * block_input


def test_the_offload_keeps_parameters_where_they_are():
    weight = torch.nn.Parameter(torch.randn(3, 5))
    activation = torch.randn(5, 7, requires_grad=True)
    hooks = HostActivations(pin_memory=False)
    with hooks:
        product = weight @ activation  # saves both
    product.sum().backward()
    assert hooks.packed_bytes == activation.numel() * 4
    torch.testing.assert_close(weight.grad, torch.ones(3, 7) @ activation.detach().T)


def test_checkpointing_with_offload_gives_the_same_loss_and_gradients(debug_config):
    model = TNLGForCausalLM(debug_config).train()
    input_ids = torch.randint(0, debug_config.vocab_size, (2, 16))

    def loss_and_gradients(offload: bool):
        model.zero_grad()
        hooks = offloaded_activations(offload)
        with hooks:  # (saved_tensors_hooks' __enter__ returns None: keep the object)
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()  # after the context: unpacking still goes through the hooks
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, hooks

    plain_loss, plain_grads, no_hooks = loss_and_gradients(False)
    assert not isinstance(no_hooks, HostActivations)
    enable_activation_checkpointing(model)
    loss, grads, hooks = loss_and_gradients(True)
    assert isinstance(hooks, HostActivations) and hooks.packed_bytes > 0
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for name, gradient in plain_grads.items():
        torch.testing.assert_close(grads[name], gradient, msg=name)


def _losses(rank, world_size, cache, output, variant):
    """Three optimizer steps of the debug run at ZeRO stage 3 built by `build_run`, with the variant's
    `model.activation_checkpointing`; the losses, and whether the engine's model recomputes."""
    from tnlg.run.loop import train_step

    overrides = ["--train.output_dir", output, "--logging.trackers", "[]", "--zero.stage", "3",
                 "--data.shuffle_buffer", "1", "--train.micro_batch_size", "4",
                 "--zero.param_persistence_threshold", "1000"]  # fmt: skip
    if VARIANTS[variant]:
        enabled, offload = VARIANTS[variant]
        overrides += ["--model.activation_checkpointing.enabled", enabled]
        overrides += ["--model.activation_checkpointing.cpu_offload", offload]
    run = build_debug_run(cache, overrides)
    batches = iter(run.stream)
    losses = [train_step(run, batches, step)["loss"] for step in range(3)]
    checkpointing = is_activation_checkpointing(run.engine.module)
    run.engine.close()
    return {"losses": losses, "checkpointing": checkpointing}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_stage_3_losses_with_checkpointing_and_offload_equal_the_plain_run(world_size, cache, tmp_path):
    results = {
        variant: run_distributed(
            _losses, world_size, str(cache), str(tmp_path / variant), variant, timeout=400
        )[0]
        for variant in VARIANTS
    }
    assert not results["plain"]["checkpointing"]
    assert results["checkpointed"]["checkpointing"] and results["offloaded"]["checkpointing"]
    plain = results["plain"]["losses"]
    assert plain[-1] < plain[0]  # the steps trained: equal losses are not three copies of the first
    for variant in ("checkpointed", "offloaded"):
        assert results[variant]["losses"] == pytest.approx(plain, rel=1e-6, abs=1e-6), variant


@pytest.mark.gpu
def test_offload_on_cuda_moves_block_inputs_to_pinned_host_memory_and_keeps_gradients(debug_config):
    model = TNLGForCausalLM(debug_config).cuda().train()
    input_ids = torch.randint(0, debug_config.vocab_size, (2, 16), device="cuda")
    reference = model(input_ids, labels=input_ids).loss
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    enable_activation_checkpointing(model)
    hooks = offloaded_activations(True)
    with hooks:
        loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert hooks.packed_bytes >= debug_config.num_hidden_layers * 2 * 16 * debug_config.hidden_size * 4
    torch.testing.assert_close(loss, reference)
    for name, gradient in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, gradient, msg=name)
