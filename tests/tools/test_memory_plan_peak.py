"""The meta-device plan's device figure bounds what a real engine holds at its peak, from above.

The plan sums the model states and each transient at its own peak; the module documents that sum as
an upper bound of their joint peak. Here a real engine (2 gloo ranks, bf16) is censused at every
gradient hook of its backward, the stretch of a step where the reduce buckets are alive: every
tensor storage Python can reach (`benchmarks.common.live_tensor_bytes`, no figure asked of the
engine), less what offload keeps in host memory. The model is wide and the batch four tokens, so
that activations are small next to the buckets; the plan is given Korthikanti's activation count
(`memory.activation_bytes`) for what forward leaves alive.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import live_tensor_bytes
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.memory import activation_bytes
from tnlg.tools.memory_plan import plan_rank_memory
from tnlg.tools.spawn import run_distributed

CONFIG = {
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 1024, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip
BATCH, TOKENS, WORLD = 1, 4, 2


def census_peak(rank: int, world_size: int, zero: dict) -> int:
    """The most device bytes alive at any gradient hook over two steps (the second with the
    optimizer state made by the first)."""
    torch.manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, TOKENS))
    baseline = live_tensor_bytes()  # the batch is the caller's, before the engine exists
    model = TNLGForCausalLM(TNLGConfig(**CONFIG))
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(**zero))
    peak = 0

    def sample(*_args) -> None:
        nonlocal peak
        host = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in engine.host_tensors()}
        peak = max(peak, live_tensor_bytes() - baseline - sum(host.values()))

    # Registered after the engine's own hooks: a sample sees the bucket the engine's hook just launched.
    hooks = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters() if p.requires_grad]
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        del loss
    for hook in hooks:
        hook.remove()
    engine.close()
    return peak


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero",
    [
        # every unit's bucket in flight at once at the end of backward, with its reduce-scatter output
        pytest.param({"stage": 2}, id="stage2"),
        # buckets completed along the way: at most BUCKETS_IN_FLIGHT buckets' worth plus the newest
        pytest.param({"stage": 2, "reduce_bucket_size": 100_000}, id="stage2-small-buckets"),
        pytest.param({"stage": 3}, id="stage3"),
        pytest.param({"stage": 2, "offload_optimizer": "cpu"}, id="stage2-offload"),
    ],
)
def test_the_plan_bounds_a_real_engines_peak(zero):
    zero = {"mixed_precision": "bf16", "param_persistence_threshold": 0, **zero}
    peak = max(run_distributed(census_peak, WORLD, zero, timeout=300))
    config = TNLGConfig(**CONFIG)
    activations = activation_bytes(
        config, micro_batch_size=BATCH, seq_len=TOKENS, compute_bytes=2, activation_checkpointing=False
    )
    with torch.device("meta"):
        meta = TNLGForCausalLM(config)
    plan = plan_rank_memory(
        meta, torch.optim.AdamW(meta.parameters()), ZeroConfig(**zero), world_size=WORLD,
        activations=activations, device_type="cpu",
    )  # fmt: skip
    assert peak <= plan.device, (
        f"census peak {peak} bytes exceeds the plan's {plan.device} by {peak - plan.device}"
    )
    # The activations are small next to what is bounded, so the bound says something about buckets.
    assert activations < plan.buckets // 10
