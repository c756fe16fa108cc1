"""LoRA with the fused kernels: the fused MLP and LM-head paths read a projection's weight into their
own kernels, which would skip a peft adapter wrapping it. They must fall back to calling the module:
the same loss and adapter gradients as with fused_kernels="none" (CPU under TRITON_INTERPRET=1, and
CUDA when there is one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling import fused_ops
from tnlg.modeling.modeling_tnlg import is_plain_linear

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def lora_model(fused: str, targets: list[str], state: dict | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels=fused))
    # init_lora_weights=False: B is random too, so the adapters change the output and every adapter
    # weight gets a gradient (with peft's default B = 0, A's gradient is zero).
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config).to(DEVICE)
    if state is not None:
        wrapped.load_state_dict(state)
    return wrapped


@pytest.mark.parametrize(
    "targets",
    [
        pytest.param(["fc_in", "fc_out", "qkv_proj", "out_proj"], id="blocks", marks=pytest.mark.slow),
        # The head is tied to the token embedding; peft warns that the adapter is not tied to it.
        pytest.param(["lm_head"], id="head", marks=pytest.mark.filterwarnings("ignore:Model has `tie_word")),
    ],
)
def test_lora_trains_the_same_with_fused_kernels(targets):
    plain = lora_model("none", targets)
    fused = lora_model("triton", targets, plain.state_dict())
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    plain_loss = plain(input_ids=ids, labels=labels).loss
    fused_loss = fused(input_ids=ids, labels=labels).loss
    assert fused_loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    plain_loss.backward()
    fused_loss.backward()
    adapters = {name: p for name, p in fused.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in name for name in adapters)
    for name, want in plain.named_parameters():
        if name in adapters:
            got = adapters[name].grad
            assert want.grad.abs().max() > 0, name
            torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_only_a_plain_linear_takes_the_fused_path():
    linear = nn.Linear(4, 4)
    assert is_plain_linear(linear)
    hook = linear.register_forward_pre_hook(lambda module, args: None)
    assert not is_plain_linear(linear)
    hook.remove()
    assert is_plain_linear(linear)
    linear.forward = lambda x: x  # what accelerate's add_hook_to_module does
    assert not is_plain_linear(linear)
    wrapped = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
    assert not is_plain_linear(wrapped.base_model.model[0])
