"""Models and data for the ZeRO equivalence tests: awkward shapes on purpose."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, GLOBAL_BATCH, SEQ = 37, 16, 16, 6


class AwkwardBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 24)
        self.down = nn.Linear(24, WIDTH)
        self.odd = nn.Parameter(torch.randn(53) * 0.1)  # 53 elements: divisible by no world size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return x + h + self.odd[:WIDTH] * self.odd[WIDTH : 2 * WIDTH].tanh()


class AwkwardModel(nn.Module):
    """Tied input/output embedding, two blocks, a frozen layer, an unused parameter."""

    _no_split_modules = ["AwkwardBlock"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([AwkwardBlock() for _ in range(2)])
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(7))
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise one module's own parameters (what `tnlg.sharding.init` calls per module)."""
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
        elif isinstance(module, AwkwardBlock):
            nn.init.normal_(module.odd, std=0.1)
        elif isinstance(module, AwkwardModel):
            nn.init.normal_(module.unused)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x + 0.1 * self.frozen(x))
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_model(seed: int = 0) -> AwkwardModel:
    torch.manual_seed(seed)
    return AwkwardModel()


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two param groups: decayed matrices, and undecayed biases / norms / vectors at another lr.
    `kind`: AdamW, Adam (weight decay added to the gradient) or SGD with momentum."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-2, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-1, momentum=0.9)
    raise ValueError(f"unknown optimizer kind {kind!r}")


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (input_ids, labels) for `steps` steps."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def local(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int):
    """This rank's equal slice of a global batch."""
    size = GLOBAL_BATCH // world_size
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def train_reference(
    steps: int, clip: float = 0.0, accumulation: int = 1
) -> tuple[list[float], dict, list[float]]:
    """Single-process training on the global batches: (losses, final state dict, grad norms)."""
    model = make_model()
    run = train_one_process(model, make_optimizer(model), batches(steps), lambda ids, t: model(ids, t), clip)
    return run["losses"], run["state"], run["norms"]


def train_one_process(model, optimizer, global_batches, loss_of, clip: float = 0.0) -> dict:
    """The reference every layout is compared with: `model` trained on `global_batches` ((inputs,
    labels) pairs; `loss_of(inputs, labels)` its loss) in one process, clipped at `clip` (0: never).
    Per-step losses and gradient norms (before clipping), and the final state dict."""
    losses, norms = [], []
    for inputs, labels in global_batches:
        loss = loss_of(inputs, labels)
        loss.backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")))
        )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
