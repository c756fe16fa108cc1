"""CPUAdam: the C++ kernel computes torch's Adam / AdamW (to 1e-6 relative after 10 steps), writes the
16-bit copy in the same pass, keeps torch's state, and falls back to torch with one warning when the
kernel cannot be built; its thread count is this rank's share of the cores."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tnlg.sharding.kernels import CPUAdam, build, cpu_adam
from tnlg.sharding.kernels.cpu_adam import THREADS_VARIABLE, adam_threads

SIZES = (1, 7, 1023, 65_537)  # odd lengths: the vectorised loop's remainder


@pytest.fixture
def kernel_built():
    """The C++ kernel is what most tests check (the fall-back has its own test): skipped where a tool
    the build needs is missing, failed where the tools are there and the build breaks."""
    missing = build.missing_cpu_tool()
    if missing is not None:
        pytest.skip(f"the CPUAdam C++ kernel cannot be built here: {missing}")
    if not CPUAdam([torch.zeros(1)]).uses_extension:
        pytest.fail("the CPUAdam C++ kernel did not build on this machine (it has a compiler and ninja)")


@pytest.fixture
def threads(request, monkeypatch):
    monkeypatch.setenv(THREADS_VARIABLE, str(request.param))
    return request.param


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def run_both(
    numel: int, steps: int, adamw_mode: bool, amsgrad: bool, grad_dtype=torch.float32, out_dtype=None
):
    generator = torch.Generator().manual_seed(numel)
    ours = torch.randn(numel, generator=generator)
    reference = ours.clone()
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": amsgrad}
    optimizer = CPUAdam([ours], **settings, adamw_mode=adamw_mode)
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    expected = torch_class([reference], **settings, foreach=False)
    out = torch.empty(numel, dtype=out_dtype) if out_dtype else None
    for _ in range(steps):
        gradient = torch.randn(numel, generator=generator).to(grad_dtype)
        reference.grad = gradient.float()
        optimizer.step(out16=[out] if out is not None else None, grads=[gradient])
        expected.step()
    return ours, reference, out, optimizer, expected


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("kernel_built")
def test_matches_torch_after_ten_steps(threads, numel, adamw_mode, out_dtype):
    ours, reference, out, optimizer, expected = run_both(numel, 10, adamw_mode, False, out_dtype=out_dtype)
    assert relative_error(ours, reference) <= 1e-6
    for name in ("exp_avg", "exp_avg_sq"):
        assert relative_error(optimizer.state[ours][name], expected.state[reference][name]) <= 1e-6, name
    assert optimizer.state[ours]["step"].item() == 10
    if out is not None:  # the copy is the updated parameter, rounded as torch rounds
        assert torch.equal(out, ours.to(out.dtype))


@pytest.mark.parametrize("numel", [7, 65_537])
@pytest.mark.usefixtures("kernel_built")
def test_amsgrad_matches_torch(numel):
    ours, reference, _, optimizer, expected = run_both(numel, 10, True, True)
    assert relative_error(ours, reference) <= 1e-6
    assert (
        relative_error(optimizer.state[ours]["max_exp_avg_sq"], expected.state[reference]["max_exp_avg_sq"])
        <= 1e-6
    )


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.usefixtures("kernel_built")
def test_16_bit_gradients_are_read_directly(grad_dtype):
    ours, reference, *_ = run_both(1023, 10, True, False, grad_dtype=grad_dtype)
    assert relative_error(ours, reference) <= 1e-6


@pytest.mark.usefixtures("kernel_built")
def test_grad_scale_multiplies_the_gradients_as_they_are_read():
    generator = torch.Generator().manual_seed(4)
    ours = torch.randn(999, generator=generator)
    reference = ours.clone()
    optimizer, expected = CPUAdam([ours], lr=1e-2), torch.optim.AdamW([reference], lr=1e-2)
    for _ in range(5):
        gradient = torch.randn(999, generator=generator).to(torch.bfloat16) * 1024  # a loss-scaled gradient
        reference.grad = gradient.float() * (0.5 / 1024)
        optimizer.step(grads=[gradient], grad_scale=0.5 / 1024)
        expected.step()
    assert relative_error(ours, reference) <= 1e-6


@pytest.mark.usefixtures("kernel_built")
def test_param_groups_and_a_changing_learning_rate_follow_torch():
    generator = torch.Generator().manual_seed(1)
    ours = [torch.randn(33, generator=generator), torch.randn(4, 5, generator=generator)]
    reference = [p.clone() for p in ours]

    def groups(params):
        return [{"params": [params[0]], "weight_decay": 0.0}, {"params": [params[1]], "lr": 3e-3}]

    optimizer, expected = CPUAdam(groups(ours), lr=1e-2), torch.optim.AdamW(groups(reference), lr=1e-2)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (optimizer, expected)]
    for _ in range(6):
        for a, b in zip(ours, reference, strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        optimizer.step()
        expected.step()
        for schedule in schedules:
            schedule.step()
    for a, b in zip(ours, reference, strict=True):
        assert relative_error(a, b) <= 1e-6


@pytest.mark.usefixtures("kernel_built")
def test_state_dicts_move_between_cpu_adam_and_torch_adamw():
    ours, _, _, optimizer, _ = run_both(100, 3, True, False)
    continued = ours.clone()
    torch_optimizer = torch.optim.AdamW([continued], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    torch_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as if saved and loaded
    gradient = torch.randn(100)
    ours.grad, continued.grad = gradient, gradient.clone()
    assert torch_optimizer.param_groups[0]["decoupled_weight_decay"]
    optimizer.step()
    torch_optimizer.step()
    assert relative_error(ours, continued) <= 1e-6


@pytest.mark.usefixtures("kernel_built")
def test_parameters_without_gradients_and_their_copies_are_left_alone():
    with_grad, without = torch.randn(8), torch.randn(8)
    copies = [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)]
    with_grad.grad = torch.randn(8)
    before = without.clone()
    CPUAdam([with_grad, without]).step(out16={with_grad: copies[0], without: copies[1]})
    assert torch.equal(copies[0], with_grad.to(torch.bfloat16))
    assert torch.equal(without, before) and not copies[1].any()


@pytest.mark.usefixtures("kernel_built")
def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        CPUAdam([torch.zeros(3, dtype=torch.bfloat16)])
    param = torch.zeros(3)
    param.grad = torch.zeros(3)
    optimizer = CPUAdam([param])
    with pytest.raises(ValueError, match="out16 has 2 tensors for 1 parameters"):
        optimizer.step(out16=[None, None])
    with pytest.raises(ValueError, match="bf16 or fp16 CPU tensor of the parameter's shape"):
        optimizer.step(out16=[torch.zeros(3)])
    with pytest.raises(ValueError, match="bf16 or fp16 CPU tensor of the parameter's shape"):
        optimizer.step(out16=[torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="not one of this optimizer's parameters"):
        optimizer.step(out16={torch.zeros(3): torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        optimizer.step(grads=[torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="grads has 2 tensors for 1 parameters"):
        optimizer.step(grads=[None, None])
    assert optimizer.state[param] == {}  # nothing was updated by the refused steps


def test_without_the_kernel_it_warns_once_and_computes_the_same_with_torch(monkeypatch):
    build.cpu_extension.cache_clear()
    monkeypatch.setenv("CXX", "no-such-compiler")
    try:
        with pytest.warns(UserWarning, match=r"cpu_adam C\+\+ kernel is unavailable \(no C\+\+ compiler"):
            assert not CPUAdam([torch.zeros(1)]).uses_extension
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning only
            ours, reference, out, _, _ = run_both(1023, 10, True, False, out_dtype=torch.bfloat16)
        assert relative_error(ours, reference) <= 1e-6
        assert torch.equal(out, ours.to(torch.bfloat16))
    finally:
        build.cpu_extension.cache_clear()  # the next use loads the cached build again


@pytest.fixture
def sixteen_cores(monkeypatch):
    """A process allowed on 16 cores, started without a thread count or a launcher's local world size."""
    monkeypatch.setattr(cpu_adam.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize(
    ("local_world_size", "expected"), [(None, 16), ("1", 16), ("3", 5), ("8", 2), ("32", 1)]
)
def test_threads_are_this_ranks_share_of_its_cores(sixteen_cores, monkeypatch, local_world_size, expected):
    if local_world_size is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # what a launcher's OMP_NUM_THREADS=1 gives
    assert adam_threads() == expected


def test_the_thread_variable_wins_and_bad_values_are_named(sixteen_cores, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv(THREADS_VARIABLE, "6")
    assert adam_threads() == 6
    for bad in ("0", "-2", "four"):
        monkeypatch.setenv(THREADS_VARIABLE, bad)
        with pytest.raises(
            ValueError, match=f"TNLG_CPU_ADAM_THREADS must be a positive integer, got '{bad}'"
        ):
            adam_threads()
        with pytest.raises(ValueError, match="TNLG_CPU_ADAM_THREADS must be a positive integer"):
            CPUAdam([torch.zeros(1)])  # named when the optimizer is built, before any step
    monkeypatch.delenv(THREADS_VARIABLE)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "none")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive integer"):
        adam_threads()


def test_the_kernel_runs_on_the_sized_thread_count(sixteen_cores, monkeypatch):
    calls = []

    class Kernel:
        def adam_step(self, *args):
            calls.append(args[-1])

    monkeypatch.setattr(cpu_adam, "cpu_extension", lambda name: Kernel())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    param = torch.zeros(3)
    CPUAdam([param]).step(grads=[torch.ones(3)])
    assert calls == [4]
