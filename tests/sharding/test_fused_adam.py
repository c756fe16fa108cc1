"""GPU fused Adam: the plain-PyTorch reference computes torch's Adam / AdamW; the Triton kernel (run on CPU
under TRITON_INTERPRET=1, on CUDA when there is one) and the CUDA extension compute the reference's
values on fresh random inputs; the CUDA source compiles with nvcc where nvcc exists. The engine picks
and checks its kernel when it is initialized: never Triton on CPU tensors by itself, and a forced one
that cannot run there is named then.

Triton runs on CPU tensors in its interpreter: the tests that do that set TRITON_INTERPRET=1
themselves (`triton_interpreter`), so that they run on GPU machines too, where conftest.py leaves it
unset and the CUDA cases test the compiled kernel."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from tests.sharding.test_zero_equivalence import assert_states_close
from tests.support.offload_cases import fused_adam_matrix
from tests.support.zero_models import make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding import build as build_module
from tnlg.sharding.kernels.build import ToolchainMissing
from tnlg.sharding.kernels.cuda_adam import KERNEL_SOURCE, require_cuda_extension
from tnlg.sharding.kernels.fused_adam import (
    AdamHyper,
    adam_reference,
    adam_triton,
    fused_adam,
    ready_backend,
    triton_available,
)
from tnlg.tools.spawn import run_distributed

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels on CPU tensors, in Triton's interpreter (see the module's docstring)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def cuda_extension_built():
    """The CUDA extension, built; skipped (with the reason) where a tool the build needs is missing,
    failed where the tools are there and the build breaks."""
    try:
        return require_cuda_extension()
    except ToolchainMissing as missing:
        pytest.skip(str(missing))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max-norm relative error (elementwise ratios blow up where a moment is near zero)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def fresh_inputs(numel: int, grad_dtype: torch.dtype, seed: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=generator)
    grad = (torch.randn(numel, generator=generator) * 3).to(grad_dtype)
    exp_avg = torch.randn(numel, generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, generator=generator) * 0.01
    max_sq = exp_avg_sq + torch.rand(numel, generator=generator) * 0.01
    return [t.to(device) for t in (param, grad, exp_avg, exp_avg_sq, max_sq)]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("adamw", [True, False])
def test_reference_matches_torch_after_ten_steps(adamw, amsgrad):
    generator = torch.Generator().manual_seed(0)
    ours = torch.randn(1031, generator=generator)
    theirs = ours.clone()
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": amsgrad}
    torch_class = torch.optim.AdamW if adamw else torch.optim.Adam
    expected = torch_class([theirs], **settings, foreach=False)
    exp_avg, exp_avg_sq, max_sq = torch.zeros_like(ours), torch.zeros_like(ours), torch.zeros_like(ours)
    for step in range(1, 11):
        grad = torch.randn(1031, generator=generator)
        theirs.grad = grad.clone()
        expected.step()
        hyper = AdamHyper(1e-2, 0.9, 0.95, 1e-8, 0.1, step, adamw)
        adam_reference(ours, grad, exp_avg, exp_avg_sq, hyper, max_sq if amsgrad else None)
    state = expected.state[theirs]
    assert relative_error(ours, theirs) <= 1e-6
    assert relative_error(exp_avg, state["exp_avg"]) <= 1e-6
    assert relative_error(exp_avg_sq, state["exp_avg_sq"]) <= 1e-6


def _compare_with_reference(run, numel, grad_dtype, out_dtype, adamw, amsgrad, device):
    param, grad, exp_avg, exp_avg_sq, max_sq = fresh_inputs(numel, grad_dtype, seed=numel, device=device)
    hyper = AdamHyper(3e-3, 0.9, 0.999, 1e-8, 0.1, 7, adamw, grad_scale=0.25)
    ours = [t.clone() for t in (param, exp_avg, exp_avg_sq, max_sq)]
    want = [t.clone() for t in (param, exp_avg, exp_avg_sq, max_sq)]
    out = torch.full((numel,), 7.0, dtype=out_dtype, device=device) if out_dtype else None
    run(ours[0], grad, ours[1], ours[2], hyper, ours[3] if amsgrad else None, out)
    adam_reference(want[0], grad, want[1], want[2], hyper, want[3] if amsgrad else None)
    for name, got, expected in zip(
        ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), ours, want, strict=True
    ):
        assert relative_error(got, expected) <= 1e-6, name
    if out is not None:  # the copy is the updated parameter, rounded as torch rounds it
        assert torch.equal(out, ours[0].to(out_dtype))


TRITON_CASES = [
    # (numel, grad dtype, copy dtype, adamw, amsgrad): odd sizes leave a partial last block
    (1, torch.float32, None, True, False),
    (1023, torch.bfloat16, torch.bfloat16, True, False),
    (2500, torch.float16, torch.float16, False, True),
    (4097, torch.bfloat16, torch.float16, True, True),
    (3001, torch.float32, torch.bfloat16, False, False),
]


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numel, grad_dtype, out_dtype, adamw, amsgrad", TRITON_CASES)
def test_triton_kernel_matches_the_reference(
    numel, grad_dtype, out_dtype, adamw, amsgrad, device, monkeypatch
):
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _compare_with_reference(adam_triton, numel, grad_dtype, out_dtype, adamw, amsgrad, device)


@needs_triton
def test_triton_on_cpu_tensors_without_the_interpreter_is_named(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    param, grad, exp_avg, exp_avg_sq, _ = fresh_inputs(10, torch.float32, seed=2)
    before = param.clone()
    with pytest.raises(ValueError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        adam_triton(param, grad, exp_avg, exp_avg_sq, AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
    assert torch.equal(param, before)


def test_ready_backend_never_picks_triton_for_cpu_tensors(triton_interpreter):
    cpu = torch.device("cpu")
    assert ready_backend("auto", cpu) == "reference"  # even with the interpreter on
    assert ready_backend("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="CUDA fused Adam kernel needs CUDA tensors; these are on cpu"):
        ready_backend("cuda", cpu)
    with pytest.raises(ValueError, match="backend must be one of"):
        ready_backend("apex", cpu)


def test_the_engine_picks_no_fused_kernel_on_cpu_by_itself(triton_interpreter):
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(stage=1))
    assert engine.optimizer.fused_backend is None  # torch's own step: faster on CPU than any kernel here


@needs_triton
@pytest.mark.parametrize("interpret", [True, False])
def test_the_engine_checks_a_forced_triton_kernel_when_initialized(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_model()
    config = ZeroConfig(stage=1, fused_adam="triton")
    if interpret:
        assert initialize(model, make_optimizer(model), config).optimizer.fused_backend == "triton"
        return
    with pytest.raises(
        ValueError, match="Triton fused Adam kernel needs CUDA tensors, or TRITON_INTERPRET=1"
    ):
        initialize(model, make_optimizer(model), config)


def test_the_engine_refuses_the_cuda_kernel_on_cpu_when_initialized():
    model = make_model()
    with pytest.raises(ValueError, match="CUDA fused Adam kernel needs CUDA tensors"):
        initialize(model, make_optimizer(model), ZeroConfig(stage=1, fused_adam="cuda"))


def test_an_offloaded_optimizer_resolves_no_device_kernel_even_on_cuda(monkeypatch):
    """ "auto" on a CUDA device with the optimizer offloaded: the step runs CPUAdam on the host, so no
    device kernel is resolved and the CUDA extension is not built (nvcc may be absent). The device is
    made to look like CUDA to the kernel's resolution only; `ready_backend` records what it is asked."""
    asked = []
    monkeypatch.setattr(build_module, "ready_backend", lambda *args: asked.append(args) or "cuda")
    resolve = build_module._fused_adam_backend

    def on_cuda(choice, device, offloaded, optimizer):
        return resolve(choice, torch.device("cuda", 0), offloaded, optimizer)

    monkeypatch.setattr(build_module, "_fused_adam_backend", on_cuda)
    model = make_model()
    config = ZeroConfig(stage=2, offload_optimizer="cpu", fused_adam="auto")
    engine = initialize(model, make_optimizer(model), config)
    assert asked == []
    assert engine.optimizer.fused_backend is None
    assert engine.optimizer.host_adam is not None  # the offloaded step: CPUAdam


@pytest.mark.parametrize("backend", ["cuda", "triton", "reference"])
def test_a_forced_kernel_with_an_offloaded_optimizer_is_refused(triton_interpreter, backend):
    """A forced device kernel would not be applied to an offloaded step: an error, not silence, when
    the config is made (the same on every rank, before any engine work)."""
    with pytest.raises(ValueError, match=f"fused_adam='{backend}'.*offload_optimizer='cpu'"):
        ZeroConfig(stage=1, offload_optimizer="cpu", fused_adam=backend)


def test_a_forced_kernel_for_an_optimizer_it_cannot_step_is_refused():
    model = make_model()
    with pytest.raises(
        ValueError, match=r"fused_adam='reference' forces a fused Adam kernel, but SGD is not"
    ):
        initialize(model, make_optimizer(model, "sgd"), ZeroConfig(stage=1, fused_adam="reference"))


def test_fused_adam_validates_its_inputs_and_picks_the_reference_on_cpu():
    param, grad, exp_avg, exp_avg_sq, _ = fresh_inputs(10, torch.bfloat16, seed=1)
    before = param.clone()
    with pytest.raises(ValueError, match="exp_avg_sq is a \\[9\\] tensor"):
        fused_adam(param, grad, exp_avg, exp_avg_sq[:9], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out16 must be bf16 or fp16"):
        fused_adam(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, out16=torch.empty(10))
    with pytest.raises(ValueError, match="step counts from 1"):
        fused_adam(param, grad, exp_avg, exp_avg_sq, step=0, lr=1e-3)
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_adam(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, backend="apex")
    assert torch.equal(param, before)  # nothing was updated by a refused call
    assert fused_adam(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3) == "reference"
    assert not torch.equal(param, before)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_kernel_source_compiles_with_nvcc(tmp_path):
    """The kernel file is plain CUDA (no torch headers), so nvcc checks it without a GPU."""
    command = ["nvcc", "-c", str(KERNEL_SOURCE), "-o", str(tmp_path / "fused_adam_kernel.o"), "-std=c++17",
               "-O3", "-fmad=false", "-Xcompiler", "-fPIC", f"-I{KERNEL_SOURCE.parent}"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "fused_adam_kernel.o").stat().st_size > 0


@pytest.mark.gpu
def test_the_engine_builds_the_cuda_extension_when_initialized(cuda_extension_built):
    """The build (or the load of a cached one) happens in `initialize`, and "auto" then picks it."""
    model = make_model().cuda()
    engine = initialize(model, make_optimizer(model), ZeroConfig(stage=1))
    assert engine.optimizer.fused_backend == "cuda"
    assert ready_backend("auto", torch.device("cuda")) == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("numel, grad_dtype, out_dtype, adamw, amsgrad", TRITON_CASES)
def test_cuda_extension_matches_the_reference(
    numel, grad_dtype, out_dtype, adamw, amsgrad, cuda_extension_built
):
    def run(param, grad, exp_avg, exp_avg_sq, hyper, max_sq, out):
        ran = fused_adam(
            param, grad, exp_avg, exp_avg_sq, step=hyper.step, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2),
            eps=hyper.eps, weight_decay=hyper.weight_decay, adamw=hyper.adamw, grad_scale=hyper.grad_scale,
            max_exp_avg_sq=max_sq, out16=out, backend="cuda",
        )  # fmt: skip
        assert ran == "cuda"

    _compare_with_reference(run, numel, grad_dtype, out_dtype, adamw, amsgrad, "cuda")


@pytest.mark.gpu
def test_cuda_extension_updates_many_tensors_in_one_launch(cuda_extension_built):
    extension = cuda_extension_built
    sizes = (1, 65_536, 65_537, 200_000)  # chunks of 65536: whole, and split over blocks
    tensors = [fresh_inputs(n, torch.bfloat16, seed=n, device="cuda") for n in sizes]
    hyper = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1, 3, True)
    ours = [[t.clone() for t in group] for group in tensors]
    outs = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    extension.fused_adam(
        [g[0] for g in ours], [g[1] for g in ours], [g[2] for g in ours], [g[3] for g in ours], [], outs,
        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.step_size,
        hyper.bias_correction2_sqrt, True, 1.0, torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
    for group, got, out in zip(tensors, ours, outs, strict=True):
        param, grad, exp_avg, exp_avg_sq, _ = (t.clone() for t in group)
        adam_reference(param, grad, exp_avg, exp_avg_sq, hyper)
        assert relative_error(got[0], param) <= 1e-6
        assert torch.equal(out, got[0].to(torch.bfloat16))


@pytest.fixture(scope="module")
def engine_runs():
    # The ranks run on CPU with gloo, and two runs force the Triton kernel: in the interpreter, set in
    # the environment the ranks are handed, on any machine. Their fork server may have imported triton
    # without it (on a GPU machine); the fused Adam kernel is decorated on its first use, in the rank.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return run_distributed(fused_adam_matrix, 2, timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_steps_through_the_fused_kernel_like_torch(engine_runs, stage, precision):
    """The engine's fused path (state in the user's AdamW, gradient scaled as read, stages 0 and 3
    writing the 16-bit parameters directly) trains like the same engine stepping torch's AdamW."""
    fused, plain = engine_runs[(stage, precision, "reference")], engine_runs[(stage, precision, "none")]
    tolerance = 1e-6 if precision == "no" else 1e-5  # bf16: a master 1e-7 apart may round the other way
    assert fused["losses"] == pytest.approx(plain["losses"], rel=tolerance)
    assert_states_close(fused["state"], {k: v.float() for k, v in plain["state"].items()}, atol=tolerance)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("stage", [0, 3])
def test_engine_runs_the_triton_kernel(engine_runs, stage):
    triton_run, plain = engine_runs[(stage, "bf16", "triton")], engine_runs[(stage, "bf16", "none")]
    assert triton_run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert_states_close(triton_run["state"], {k: v.float() for k, v in plain["state"].items()}, atol=1e-5)


@pytest.mark.slow
def test_engine_fused_step_with_clipping_and_accumulation(engine_runs):
    fused, plain = engine_runs[(2, "no", "reference-clip")], engine_runs[(2, "no", "none-clip")]
    assert fused["norms"] == pytest.approx(plain["norms"], rel=1e-6)
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-6)
