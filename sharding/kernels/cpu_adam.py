"""`CPUAdam`: Adam / AdamW for fp32 parameters in CPU memory, writing their 16-bit copies in the same pass.

    optimizer = CPUAdam(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)   # AdamW
    optimizer.step(out16=[bf16_copy_of_each_param])   # what ZeRO-Offload sends back to the device

The arithmetic and the state (`step`, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`) are
`torch.optim.AdamW`'s (or `Adam`'s with `adamw_mode=False`), so state dicts move between them.
The work is the C++ kernel in csrc/cpu_adam.cpp on `adam_threads()` threads; where it cannot be
built, torch's fused CPU Adam runs instead, followed by a copy into `out16` (one warning says so).

[Note: CPUAdam threads]
Not `torch.get_num_threads()`: torchrun and accelerate set OMP_NUM_THREADS=1 in every process they
launch, so on an 8-GPU node torch's pool is one thread per rank while the host step of a large
offloaded shard is memory-bound work for many cores. Each rank takes its share of the cores it may
run on instead: len(os.sched_getaffinity(0)) // LOCAL_WORLD_SIZE (the ranks of one node), at least
one. TNLG_CPU_ADAM_THREADS, a positive integer, sets the count instead (e.g. where the launcher
already binds each rank to cores of its own, numactl or srun --cpu-bind, and the share would
divide them again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.adam import adam as torch_adam

from .adam_state import adam_state
from .build import cpu_extension

OUT_DTYPES = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
THREADS_VARIABLE = "TNLG_CPU_ADAM_THREADS"


def adam_threads() -> int:
    """The kernel's threads for this process (see [Note: CPUAdam threads])."""
    given = os.environ.get(THREADS_VARIABLE, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{THREADS_VARIABLE} must be a positive integer, got {given!r}")
        return int(given)
    local_ranks = os.environ.get("LOCAL_WORLD_SIZE", "1").strip() or "1"
    if not local_ranks.isdigit() or int(local_ranks) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {local_ranks!r}")
    return max(1, _usable_cores() // int(local_ranks))


def _usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or a launcher's limit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # macOS and Windows have no affinity call


class CPUAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        adamw_mode: bool = True,
    ):
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid epsilon: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "decoupled_weight_decay": adamw_mode,
            # torch.optim.Adam's other group keys, so that state dicts load into it unchanged
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.device.type != "cpu" or param.dtype != torch.float32:
                    raise ValueError(
                        f"CPUAdam updates fp32 CPU tensors; got a {param.dtype} tensor on {param.device}"
                    )
        # Sized once: a bad thread setting is named here rather than at the first step.
        self.threads = adam_threads()

    @property
    def uses_extension(self) -> bool:
        """Whether steps run the C++ kernel (False: torch's fused Adam plus a copy)."""
        return cpu_extension("cpu_adam") is not None

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        out16: Sequence[torch.Tensor | None] | Mapping[torch.Tensor, torch.Tensor] | None = None,
        grads: Sequence[torch.Tensor | None] | None = None,
        grad_scale: float = 1.0,
    ) -> float | None:
        """One step of every parameter with a gradient. `out16` gives a bf16 or fp16 tensor per
        parameter (a sequence in param-group order, or a mapping from the parameter) that receives
        its updated value; parameters without a gradient are left alone, and so is their copy.
        `grads` (in param-group order) replaces `param.grad`: a bf16 or fp16 gradient is read as it
        is, with no fp32 copy (torch refuses to store one in an fp32 parameter's `.grad`).
        `grad_scale` multiplies every gradient as it is read: loss-scale unscaling and norm clipping
        at no extra pass over the gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        targets = self._by_param(out16, "out16")
        given = self._by_param(grads, "grads")
        kernel = cpu_extension("cpu_adam")
        for group in self.param_groups:
            if group["maximize"]:
                raise ValueError("CPUAdam does not implement maximize=True")
            for param in group["params"]:
                grad = given.get(param) if grads is not None else param.grad
                if grad is None:
                    continue
                _check_gradient(param, grad)
                out = targets.get(param)
                state = adam_state(self.state[param], param, group["amsgrad"])
                _update(kernel, self.threads, group, param, grad, state, out, grad_scale)
        return loss

    def _by_param(self, tensors, what: str) -> dict[torch.Tensor, torch.Tensor]:
        """`out16` / `grads` as {parameter: tensor}, checked before anything is updated."""
        if tensors is None:
            return {}
        params = [p for group in self.param_groups for p in group["params"]]
        if isinstance(tensors, Mapping):
            pairs = list(tensors.items())
        else:
            if len(tensors) != len(params):
                raise ValueError(f"{what} has {len(tensors)} tensors for {len(params)} parameters")
            pairs = [(p, t) for p, t in zip(params, tensors, strict=True) if t is not None]
        known = {id(p) for p in params}
        for param, tensor in pairs:
            if id(param) not in known:
                raise ValueError(f"{what} names a tensor that is not one of this optimizer's parameters")
            if what == "out16":
                self._check_out(param, tensor)
        return dict(pairs)

    @staticmethod
    def _check_out(param: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype not in OUT_DTYPES or out.device.type != "cpu" or out.shape != param.shape:
            raise ValueError(
                f"out16 for a {list(param.shape)} parameter is a {out.dtype} {list(out.shape)} tensor on "
                f"{out.device}: it must be a bf16 or fp16 CPU tensor of the parameter's shape"
            )
        if not out.is_contiguous():
            raise ValueError("out16 tensors must be contiguous")


def _check_gradient(param: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.is_sparse:
        raise RuntimeError("CPUAdam does not support sparse gradients")
    if grad.dtype not in GRAD_DTYPES or grad.device.type != "cpu" or grad.shape != param.shape:
        raise ValueError(
            f"gradient of a {list(param.shape)} parameter is a {grad.dtype} {list(grad.shape)} tensor "
            f"on {grad.device}: it must be on the CPU, the parameter's shape, fp32, bf16 or fp16"
        )


def _update(
    kernel: Any,
    threads: int,
    group: dict[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    out: torch.Tensor | None,
    grad_scale: float,
) -> None:
    """One parameter's step: in the C++ kernel when it is built (the step is counted here; the kernel
    writes `out` itself), else torch's fused Adam on an fp32 gradient, then a copy to `out`."""
    beta1, beta2 = group["betas"]
    if kernel is not None:
        state["step"] += 1
        empty = torch.empty(0)
        kernel.adam_step(
            param, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"],
            state.get("max_exp_avg_sq", empty), out if out is not None else empty,
            group["lr"], beta1, beta2, group["eps"], group["weight_decay"], int(state["step"].item()),
            group["decoupled_weight_decay"], group["amsgrad"], grad_scale, threads,
        )  # fmt: skip
        return
    torch_adam(  # counts the step itself
        [param], [grad.to(torch.float32) * grad_scale], [state["exp_avg"]], [state["exp_avg_sq"]],
        [state["max_exp_avg_sq"]] if group["amsgrad"] else [], [state["step"]],
        fused=True, decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=False,
    )  # fmt: skip
    if out is not None:
        out.copy_(param)
