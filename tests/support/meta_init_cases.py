"""Tiny Transformers models built on the meta device and materialized by the engine, for
tests/sharding/test_zero_init.py and test_zero_pretrained.py (module level, so spawned ranks can
import them)."""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from tnlg.sharding import ZeroConfig, initialize

VOCAB = 96

# GPT-2 and GPTBigCode rescale c_proj.weight in the rule for their attention / MLP modules, which own
# no parameter; Llama's rotary buffers (non-persistent) get their values from its rule too.
# 8 layers: the rescaled std (0.02 / sqrt(16)) is a quarter of the plain one.
CONFIGS = {
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=8, n_head=4, n_positions=64),
    "gpt_bigcode": lambda: GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=8, n_head=4, n_positions=64),
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
}
CLASSES = {"gpt2": GPT2LMHeadModel, "gpt_bigcode": GPTBigCodeForCausalLM, "llama": LlamaForCausalLM}


def build(kind: str, meta: bool) -> nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return CLASSES[kind](CONFIGS[kind]())


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def materialized(rank: int, world_size: int, kinds: list[str], stages: list[int]) -> dict:
    """{(kind, stage): the full state dict, the buffers and a forward's loss} of each meta model
    given to the engine."""
    out = {}
    for kind in kinds:
        for stage in stages:
            model = build(kind, meta=True)
            engine = initialize(
                model,
                torch.optim.AdamW(model.parameters()),
                ZeroConfig(stage=stage, param_persistence_threshold=100),
            )
            batch = ids()
            with torch.no_grad():
                loss = engine(input_ids=batch, labels=batch).loss.item()
            buffers = {name: b.clone() for name, b in engine.module.named_buffers()}
            out[kind, stage] = {"state": engine.full_state_dict(), "buffers": buffers, "loss": loss}
            engine.close()
    return out


class LlamaWithScratch(LlamaForCausalLM):
    """A Llama with a non-persistent buffer that its _init_weights never writes."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.register_buffer("scratch", torch.ones(3), persistent=False)
