"""Fused model kernels in Triton, each next to the plain-PyTorch reference it must equal.

- `layer_norm`: one program per row walking it in column blocks of at most COLUMN_BLOCK lanes
  (registers do not grow with the width), statistics in fp32, output in the input's dtype, or under
  autocast in the dtype torch's `F.layer_norm` returns there (see [Note: LayerNorm under autocast]);
  backward computes the input gradient per row, and the weight / bias gradients as column sums in
  fp32 registers over groups of rows, whose few partial rows torch adds up.
- `bias_gelu`: GeLU (tanh approximation, `gelu_new`) of `x + bias` in one elementwise pass, keeping
  only `x` for backward (as the unfused pair keeps the linear's output); backward writes dx in its
  dtype and sums the bias gradient the same way (no fp32 copy of dx). Output in x's dtype, also
  under autocast (see the Note).
- `linear_cross_entropy`: the LM head and its loss over row chunks. A chunk's logits (chunk x vocab,
  in the compute dtype) are made, a Triton kernel turns each row into its loss and, in place, its
  logit gradient (online softmax over vocabulary blocks), and the chunk's input and weight gradients
  follow by two matmuls. The full (tokens x vocab) logits, let alone in fp32, never exist: at
  Ψ-scale vocabularies that tensor is often the largest of the step. Without autograd (no_grad,
  inference_mode, or no input requiring grad, as in evaluation) only the losses are computed.

`TNLGConfig.fused_kernels` selects them: `auto` (Triton on CUDA tensors when Triton is installed,
the references elsewhere, so off on CPU; the model keeps torch's LayerNorm under `auto`, see
[Note: LayerNorm stays torch's] in modeling_tnlg.py), `triton` (always; CPU tensors need
TRITON_INTERPRET=1, which is how the tests run them) or `none`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math

import torch
import torch.nn.functional as F

from .configuration_tnlg import FUSED_CHOICES

__all__ = [
    "FUSED_CHOICES",
    "bias_gelu",
    "layer_norm",
    "linear_cross_entropy",
    "use_block_kernel",
    "use_triton",
]

CROSS_ENTROPY_CHUNK_ROWS = 4096  # rows of logits alive at once in linear_cross_entropy
GELU_SCALE = math.sqrt(2.0 / math.pi)


# Looked up once, at import: a constant is all Dynamo reads when a kernel choice is traced. Calling
# `importlib.util.find_spec` there (as a cached function did) is a graph break on torch 2.11: on an H100
# each compiled block broke at its kernel choices.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return TRITON_INSTALLED


def use_triton(choice: str, tensor: torch.Tensor) -> bool:
    """Whether `TNLGConfig.fused_kernels` = `choice` runs the Triton kernels on `tensor`."""
    if choice == "none":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError(
                "TNLGConfig.fused_kernels='triton' needs Triton installed (pip install triton)"
            )
        return True
    return tensor.is_cuda and triton_available()


def use_block_kernel(choice: str, tensor: torch.Tensor) -> bool:
    """`use_triton` for the kernels inside a decoder block (LayerNorm, bias + GeLU), and never in code
    torch.compile traces: there inductor generates and fuses the same elementwise and normalization
    kernels from torch's ops, while ours (launched from autograd Functions) would be opaque calls it
    cannot fuse across. The output layer's chunked cross-entropy keeps `use_triton`: under the engine's
    compiled blocks it runs eager, and it never builds the (B, T, V) logits. Compiling is asked first,
    so that traced code reads nothing of `use_triton`'s."""
    return not torch.compiler.is_compiling() and use_triton(choice, tensor)


# ---------------------------------------------------------------------------- references
def layer_norm_reference(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`gelu_new` of x + bias, as Transformers' ACT2FN["gelu_new"] computes it."""
    z = x + bias
    return 0.5 * z * (1.0 + torch.tanh(GELU_SCALE * (z + 0.044715 * torch.pow(z, 3.0))))


def linear_cross_entropy_reference(hidden, weight, targets, ignore_index=-100, num_items=None):
    """Mean (or sum / `num_items`) cross-entropy of `hidden @ weight.T`, logits upcast to fp32."""
    logits = (hidden @ weight.T).float()
    if num_items is None:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum") / num_items


# ---------------------------------------------------------------------------- Triton kernels
# Each op's kernels are defined inside a function, on first use: `triton.jit` reads TRITON_INTERPRET
# when it decorates, and Triton is optional (`import tnlg` works without it). One function per op.
@functools.cache
def _layer_norm_kernels() -> dict:
    import triton
    import triton.language as tl

    # The row kernels walk a row in NUM_BLOCKS column blocks of BLOCK lanes (at most COLUMN_BLOCK), so
    # the registers a program holds do not grow with the width: one power-of-two block for the row
    # would be 32768 lanes at MT-NLG's 20480 (spilling) and 8192 at T-NLG's 4256 (48% masked).
    # [Note: compile-time loop counts] Every loop here counts to a constexpr, never to a runtime
    # argument: Triton 3.6's interpreter (CPU tests) converts a runtime loop bound with int() on a
    # one-element array, which NumPy >= 2.4 refuses. The counts are few per model (the width is fixed,
    # the rows per group a power of two), so few kernels are compiled.
    @triton.jit
    def layer_norm_forward(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        mean_ptr,
        rstd_ptr,
        n_cols,
        eps,
        BLOCK: tl.constexpr,
        NUM_BLOCKS: tl.constexpr,
    ):
        """Statistics in one read of the row (Welford per lane, the lanes merged with Chan et al.'s
        formula: no E[x^2] - E[x]^2 cancellation), then a second read normalizes."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * n_cols
        count = tl.zeros([BLOCK], tl.float32)
        lane_mean = tl.zeros([BLOCK], tl.float32)
        lane_m2 = tl.zeros([BLOCK], tl.float32)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            count += tl.where(mask, 1.0, 0.0)
            delta = tl.where(mask, x - lane_mean, 0.0)
            lane_mean += delta / tl.maximum(count, 1.0)
            lane_m2 += delta * (x - lane_mean)  # 0 where masked: delta is
        mean = tl.sum(lane_mean * count, axis=0) / n_cols
        spread = lane_mean - mean
        var = (tl.sum(lane_m2, axis=0) + tl.sum(count * spread * spread, axis=0)) / n_cols
        rstd = 1.0 / tl.sqrt(var + eps)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * w + b
            tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def layer_norm_backward_dx(
        dy_ptr,
        x_ptr,
        w_ptr,
        mean_ptr,
        rstd_ptr,
        dx_ptr,
        n_cols,
        BLOCK: tl.constexpr,
        NUM_BLOCKS: tl.constexpr,
    ):
        """One row: its two sums (xhat * w * dy, w * dy) over the blocks, then dx block by block."""
        row = tl.program_id(0).to(tl.int64)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        sum_xhat_wdy = tl.zeros([BLOCK], tl.float32)
        sum_wdy = tl.zeros([BLOCK], tl.float32)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            wdy = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * dy  # 0 where masked
            sum_xhat_wdy += (x - mean) * rstd * wdy
            sum_wdy += wdy
        c1 = tl.sum(sum_xhat_wdy, axis=0) / n_cols
        c2 = tl.sum(sum_wdy, axis=0) / n_cols
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dx = (w * dy - ((x - mean) * rstd * c1 + c2)) * rstd
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)

    # The weight and bias gradients are column sums over all rows, so they get their own kernel
    # (as Apex's and Megatron's CUDA LayerNorms do): folding them into the row kernel would need a
    # per-program partial row read and rewritten for every row (a load after a store of the same
    # address across loop iterations, which Triton's software pipelining may reorder).
    @triton.jit
    def layer_norm_backward_dwdb(
        dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, n_rows, n_cols, BLOCK: tl.constexpr,
        ROWS_PER_GROUP: tl.constexpr,
    ):  # fmt: skip
        """Column block program_id(1), the ROWS_PER_GROUP rows of group g = program_id(0): dy * xhat and
        dy summed in fp32 registers, stored to row g of the (G, n_cols) fp32 partials."""
        group = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dw = tl.zeros([BLOCK], tl.float32)
        db = tl.zeros([BLOCK], tl.float32)
        for index in range(ROWS_PER_GROUP):
            row = group.to(tl.int64) * ROWS_PER_GROUP + index  # rows x cols can pass 2^31
            in_rows = row < n_rows  # the last group's rows may run past the end
            # Every lane masked past the end. Not `mask & in_rows`: Triton 3.9's interpreter gives
            # that int32 data, which its masked load refuses.
            row_mask = cols < tl.where(in_rows, n_cols, 0)
            offsets = row * n_cols + cols
            x = tl.load(x_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row, mask=in_rows, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)
            dw += (x - mean) * rstd * dy  # 0 where masked
            db += dy
        tl.store(dw_ptr + group.to(tl.int64) * n_cols + cols, dw, mask=mask)
        tl.store(db_ptr + group.to(tl.int64) * n_cols + cols, db, mask=mask)

    return {"forward": layer_norm_forward, "dx": layer_norm_backward_dx, "dwdb": layer_norm_backward_dwdb}


@functools.cache
def _bias_gelu_kernels() -> dict:
    import triton
    import triton.language as tl

    # tanh(u) is written as 1 - 2 / (exp(2u) + 1) below, with 2u clamped to [-40, 40] where tanh is
    # +-1 in fp32 (no overflow); a jit helper defined in this closure would not resolve in a kernel.
    @triton.jit
    def bias_gelu_forward(x_ptr, b_ptr, y_ptr, n, n_cols, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        z = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        z += tl.load(b_ptr + offsets % n_cols, mask=mask, other=0.0).to(tl.float32)
        u2 = tl.minimum(tl.maximum(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z), -40.0), 40.0)
        t = 1.0 - 2.0 / (tl.exp(u2) + 1.0)
        tl.store(y_ptr + offsets, (0.5 * z * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def bias_gelu_backward(
        dy_ptr,
        x_ptr,
        b_ptr,
        dx_ptr,
        db_ptr,
        n_rows,
        n_cols,
        BLOCK: tl.constexpr,
        ROWS_PER_GROUP: tl.constexpr,
    ):
        """Column block program_id(1), the ROWS_PER_GROUP rows of group g = program_id(0): dx stored in
        its dtype row by row, and the bias gradient of those rows summed in fp32 registers into row
        g of the (G, n_cols) fp32 partials. No fp32 tensor of dx's size is ever made."""
        group = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        bias = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dbias = tl.zeros([BLOCK], tl.float32)
        for index in range(ROWS_PER_GROUP):  # [Note: compile-time loop counts]
            row = group.to(tl.int64) * ROWS_PER_GROUP + index
            row_mask = cols < tl.where(row < n_rows, n_cols, 0)  # as in layer_norm_backward_dwdb
            offsets = row * n_cols + cols
            z = tl.load(x_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32) + bias
            dy = tl.load(dy_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
            u2 = tl.minimum(tl.maximum(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z), -40.0), 40.0)
            t = 1.0 - 2.0 / (tl.exp(u2) + 1.0)
            slope = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 3.0 * 0.044715 * z * z
            )
            dx = dy * slope  # 0 where masked: dy is
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
            dbias += dx
        tl.store(db_ptr + group.to(tl.int64) * n_cols + cols, dbias, mask=mask)

    return {"forward": bias_gelu_forward, "backward": bias_gelu_backward}


@functools.cache
def _cross_entropy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cross_entropy_rows(
        logits_ptr,
        targets_ptr,
        loss_ptr,
        n_cols,
        ignore_index,
        BLOCK: tl.constexpr,
        NUM_BLOCKS: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
    ):
        """Per row: loss = logsumexp - target logit; with WRITE_GRAD the logits become softmax - onehot
        (0 if ignored), without it (evaluation) the second pass over the row is skipped."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * n_cols
        target = tl.load(targets_ptr + row)
        ignored = target == ignore_index
        running_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        for block in range(NUM_BLOCKS):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        safe_target = tl.where(ignored, 0, target)
        target_logit = tl.load(base + safe_target).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target_logit))
        if WRITE_GRAD:
            row_scale = tl.where(ignored, 0.0, 1.0)
            for block in range(NUM_BLOCKS):
                cols = block * BLOCK + tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                grad = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
                tl.store(base + cols, (grad * row_scale).to(logits_ptr.dtype.element_ty), mask=mask)

    return cross_entropy_rows


def _row_block(n_cols: int) -> int:
    return 1 << max(0, (n_cols - 1).bit_length())


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


COLUMN_BLOCK = 1024  # lanes per block of a row for LayerNorm and bias + GeLU: 4256 is 5 blocks
CPU_ROW_GROUPS = 4  # the interpreter runs programs one by one; a few still give one several rows


def _column_block(n_cols: int) -> int:
    return min(_row_block(n_cols), COLUMN_BLOCK)


def _row_groups(rows: int, column_blocks: int, device: torch.device) -> tuple[int, int]:
    """(groups, rows per group) along the rows (per column block) for the kernels that sum weight / bias
    gradients over rows: about four programs per SM in all. Each stores one row of fp32 partial sums,
    so the partials are (groups, width), not the (tokens, width) fp32 product a torch sum would make.
    The rows per group are a power of two ([Note: compile-time loop counts]): batch shapes that differ
    compile a few kernels, not one each; the groups then number between half the target and it."""
    if device.type != "cuda":
        target = max(1, min(rows, CPU_ROW_GROUPS))
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        target = max(1, min(rows, 4 * sms // column_blocks))
    per_group = _row_block(-(-rows // target))
    return -(-rows // per_group), per_group


# ---------------------------------------------------------------------------- LayerNorm
class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, cols = x2.shape
        y = torch.empty_like(x2, dtype=out_dtype)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = _column_block(cols)
        if rows:
            _layer_norm_kernels()["forward"][(rows,)](
                x2, weight, bias, y, mean, rstd, cols, eps,
                BLOCK=block, NUM_BLOCKS=-(-cols // block), num_warps=_warps(block),
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape = shape
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols).contiguous()
        dx = torch.empty_like(x2)
        block = _column_block(cols)
        column_blocks = (cols + block - 1) // block
        groups, per_group = _row_groups(rows, column_blocks, x2.device) if rows else (0, 0)
        partial_dw = torch.empty(groups, cols, dtype=torch.float32, device=x2.device)  # all written
        partial_db = torch.empty(groups, cols, dtype=torch.float32, device=x2.device)
        if rows:
            kernels, warps = _layer_norm_kernels(), _warps(block)
            kernels["dx"][(rows,)](
                dy2, x2, weight, mean, rstd, dx, cols, BLOCK=block, NUM_BLOCKS=column_blocks, num_warps=warps
            )
            kernels["dwdb"][(groups, column_blocks)](
                dy2, x2, mean, rstd, partial_dw, partial_db, rows, cols,
                BLOCK=block, ROWS_PER_GROUP=per_group, num_warps=warps,
            )  # fmt: skip
        dweight = partial_dw.sum(0).to(weight.dtype)
        dbias = partial_db.sum(0).to(weight.dtype)
        return dx.reshape(ctx.shape), dweight, dbias, None, None


# [Note: LayerNorm under autocast]
# Autocast runs some ops in fp32 whatever their inputs, and which ones depends on the device type:
# CUDA's list has layer_norm (ATen/autocast_mode.h, AT_FORALL_FP32: a bf16 input gives an fp32
# output), CPU's does not (torch 2.x keeps the input's dtype). A custom autograd Function is not cast
# by autocast, so the fused LayerNorm asks torch instead: it runs `F.layer_norm` on empty inputs of
# the same dtypes and device type, under the caller's autocast, once per combination, and writes its
# output in that dtype. The kernel computes in fp32 either way, so fused and unfused agree in dtype
# and values. bias_gelu keeps x's dtype: autocast does not list gelu, and though transformers' gelu_new
# calls torch.pow (on CUDA's fp32 list, so unfused it returns fp32 there), its one consumer, fc_out's
# linear under autocast, rounds it to the autocast dtype first, as the kernel's store does.
def _layer_norm_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.dtype:
    """The dtype `F.layer_norm` returns for these inputs (see [Note: LayerNorm under autocast])."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x.dtype
    return _autocast_layer_norm_dtype(
        device_type, x.dtype, weight.dtype, bias.dtype, torch.get_autocast_dtype(device_type)
    )


@functools.cache
def _autocast_layer_norm_dtype(device_type, x_dtype, weight_dtype, bias_dtype, autocast_dtype) -> torch.dtype:
    """Asked of torch under the caller's autocast (`autocast_dtype` keys the cache only)."""
    try:
        return F.layer_norm(
            torch.empty(0, 1, dtype=x_dtype, device=device_type),
            (1,),
            torch.empty(1, dtype=weight_dtype, device=device_type),
            torch.empty(1, dtype=bias_dtype, device=device_type),
        ).dtype
    except RuntimeError:  # dtypes torch's kernel does not mix (the Triton one does): the input's
        return x_dtype


def layer_norm(x, weight, bias, eps, choice: str = "triton"):
    """LayerNorm over the last dimension (Triton when `use_block_kernel(choice, x)`, else torch's)."""
    if not use_block_kernel(choice, x):
        return layer_norm_reference(x, weight, bias, eps)
    with _on_device(x):
        return _LayerNorm.apply(x, weight, bias, eps, _layer_norm_dtype(x, weight, bias))


# ---------------------------------------------------------------------------- bias + GeLU
ELEMENTWISE_BLOCK = 1024


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        if n:
            grid = ((n + ELEMENTWISE_BLOCK - 1) // ELEMENTWISE_BLOCK,)
            _bias_gelu_kernels()["forward"][grid](x, bias, y, n, x.shape[-1], BLOCK=ELEMENTWISE_BLOCK)
        ctx.save_for_backward(x, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        cols = x.shape[-1]
        rows = x.numel() // cols if cols else 0
        block = _column_block(cols)
        column_blocks = (cols + block - 1) // block
        groups, per_group = _row_groups(rows, column_blocks, x.device) if rows else (0, 0)
        partial_dbias = torch.empty(groups, cols, dtype=torch.float32, device=x.device)  # all written
        if rows:
            _bias_gelu_kernels()["backward"][(groups, column_blocks)](
                dy, x, bias, dx, partial_dbias, rows, cols,
                BLOCK=block, ROWS_PER_GROUP=per_group, num_warps=_warps(block),
            )  # fmt: skip
        return dx, partial_dbias.sum(0).to(bias.dtype)


def bias_gelu(x, bias, choice: str = "triton"):
    """`gelu_new(x + bias)` in one pass (Triton when `use_block_kernel(choice, x)`)."""
    if not use_block_kernel(choice, x):
        return bias_gelu_reference(x, bias)
    with _on_device(x):
        return _BiasGelu.apply(x, bias)


# ---------------------------------------------------------------------------- LM head + cross-entropy
def _chunk_losses(logits, targets, losses, ignore_index: int, write_grad: bool) -> None:
    """One chunk's row losses into `losses`; with `write_grad` its logits (C, V) are replaced in place
    by their unscaled gradient softmax - onehot."""
    rows, vocab = logits.shape
    block = min(_row_block(vocab), 4096)
    if rows:
        _cross_entropy_kernel()[(rows,)](
            logits, targets, losses, vocab, ignore_index,
            BLOCK=block, NUM_BLOCKS=(vocab + block - 1) // block, WRITE_GRAD=write_grad,
            num_warps=_warps(block),
        )  # fmt: skip


def _add_weight_gradient(grad_weight, logit_grad, chunk, block_rows: int) -> None:
    """`grad_weight (V, H) fp32 += logit_grad.T (V, C) @ chunk (C, H)` with no (V, H) temporary.

    fp32 operands accumulate in place (addmm_). 16-bit ones multiply in their dtype (tensor cores)
    one block of `block_rows` vocabulary rows at a time, so the product waiting to be added in fp32
    is (block_rows, H): a whole (V, H) product would be 2 GB at MT-NLG's 50304 x 20480.
    """
    if logit_grad.dtype == torch.float32:
        grad_weight.addmm_(logit_grad.T, chunk)
        return
    for start in range(0, grad_weight.shape[0], block_rows):
        end = min(start + block_rows, grad_weight.shape[0])
        grad_weight[start:end].add_(logit_grad[:, start:end].T @ chunk)


def _scaled(grad: torch.Tensor | None, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The fp32 accumulator times `scale`, in place (nothing reads it after backward), cast once to
    the input's dtype (an fp32 input gets the accumulator itself): no second fp32 copy exists."""
    return None if grad is None else grad.mul_(scale).to(dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and the unscaled gradients computed chunk by chunk in forward; backward scales them.

    The logit gradients (softmax - onehot) are kept unscaled in 16 bits: multiplied by 1/tokens
    there, most of them would underflow fp16 before the loss scale (which only backward knows) could
    lift them. The input and weight gradients accumulate in fp32 across chunks, only for the inputs
    that need one, and are scaled in place and rounded once in backward: at most one N x H and one
    V x H fp32 buffer, far less than the N x V logits. They are saved with save_for_backward, so a
    second backward through a retained graph (which would scale them twice) is an autograd error.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, count, chunk_rows):
        rows = hidden.shape[0]
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        fp32 = {"dtype": torch.float32, "device": hidden.device}
        grad_hidden = torch.empty(hidden.shape, **fp32) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, **fp32) if want_weight else None
        losses = torch.empty(rows, **fp32)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            chunk = hidden[start:end]
            logits = chunk @ weight.T  # (C, V) in the compute dtype; becomes its own gradient below
            _chunk_losses(logits, targets[start:end], losses[start:end], ignore_index, write_grad=True)
            if grad_hidden is not None:
                grad_hidden[start:end] = logits @ weight  # (C, H)
            if grad_weight is not None:
                _add_weight_gradient(grad_weight, logits, chunk, chunk_rows)
            del logits  # before the next chunk's are made: one (C, V) block alive, not two
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss.float() / count
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            _scaled(grad_hidden, scale, hidden_dtype),
            _scaled(grad_weight, scale, weight_dtype),
            *[None] * 4,
        )


def _losses_only(hidden, weight, targets, ignore_index: int, count, chunk_rows: int) -> torch.Tensor:
    """The loss alone, chunk by chunk (evaluation): no gradient buffer, no gradient matmul, and the
    kernel skips its second pass over each row."""
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_rows):
        end = min(start + chunk_rows, hidden.shape[0])
        logits = hidden[start:end] @ weight.T  # (C, V)
        _chunk_losses(logits, targets[start:end], losses[start:end], ignore_index, write_grad=False)
        del logits  # before the next chunk's are made
    return losses.sum() / count


def _divisor(targets: torch.Tensor, ignore_index: int, num_items, device: torch.device) -> torch.Tensor:
    """The loss's divisor, kept on the device (no host sync): the tokens with a target, or num_items."""
    if num_items is None:
        return (targets != ignore_index).sum().clamp_min(1).float()
    if isinstance(num_items, torch.Tensor):
        return num_items.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(num_items), device=device)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    num_items: int | torch.Tensor | None = None,
    choice: str = "triton",
    chunk_rows: int = CROSS_ENTROPY_CHUNK_ROWS,
) -> torch.Tensor:
    """Cross-entropy of `hidden (N, H) @ weight.T (V, H)` against `targets (N,)`: the mean over
    non-ignored rows, or the sum divided by `num_items` (Transformers' `num_items_in_batch`).

    `chunk_rows` bounds the rows of every temporary: the (chunk_rows, V) logits, and for 16-bit
    weights the (chunk_rows, H) blocks of the weight gradient's product."""
    if not use_triton(choice, hidden):
        return linear_cross_entropy_reference(hidden, weight, targets, ignore_index, num_items)
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy needs chunk_rows >= 1, got {chunk_rows}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # What autocast would make of the LM head's matmul, then no autocast inside: the in-place
        # kernel and the gradient matmuls need their operands in one dtype.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    count = _divisor(targets, ignore_index, num_items, hidden.device)
    # Function.forward sees needs_input_grad from requires_grad alone, also under no_grad: decide here.
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False), _on_device(hidden):
        if not wants_grad:
            return _losses_only(
                hidden.contiguous(), weight, targets.contiguous(), ignore_index, count, chunk_rows
            )
        return _LinearCrossEntropy.apply(
            hidden.contiguous(), weight, targets.contiguous(), ignore_index, count, chunk_rows
        )


def _on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it `tensor`'s for the launch."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
