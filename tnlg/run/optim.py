"""The run's optimizer and learning-rate schedule, built from its `optimizer` section.

AdamW over two groups: matrices (dimension >= 2: projections, embeddings) decay, vectors (biases,
LayerNorm gains) do not, as in GPT-2 / Megatron. The rate warms up linearly for `warmup_steps`, then
follows a cosine down to `min_lr_ratio` of the peak at `train.max_steps`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tnlg.run.config import OptimizerSection


def build_optimizer(model: nn.Module, section: OptimizerSection) -> torch.optim.AdamW:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": section.weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=section.lr,
        betas=tuple(section.betas),
        eps=section.eps,
    )


def build_schedule(
    optimizer: torch.optim.Optimizer, section: OptimizerSection, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, section.warmup_steps, max_steps, section.min_lr_ratio)
    )


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The multiplier of the peak rate at `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
