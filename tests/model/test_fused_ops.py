"""Fused model kernels (Triton LayerNorm, bias + GeLU, chunked LM-head cross-entropy) against their
references, forward and backward, on CPU under TRITON_INTERPRET=1 (and on CUDA when there is one); the
model gives the same loss and gradients with them on and off."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.modeling import fused_ops

pytestmark = pytest.mark.skipif(not fused_ops.triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def gradients(output: torch.Tensor, inputs: list[torch.Tensor], seed: int = 5) -> list[torch.Tensor]:
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed)).to(output)
    return list(torch.autograd.grad(output, inputs, upstream))


def leaves(*tensors: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
    return [t.to(DEVICE, dtype).requires_grad_() for t in tensors]


# bf16 runs are compared with the fp32 reference of the same bf16 inputs: the kernels compute in
# fp32 and round once, so they sit within a few bf16 roundings (2^-8) of it.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def check_layer_norm(rows: int, width: int, dtype: torch.dtype, device: str = DEVICE):
    """Triton LayerNorm against torch's on fp32 copies of the same inputs, forward and backward."""
    generator = torch.Generator().manual_seed(width)
    x, weight, bias = (
        t.to(device, dtype).requires_grad_()
        for t in (
            torch.randn(rows, width, generator=generator) * 2 + 1,
            torch.randn(width, generator=generator),
            torch.randn(width, generator=generator),
        )
    )
    y = fused_ops.layer_norm(x, weight, bias, 1e-5, "triton")
    expected_inputs = [t.detach().float().requires_grad_() for t in (x, weight, bias)]
    expected = fused_ops.layer_norm_reference(*expected_inputs, 1e-5)
    assert y.dtype == dtype and relative_error(y, expected) <= TOLERANCE[dtype]
    for got, want in zip(gradients(y, [x, weight, bias]), gradients(expected, expected_inputs), strict=True):
        assert got.dtype == dtype and relative_error(got, want) <= TOLERANCE[dtype]


def check_bias_gelu(rows: int, width: int, dtype: torch.dtype, device: str = DEVICE):
    """Triton bias + GeLU against gelu_new on fp32 copies of the same inputs, forward and backward."""
    generator = torch.Generator().manual_seed(width)
    x, bias = (
        t.to(device, dtype).requires_grad_()
        for t in (torch.randn(rows, width, generator=generator) * 4, torch.randn(width, generator=generator))
    )
    y = fused_ops.bias_gelu(x, bias, "triton")
    expected_inputs = [t.detach().float().requires_grad_() for t in (x, bias)]
    expected = fused_ops.bias_gelu_reference(*expected_inputs)
    assert y.dtype == dtype and relative_error(y, expected) <= TOLERANCE[dtype]
    for got, want in zip(gradients(y, [x, bias]), gradients(expected, expected_inputs), strict=True):
        assert got.dtype == dtype and relative_error(got, want) <= TOLERANCE[dtype]


# Widths: 48 and 100 fit one block (100 short of its power of two); 1064 (T-NLG's 4256 / 4) and
# 2560 span two and three blocks of COLUMN_BLOCK = 1024, the last one partly masked. More rows
# than CPU_ROW_GROUPS, so a program of the gradient-sum kernels adds up several rows.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(21, 48), (21, 100), (6, 1064), (6, 2560)])
def test_layer_norm_matches_torch(dtype, rows, width):
    assert fused_ops.COLUMN_BLOCK == 1024  # the widths above are chosen against it
    check_layer_norm(rows, width, dtype)


def test_layer_norm_statistics_survive_a_large_mean():
    """Rows around 3000 with spread 2, against fp64: E[x^2] - E[x]^2 in fp32 would lose the variance
    (about 9e6 - 9e6, ulp 1 for a variance of 4); the per-lane Welford merge keeps it to the
    rounding of x - mean (3000 * 2^-24 / 2, about 1e-4)."""
    x = (torch.randn(5, 2560, generator=torch.Generator().manual_seed(0)) * 2 + 3000).to(DEVICE)
    weight, bias = torch.ones(2560, device=DEVICE), torch.zeros(2560, device=DEVICE)
    y = fused_ops.layer_norm(x, weight, bias, 1e-5, "triton")
    expected = fused_ops.layer_norm_reference(x.double(), weight.double(), bias.double(), 1e-5)
    assert (y.double() - expected).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(15, 96), (6, 1064), (5, 2560)])
def test_bias_gelu_matches_gelu_new(dtype, rows, width):
    check_bias_gelu(rows, width, dtype)


def test_the_gelu_reference_is_transformers_gelu_new():
    from transformers.activations import ACT2FN

    x, bias = torch.randn(5, 96) * 4, torch.randn(96)
    torch.testing.assert_close(fused_ops.bias_gelu_reference(x, bias), ACT2FN["gelu_new"](x + bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [4256, 20480])  # T-NLG's and MT-NLG's hidden sizes
def test_kernels_at_model_widths_on_gpu(dtype, hidden):
    """Compiled (not interpreted) kernels at the real widths: LayerNorm at the hidden size, bias +
    GeLU at the MLP's 4 x hidden."""
    check_layer_norm(8, hidden, dtype, device="cuda")
    check_bias_gelu(8, 4 * hidden, dtype, device="cuda")


@pytest.mark.parametrize("num_items", [None, 50, torch.tensor(50)])  # a tensor: Trainer's num_items_in_batch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_the_full_one(dtype, num_items):
    """5000 classes: two vocabulary blocks for the online softmax; 37 rows in chunks of 16; ignored rows."""
    generator = torch.Generator().manual_seed(1)
    hidden, weight = leaves(
        torch.randn(37, 32, generator=generator),
        torch.randn(5000, 32, generator=generator) * 0.3,
        dtype=dtype,
    )
    targets = torch.randint(0, 5000, (37,), generator=generator)
    targets[[0, 5, 36]] = -100
    targets = targets.to(DEVICE)
    loss = fused_ops.linear_cross_entropy(hidden, weight, targets, num_items=num_items, chunk_rows=16)
    expected_inputs = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    expected = fused_ops.linear_cross_entropy_reference(*expected_inputs, targets, num_items=num_items)
    assert loss.item() == pytest.approx(expected.item(), rel=TOLERANCE[dtype] / 10)
    got = torch.autograd.grad(loss, [hidden, weight])
    want = torch.autograd.grad(expected, expected_inputs)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and relative_error(g, w) <= TOLERANCE[dtype]


def test_ignored_rows_get_no_gradient():
    hidden, weight = leaves(torch.randn(4, 8), torch.randn(30, 8))
    targets = torch.tensor([3, -100, 7, -100], device=DEVICE)
    loss = fused_ops.linear_cross_entropy(hidden, weight, targets, chunk_rows=3)
    (grad_hidden,) = torch.autograd.grad(loss, [hidden])
    assert grad_hidden[[1, 3]].abs().max() == 0 and grad_hidden[[0, 2]].abs().min() > 0


def test_model_trains_the_same_with_fused_kernels():
    torch.manual_seed(0)
    plain = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels="none")).to(DEVICE)
    fused = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels="triton")).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 512, (2, 16), device=DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    plain_out, fused_out = plain(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
    assert fused_out.loss.item() == pytest.approx(plain_out.loss.item(), rel=1e-6)
    assert fused_out.logits is None  # the chunked loss never makes them
    plain_out.loss.backward()
    fused_out.loss.backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert relative_error(b.grad, a.grad) <= 1e-5, name
    logits = fused(input_ids=ids).logits  # without labels: logits, through the fused LayerNorms and MLP
    torch.testing.assert_close(logits, plain(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_auto_uses_torch_on_cpu_and_the_choice_is_validated():
    assert not fused_ops.use_triton("auto", torch.zeros(1))
    assert not fused_ops.use_triton("none", torch.zeros(1))
    assert TNLGConfig.from_preset("debug").fused_kernels == "auto"
    with pytest.raises(ValueError, match="fused_kernels must be one of"):
        TNLGConfig.from_preset("debug", fused_kernels="apex")


def test_auto_keeps_torch_layer_norm_where_triton_runs_the_rest(monkeypatch):
    """Where `auto` picks Triton (CUDA), the model's LayerNorms still run torch's kernel, measured faster
    on an H100 ([Note: LayerNorm stays torch's]), while bias + GeLU runs the Triton one; `triton`
    forces both. Simulated on CPU: `use_triton` answers as on CUDA, and the two autograd Functions are
    replaced by spies that record the call and compute the reference."""
    monkeypatch.setattr(fused_ops, "use_triton", lambda choice, tensor: choice != "none")
    calls: list[str] = []

    def spy(name, reference):
        def apply(*args):
            calls.append(name)
            return reference(*args[: 4 if name == "layer_norm" else 2])

        return apply

    monkeypatch.setattr(fused_ops._LayerNorm, "apply", spy("layer_norm", fused_ops.layer_norm_reference))
    monkeypatch.setattr(fused_ops._BiasGelu, "apply", spy("bias_gelu", fused_ops.bias_gelu_reference))
    ids = torch.randint(0, 512, (1, 8))
    for choice, expected in (("auto", {"bias_gelu"}), ("triton", {"layer_norm", "bias_gelu"})):
        calls.clear()
        TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels=choice))(input_ids=ids)
        assert set(calls) == expected, choice


def test_fp16_gradients_survive_a_large_token_count():
    """The logit gradients stay unscaled until backward: divided by 8192 tokens in fp16 they would
    underflow to zero before the loss scale could lift them."""
    generator = torch.Generator().manual_seed(2)
    hidden, weight = leaves(
        torch.randn(64, 32, generator=generator),
        torch.randn(5000, 32, generator=generator) * 0.1,
        dtype=torch.float16,
    )
    targets = torch.randint(0, 5000, (64,), generator=generator).to(DEVICE)
    loss = fused_ops.linear_cross_entropy(hidden, weight, targets, num_items=8192)
    grad_hidden, grad_weight = torch.autograd.grad(loss * 2.0**16, [hidden, weight])  # a loss scale
    expected_inputs = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    expected = fused_ops.linear_cross_entropy_reference(*expected_inputs, targets, num_items=8192)
    want_hidden, want_weight = torch.autograd.grad(expected * 2.0**16, expected_inputs)
    assert relative_error(grad_hidden, want_hidden) <= 1e-2
    assert relative_error(grad_weight, want_weight) <= 1e-2
    assert (grad_weight.abs().sum(1) == 0).sum() == (want_weight.abs().sum(1) == 0).sum()


def test_chunked_cross_entropy_under_autocast():
    """An fp32 model under bf16 autocast (the Trainer's bf16=True): the head runs in bf16 as autocast's
    linear would, and the gradients reach the fp32 weight."""
    generator = torch.Generator().manual_seed(3)
    hidden, weight = leaves(
        torch.randn(20, 16, generator=generator), torch.randn(300, 16, generator=generator)
    )
    targets = torch.randint(0, 300, (20,), generator=generator).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = fused_ops.linear_cross_entropy(hidden, weight, targets)
        expected = fused_ops.linear_cross_entropy_reference(hidden, weight, targets)
    got = torch.autograd.grad(loss, [hidden, weight])
    want = torch.autograd.grad(expected, [hidden, weight])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-3)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and relative_error(g, w) <= 2e-2


# ---------------------------------------------------------------------------- under autocast
@pytest.fixture(params=["device", "fp32"])
def layer_norm_policy(request, monkeypatch):
    """Autocast's policy for layer_norm: the device's own ("device": on CPU the input's dtype, on CUDA
    fp32), or CUDA's fp32 one emulated on any device ("fp32": torch's layer_norm upcasting its inputs
    under autocast, as AutocastCUDA does), so that a CPU-only run checks it too. The fused LayerNorm's
    cached answers from torch (see [Note: LayerNorm under autocast]) are forgotten before and after."""
    if request.param == "fp32":
        torch_layer_norm = torch.nn.functional.layer_norm

        def fp32_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
            if not torch.is_autocast_enabled(x.device.type):
                return torch_layer_norm(x, shape, weight, bias, eps)
            upcast = [None if t is None else t.float() for t in (x, weight, bias)]
            with torch.autocast(x.device.type, enabled=False):
                return torch_layer_norm(upcast[0], shape, upcast[1], upcast[2], eps)

        monkeypatch.setattr(torch.nn.functional, "layer_norm", fp32_layer_norm)
    fused_ops._autocast_layer_norm_dtype.cache_clear()
    yield request.param
    fused_ops._autocast_layer_norm_dtype.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_under_autocast_returns_what_torch_returns(layer_norm_policy, dtype):
    """The fused LayerNorm gives the dtype and values torch's gives under autocast, forward and backward."""
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 100, generator=generator) * 2 + 1).to(DEVICE, dtype).requires_grad_()
    weight, bias = leaves(torch.randn(100, generator=generator), torch.randn(100, generator=generator))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = fused_ops.layer_norm(x, weight, bias, 1e-5, "triton")
        expected = fused_ops.layer_norm_reference(x, weight, bias, 1e-5)
    if layer_norm_policy == "fp32" or DEVICE == "cuda":
        assert expected.dtype == torch.float32  # the policy under test is the one in force
    assert y.dtype == expected.dtype and relative_error(y, expected) <= TOLERANCE[expected.dtype]
    got, want = gradients(y, [x, weight, bias]), gradients(expected, [x, weight, bias])
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and relative_error(g, w) <= TOLERANCE[dtype]


def test_model_under_autocast_gives_the_same_outputs_with_fused_kernels(layer_norm_policy):
    """A bf16 model under bf16 autocast (LayerNorm inputs in bf16): every hidden state and the logits
    have the same dtype and values with fused_kernels "triton" as with "none"."""
    torch.manual_seed(0)
    plain = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels="none")).to(DEVICE, torch.bfloat16)
    fused = TNLGForCausalLM(TNLGConfig.from_preset("debug", fused_kernels="triton")).to(
        DEVICE, torch.bfloat16
    )
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 512, (2, 16), device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), torch.no_grad():
        plain_out = plain(input_ids=ids, output_hidden_states=True)
        fused_out = fused(input_ids=ids, output_hidden_states=True)
    for got, want in zip(
        [*fused_out.hidden_states, fused_out.logits],
        [*plain_out.hidden_states, plain_out.logits],
        strict=True,
    ):
        assert got.dtype == want.dtype and relative_error(got, want) <= 2e-2


def test_bias_gelu_under_autocast_keeps_the_dtype_of_the_unfused_mlp():
    """Autocast lists no GeLU: on CPU the unfused MLP's gelu_new(fc_in(h)) stays in the autocast dtype,
    and so does the fused bias_gelu of the same product (on CUDA gelu_new's torch.pow is upcast, but
    fc_out rounds it back first: see [Note: LayerNorm under autocast])."""
    generator = torch.Generator().manual_seed(9)
    hidden, weight, bias = leaves(
        torch.randn(6, 32, generator=generator),
        torch.randn(96, 32, generator=generator),
        torch.randn(96, generator=generator),
    )
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        product = torch.nn.functional.linear(hidden, weight)
        y = fused_ops.bias_gelu(product, bias, "triton")
        unfused = ACT2FN["gelu_new"](torch.nn.functional.linear(hidden, weight, bias))
    assert y.dtype == product.dtype == torch.bfloat16
    if DEVICE == "cpu":
        assert unfused.dtype == y.dtype
    assert relative_error(y, unfused) <= 2e-2
