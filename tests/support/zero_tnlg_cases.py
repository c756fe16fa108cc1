"""What each rank runs in the TNLG-under-ZeRO tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize

STEPS = 5


def debug_model() -> TNLGForCausalLM:
    torch.manual_seed(0)
    return TNLGForCausalLM(TNLGConfig.from_preset("debug"))


def train_debug_model(
    rank: int, world_size: int, stage: int, mixed_precision: str = "no", checkpointing: bool = False
) -> dict:
    """A few AdamW steps of the debug TNLG model; returns mean losses, the consolidated state, a generation."""
    model = debug_model()
    if checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )
    config = ZeroConfig(
        stage=stage,
        mixed_precision=mixed_precision,
        gradient_clipping=1.0,
        reduce_bucket_size=20_000,
        param_persistence_threshold=1_000,
        prefetch_bucket_size=60_000,
    )
    engine = initialize(model, optimizer, config)
    generator = torch.Generator().manual_seed(1)
    # One fixed batch, seen every step: the loss must visibly fall as the model memorises it.
    batch = torch.randint(0, 512, (2 * world_size, 32), generator=generator)[2 * rank : 2 * rank + 2]
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    # Generation through the sharded model: every rank steps together (stage 3 gathers per forward).
    engine.eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        generated = engine.module.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "generated": generated,
        "memory": engine.memory_stats(),
    }
