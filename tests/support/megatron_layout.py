"""Build Megatron-LM checkpoints from a GPT-2 model, written independently of `tnlg.tools.convert`.

The converter's tests go GPT-2 → Megatron layout (here) → TNLG (the converter) and compare logits
with the GPT-2 model, so the equivalence is checked end to end rather than assumed.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import random
import signal
import sys
import types

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def source_gpt2(vocab: int, width: int, layers: int, heads: int, positions: int) -> GPT2LMHeadModel:
    """The GPT-2 the conversion tests turn into Megatron-LM checkpoints and back: eager attention, and its
    LayerNorms and biases moved off their 1/0 init, so that a +1 or a dropped bias would show."""
    config = GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "ln_" in name or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def _qkv_shard(
    weight_or_bias: torch.Tensor, num_heads: int, tp: int, rank: int, version: float
) -> torch.Tensor:
    """Rank `rank`'s QKV rows: its heads' q, k, v (GPT-2 keeps `[3, nh, hd]`) in Megatron's order."""
    rows, rest = weight_or_bias.shape[0], weight_or_bias.shape[1:]
    head_dim = rows // (3 * num_heads)
    local = num_heads // tp
    mine = weight_or_bias.reshape(3, num_heads, head_dim, *rest)[:, rank * local : (rank + 1) * local]
    trailing = tuple(range(3, 3 + len(rest)))
    if version == 0:  # [3, local heads, hd]
        ordered = mine
    elif version < 2.0:  # [local heads, hd, 3]
        ordered = mine.permute(1, 2, 0, *trailing)
    else:  # [local heads, 3, hd]
        ordered = mine.transpose(0, 1)
    return ordered.reshape(rows // tp, *rest).contiguous()


def gpt2_layers(model: GPT2LMHeadModel, padded_vocab: int) -> tuple[dict, list[dict]]:
    """GPT-2 weights in Megatron's (out, in) orientation: top-level tensors and one dict per layer."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    wte = sd["transformer.wte.weight"]
    padding = torch.randn(padded_vocab - wte.shape[0], wte.shape[1])
    top = {
        "embed": torch.cat([wte, padding]),
        "pos": sd["transformer.wpe.weight"],
        "final_ln.weight": sd["transformer.ln_f.weight"],
        "final_ln.bias": sd["transformer.ln_f.bias"],
    }
    layers = []
    for i in range(model.config.n_layer):
        p = f"transformer.h.{i}."
        layers.append(
            {
                "ln1.weight": sd[p + "ln_1.weight"],
                "ln1.bias": sd[p + "ln_1.bias"],
                "qkv.weight": sd[p + "attn.c_attn.weight"].t(),
                "qkv.bias": sd[p + "attn.c_attn.bias"],
                "proj.weight": sd[p + "attn.c_proj.weight"].t(),
                "proj.bias": sd[p + "attn.c_proj.bias"],
                "ln2.weight": sd[p + "ln_2.weight"],
                "ln2.bias": sd[p + "ln_2.bias"],
                "fc1.weight": sd[p + "mlp.c_fc.weight"].t(),
                "fc1.bias": sd[p + "mlp.c_fc.bias"],
                "fc2.weight": sd[p + "mlp.c_proj.weight"].t(),
                "fc2.bias": sd[p + "mlp.c_proj.bias"],
            }
        )
    return top, layers


# role → (Megatron-core local-spec name, Transformer-Engine-spec name, legacy name, split dim)
_LAYER_NAMES = {
    "ln1.weight": (
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "input_layernorm.weight",
        None,
    ),
    "ln1.bias": (
        "input_layernorm.bias",
        "self_attention.linear_qkv.layer_norm_bias",
        "input_layernorm.bias",
        None,
    ),
    "qkv.weight": ("self_attention.linear_qkv.weight",) * 2 + ("self_attention.query_key_value.weight", 0),
    "qkv.bias": ("self_attention.linear_qkv.bias",) * 2 + ("self_attention.query_key_value.bias", 0),
    "proj.weight": ("self_attention.linear_proj.weight",) * 2 + ("self_attention.dense.weight", 1),
    "proj.bias": ("self_attention.linear_proj.bias",) * 2 + ("self_attention.dense.bias", None),
    "ln2.weight": (
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        "post_attention_layernorm.weight",
        None,
    ),
    "ln2.bias": (
        "pre_mlp_layernorm.bias",
        "mlp.linear_fc1.layer_norm_bias",
        "post_attention_layernorm.bias",
        None,
    ),
    "fc1.weight": ("mlp.linear_fc1.weight",) * 2 + ("mlp.dense_h_to_4h.weight", 0),
    "fc1.bias": ("mlp.linear_fc1.bias",) * 2 + ("mlp.dense_h_to_4h.bias", 0),
    "fc2.weight": ("mlp.linear_fc2.weight",) * 2 + ("mlp.dense_4h_to_h.weight", 1),
    "fc2.bias": ("mlp.linear_fc2.bias",) * 2 + ("mlp.dense_4h_to_h.bias", None),
}
_STYLE = {"core": 0, "te": 1, "legacy": 2}


def megatron_shards(
    model: GPT2LMHeadModel,
    *,
    style: str = "core",
    tp: int = 1,
    pp: int = 1,
    padded_vocab: int = 384,
    version: float = 3.0,
) -> dict[tuple[int, int], dict]:
    """`{(tp_rank, pp_rank): state dict}` as Megatron would save `model` (legacy ones nested)."""
    heads = model.config.n_head
    top, layers = gpt2_layers(model, padded_vocab)
    column = _STYLE[style]
    per_stage = len(layers) // pp
    shards: dict[tuple[int, int], dict] = {}
    for stage in range(pp):
        stage_layers = layers[stage * per_stage : (stage + 1) * per_stage]
        for rank in range(tp):
            flat: dict[str, torch.Tensor] = {}
            prefix = "decoder" if style != "legacy" else "language_model.encoder"
            for local, tensors in enumerate(stage_layers):
                for role, tensor in tensors.items():
                    names = _LAYER_NAMES[role]
                    dim = names[3]
                    if role.startswith("qkv"):
                        piece = _qkv_shard(tensor, heads, tp, rank, version if style == "legacy" else 3.0)
                    else:
                        piece = tensor if dim is None else tensor.chunk(tp, dim=dim)[rank]
                    flat[f"{prefix}.layers.{local}.{names[column]}"] = piece.contiguous()
                if style == "te":
                    flat[f"{prefix}.layers.{local}.self_attention.linear_qkv._extra_state"] = torch.tensor([])
            embed_prefix = "embedding" if style != "legacy" else "language_model.embedding"
            if stage == 0:
                flat[f"{embed_prefix}.word_embeddings.weight"] = top["embed"].chunk(tp)[rank].contiguous()
                flat[f"{embed_prefix}.position_embeddings.weight"] = top["pos"]
            if stage == pp - 1:
                flat[f"{prefix}.final_layernorm.weight"] = top["final_ln.weight"]
                flat[f"{prefix}.final_layernorm.bias"] = top["final_ln.bias"]
                if pp > 1:  # the last stage's copy of the tied embedding
                    head = "output_layer.weight" if style != "legacy" else "word_embeddings_for_head.weight"
                    flat[head] = top["embed"].chunk(tp)[rank].contiguous()
            shards[(rank, stage)] = _nest_legacy(flat) if style == "legacy" else flat
    return shards


def _nest_legacy(flat: dict[str, torch.Tensor]) -> dict:
    """Legacy checkpoints nest `language_model` → `embedding` / `encoder` → flat names."""
    nested: dict = {"language_model": {"embedding": {}, "encoder": {}}}
    for name, tensor in flat.items():
        if name.startswith("language_model.embedding."):
            kind, _, param = name.removeprefix("language_model.embedding.").partition(".")
            nested["language_model"]["embedding"].setdefault(kind, {})[param] = tensor
        elif name.startswith("language_model.encoder."):
            nested["language_model"]["encoder"][name.removeprefix("language_model.encoder.")] = tensor
        else:
            nested[name] = tensor
    return nested


def save_megatron_checkpoint(
    shards: dict[tuple[int, int], dict], root, num_heads: int, version: float = 3.0, **extra_args
):
    """Write Megatron's directory layout: latest_checkpointed_iteration.txt, iter_*/mp_rank_*/*.pt.

    The saved args hold what Megatron's do (a `ModelType` enum among them), plus `extra_args`.
    """
    pp = 1 + max(stage for _, stage in shards)
    iteration = root / "iter_0000010"
    with _fake_megatron_enums() as model_type:
        _save_ranks(shards, iteration, pp, num_heads, version, model_type.encoder_or_decoder, extra_args)
    (root / "latest_checkpointed_iteration.txt").write_text("10")


def _save_ranks(shards, iteration, pp, num_heads, version, model_type, extra_args) -> None:
    for (rank, stage), state in shards.items():
        name = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
        (iteration / name).mkdir(parents=True)
        torch.save(
            {
                "model": state,
                "args": argparse.Namespace(
                    **{
                        "num_attention_heads": num_heads,
                        "layernorm_epsilon": 1e-5,
                        "bias_gelu_fusion": True,
                        "model_type": model_type,
                        "exit_signal": signal.SIGTERM,  # megatron-core 0.19 keeps it as a signal.Signals
                        **extra_args,
                    }
                ),
                "checkpoint_version": version,
                "iteration": 10,
                "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state()}],
            },
            iteration / name / "model_optim_rng.pt",
        )


@contextlib.contextmanager
def _fake_megatron_enums():
    """`megatron.core.enums.ModelType`, importable only inside the block, as Megatron's args hold one.

    The modules are gone when the checkpoint is loaded, so loading must not need Megatron.
    """
    module = types.ModuleType("megatron.core.enums")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__ = module.__name__
    ModelType.__qualname__ = "ModelType"
    module.ModelType = ModelType
    names = ("megatron", "megatron.core", "megatron.core.enums")
    for name in names[:2]:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[module.__name__] = module
    try:
        yield ModelType
    finally:
        for name in names:
            sys.modules.pop(name, None)
