"""Fused Adam / AdamW over flat buffers: a Triton kernel, a CUDA extension, and the plain-PyTorch reference.

One call updates a whole flat tensor (a ZeRO param group's fp32 master shard) in one pass: the
gradient is read in its own dtype (bf16, fp16 or fp32) and scaled as it is read (unscaling and
clipping), the moments are updated in fp32, and the new parameters are also written as a bf16/fp16
copy when `out16` is given, which is what the 16-bit parameters are all-gathered from.

    fused_adam(param, grad, exp_avg, exp_avg_sq, step=3, lr=1e-4, out16=bf16_copy)

`fused_adam` picks the CUDA extension on CUDA tensors (built on first use; see cuda_adam.py), the
Triton kernel where the extension cannot be built, and the reference elsewhere (never Triton on CPU
tensors); `backend=` forces one. `ready_backend` makes the same choice ahead of time for a device,
building the extension and naming a backend that cannot run there (the engine calls it when it is
initialized). The arithmetic is torch's single-tensor Adam (`torch.optim.adam._single_tensor_adam`),
in its order of operations; the kernels' results differ from torch's by float rounding (fused
multiply-adds, approximate division and square root on GPUs), which the tests bound at 1e-6:

    param *= 1 - lr * weight_decay                    (AdamW; Adam adds weight_decay * param to grad)
    exp_avg += (1 - beta1) * (grad - exp_avg)         (torch's lerp)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps        (amsgrad: the running max)
    param -= lr / (1 - beta1**step) * exp_avg / denom

Triton kernels run on CPU tensors under `TRITON_INTERPRET=1` (how the tests check them without a GPU),
and only then: Triton has no CPU backend. `triton.jit` reads the variable when it decorates, so the
kernel is decorated on first use, once for each value of the variable (a process that sets it after
a first launch gets an interpreted kernel from then on, as Triton's own kernels would be).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
from dataclasses import dataclass

import torch

from .adam_state import adam_state

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "triton", "reference")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 1024  # elements per Triton program: 4 KiB of each fp32 stream, enough to keep loads wide


@dataclass(frozen=True)
class AdamHyper:
    """One step's scalars, with the bias corrections computed in double precision as torch does."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    adamw: bool = True
    grad_scale: float = 1.0

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1 - self.beta2**self.step)


def fused_adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    max_exp_avg_sq: torch.Tensor | None = None,
    out16: torch.Tensor | None = None,
    backend: str = "auto",
) -> str:
    """Update `param`, `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`: amsgrad) in place for step `step`
    (counted from 1), writing the new values into `out16` too. Returns the backend that ran."""
    _check(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out16, step)
    hyper = AdamHyper(lr, betas[0], betas[1], eps, weight_decay, step, adamw, grad_scale)
    return _launch(backend, param, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq, out16)


def _launch(backend, param, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq, out16) -> str:
    """The checked step on `backend` (resolving "auto"); returns the backend that ran."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = _auto_backend(param.device)
    with on_device(param):
        _run(backend, param, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq, out16)
    return backend


def on_device(tensor: torch.Tensor):
    """Kernels launch on the current CUDA device: make it `tensor`'s for the launch."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _run(backend, param, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq, out16) -> None:
    if backend == "cuda":
        from .cuda_adam import require_cuda_extension

        require_cuda_extension().fused_adam(
            [param], [grad], [exp_avg], [exp_avg_sq], [max_exp_avg_sq] if max_exp_avg_sq is not None else [],
            [out16] if out16 is not None else [], hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
            hyper.weight_decay, hyper.step_size, hyper.bias_correction2_sqrt, hyper.adamw, hyper.grad_scale,
            torch.cuda.current_stream(param.device).cuda_stream,
        )  # fmt: skip
    elif backend == "triton":
        adam_triton(param, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq, out16)
    else:
        adam_reference(param, grad, exp_avg, exp_avg_sq, hyper, max_exp_avg_sq, out16)


def steps_like_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a fused Adam kernel can step `optimizer`'s param groups and state in its place: torch's
    Adam or AdamW (or a CPUAdam) with float hyperparameters and none of the options the kernels lack
    (maximize, differentiable)."""
    from .cpu_adam import CPUAdam

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, CPUAdam):
        return False
    for group in optimizer.param_groups:
        numbers = [group["lr"], group["eps"], group["weight_decay"], *group["betas"]]
        if any(isinstance(value, torch.Tensor) for value in numbers):
            return False
        if group.get("maximize") or group.get("differentiable") or "decoupled_weight_decay" not in group:
            return False
    return True


def fused_adam_group(
    param: torch.Tensor,
    grad: torch.Tensor,
    group: dict,
    state: dict,
    *,
    grad_scale: float = 1.0,
    out16: torch.Tensor | None = None,
    backend: str = "auto",
) -> str:
    """One step of a torch Adam/AdamW param group's flat tensor, with torch's state keys (see adam_state.py)."""
    adam_state(state, param, group["amsgrad"])
    step = int(state["step"].item()) + 1
    max_sq = state.get("max_exp_avg_sq")
    # checked before the step is counted, so that a refused call changes nothing
    _check(param, grad, state["exp_avg"], state["exp_avg_sq"], max_sq, out16, step)
    state["step"] += 1
    beta1, beta2 = group["betas"]
    hyper = AdamHyper(
        group["lr"],
        beta1,
        beta2,
        group["eps"],
        group["weight_decay"],
        step,
        group["decoupled_weight_decay"],
        grad_scale,
    )
    return _launch(backend, param, grad, state["exp_avg"], state["exp_avg_sq"], hyper, max_sq, out16)


def ready_backend(backend: str, device: torch.device) -> str:
    """The backend `backend` runs as on `device`'s tensors ("auto" resolved as `fused_adam` resolves
    it), checked now: the CUDA extension is built (or loaded from the build cache) here where it may
    run, and a backend that cannot run on `device` is an error naming why, before any step."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return _auto_backend(device)
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"the CUDA fused Adam kernel needs CUDA tensors; these are on {device}")
        from .cuda_adam import require_cuda_extension

        require_cuda_extension()
    elif backend == "triton":
        _check_triton(device)
    return backend


def _check_triton(device: torch.device) -> None:
    if not triton_available():
        raise RuntimeError("Triton is not installed (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the Triton fused Adam kernel needs CUDA tensors, or TRITON_INTERPRET=1 to run in Triton's "
            f"interpreter (a test setting); these are on {device}"
        )


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (on CPU tensors too): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _auto_backend(device: torch.device) -> str:
    if device.type != "cuda":
        return "reference"
    from .cuda_adam import cuda_extension

    if cuda_extension() is not None:
        return "cuda"
    return "triton" if triton_available() else "reference"


def _check(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out16, step) -> None:
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"param must be a contiguous fp32 tensor, got {param.dtype}")
    if grad.dtype not in GRAD_DTYPES:
        raise ValueError(f"grad must be fp32, bf16 or fp16, got {grad.dtype}")
    named = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        named["max_exp_avg_sq"] = max_exp_avg_sq
    if out16 is not None:
        if out16.dtype not in OUT_DTYPES:
            raise ValueError(f"out16 must be bf16 or fp16, got {out16.dtype}")
        named["out16"] = out16
    for name, tensor in named.items():
        if tensor.shape != param.shape or tensor.device != param.device or not tensor.is_contiguous():
            raise ValueError(
                f"{name} is a {list(tensor.shape)} tensor on {tensor.device}: it must be contiguous, on "
                f"{param.device}, of the parameter's shape {list(param.shape)}"
            )
        if name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") and tensor.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32, got {tensor.dtype}")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"step counts from 1, got {step!r}")


# ---------------------------------------------------------------------------- reference
@torch.no_grad()
def adam_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyper,
    max_exp_avg_sq: torch.Tensor | None = None,
    out16: torch.Tensor | None = None,
) -> None:
    """Plain PyTorch, in torch's single-tensor Adam order of operations."""
    g = grad.float() * hyper.grad_scale if hyper.grad_scale != 1.0 or grad.dtype != torch.float32 else grad
    if hyper.adamw:
        param.mul_(1 - hyper.lr * hyper.weight_decay)
    elif hyper.weight_decay != 0:
        g = g.add(param, alpha=hyper.weight_decay)
    exp_avg.lerp_(g, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    denom = (second.sqrt() / hyper.bias_correction2_sqrt).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-hyper.step_size)
    if out16 is not None:
        out16.copy_(param)


# ---------------------------------------------------------------------------- Triton
@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_kernel(interpret: bool):
    """Defined on first use, once per `interpreting()` value (the key of the cache): `triton.jit`
    reads TRITON_INTERPRET when it decorates."""
    import triton
    import triton.language as tl

    @triton.jit
    def adam_kernel(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_sq_ptr, out_ptr, n,
        decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt,
        grad_scale,
        ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, WRITE_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(param_ptr + offsets, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * grad_scale
        m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
        # Every constant arrives rounded once from double (1 - beta2 computed in fp32 would be off).
        if ADAMW:
            p = p * decay
        else:
            g = g + weight_decay * p
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
        if AMSGRAD:
            v = tl.maximum(tl.load(max_sq_ptr + offsets, mask=mask, other=0.0), v)
            tl.store(max_sq_ptr + offsets, v, mask=mask)
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(param_ptr + offsets, p, mask=mask)
        if WRITE_OUT:
            if OUT_BF16:
                # Round to nearest even in integer arithmetic, as torch does (Triton's interpreter
                # would truncate a plain .to(bfloat16)); NaN stays a quiet NaN.
                bits = p.to(tl.uint32, bitcast=True)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                rounded = tl.where(p != p, 0x7FC0, rounded).to(tl.uint16)
                tl.store(out_ptr + offsets, rounded.to(tl.bfloat16, bitcast=True), mask=mask)
            else:
                tl.store(out_ptr + offsets, p.to(out_ptr.dtype.element_ty), mask=mask)

    return adam_kernel


def adam_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamHyper,
    max_exp_avg_sq: torch.Tensor | None = None,
    out16: torch.Tensor | None = None,
    block: int = BLOCK,
) -> None:
    """One launch over the whole flat tensor (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    _check_triton(param.device)
    n = param.numel()
    if n == 0:
        return
    kernel = _triton_kernel(interpreting())
    grid = ((n + block - 1) // block,)
    kernel[grid](
        param, grad, exp_avg, exp_avg_sq,
        max_exp_avg_sq if max_exp_avg_sq is not None else param, out16 if out16 is not None else param, n,
        1 - hyper.lr * hyper.weight_decay, hyper.weight_decay, 1 - hyper.beta1, hyper.beta2, 1 - hyper.beta2,
        hyper.eps, hyper.step_size, hyper.bias_correction2_sqrt, hyper.grad_scale,
        ADAMW=hyper.adamw, AMSGRAD=max_exp_avg_sq is not None, WRITE_OUT=out16 is not None,
        OUT_BF16=out16 is not None and out16.dtype == torch.bfloat16, BLOCK=block,
    )  # fmt: skip
