"""What a Megatron checkpoint's saved `args` and `checkpoint_version` say about the model that its
tensors cannot: options TNLG does not compute (refused by name), the heads and the QKV row order (the
record wins over a contradicting caller), which GeLU Megatron ran, and zero-centred LayerNorm gains."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Refused:
    unsupported: Callable[[Any, Any], bool]  # (saved value, all the args) -> whether TNLG cannot compute it
    what: str


def _is(bad: Any) -> Callable[[Any, Any], bool]:
    return lambda value, _args: value == bad


def _grouped_queries(on: Any, args: Any) -> bool:
    # Megatron reads num_query_groups only with group_query_attention (its default is 1); as many groups
    # as heads is plain multi-head attention, stored in the same per-head layout.
    return bool(on) and getattr(args, "num_query_groups", None) != getattr(args, "num_attention_heads", None)


# Saved-args settings that change the function without changing tensor names or shapes, or before a
# shape would tell: each is refused by its name. Args saved before an option existed lack it, and ran its
# default, which TNLG computes. untie_embeddings_and_output_weights needs no entry: it is converted.
_UNSUPPORTED_ARGS: dict[str, _Refused] = {
    "apply_residual_connection_post_layernorm": _Refused(_is(True), "residual taken after the LayerNorm"),
    "normalization": _Refused(lambda value, _args: value != "LayerNorm", "not LayerNorm"),
    "position_embedding_type": _Refused(lambda value, _args: value != "learned_absolute", "not learned"),
    # Megatron-LM 2023-03..07: RoPE applied to q and k on top of the learned position embeddings.
    "use_rotary_position_embeddings": _Refused(_is(True), "rotary position embeddings"),
    "window_size": _Refused(lambda value, _args: value is not None, "sliding-window attention"),
    "softmax_type": _Refused(lambda value, _args: value != "vanilla", "not the plain softmax"),
    "use_mup": _Refused(_is(True), "muP scaling"),
    "group_query_attention": _Refused(_grouped_queries, "num_query_groups differs from num_attention_heads"),
    "swiglu": _Refused(_is(True), "gated MLP"),
    "quick_geglu": _Refused(_is(True), "gated MLP"),
    "squared_relu": _Refused(_is(True), "not GeLU"),
    "add_bias_linear": _Refused(_is(False), "linear layers without biases"),
    # The older name of add_bias_linear=False; Megatron's load_checkpoint converts it.
    "disable_bias_linear": _Refused(_is(True), "linear layers without biases"),
}


def refuse_unsupported_architecture(args: Any) -> None:
    if args is None:
        return
    problems = [
        f"{name}={getattr(args, name)!r} ({refused.what})"
        for name, refused in _UNSUPPORTED_ARGS.items()
        if hasattr(args, name) and refused.unsupported(getattr(args, name), args)
    ]
    if problems:
        raise ValueError(f"the Megatron model uses options TNLG does not implement: {', '.join(problems)}")


def _recorded_unless_given(name: str, given: Any, recorded: Any) -> Any:
    """A fact about the tensors (their heads, their QKV row order): the checkpoint's record, else the
    caller's value. A given value that contradicts the record is refused: the record laid the tensors out."""
    if given is not None and recorded is not None and given != recorded:
        raise ValueError(
            f"{name} {given!r} was given, but the checkpoint records {name} {recorded!r}: its tensors are "
            f"laid out by the record; leave {name} out"
        )
    return recorded if recorded is not None else given


def settled_heads(given: int | None, args: Any) -> int:
    heads = _recorded_unless_given("num_attention_heads", given, getattr(args, "num_attention_heads", None))
    if heads is None:
        raise ValueError("the checkpoint carries no args: pass num_attention_heads")
    if heads < 1:
        raise ValueError(f"num_attention_heads {heads} is not a number of heads: give a positive one")
    return heads


def settled_checkpoint_version(given: float | None, metadata: Mapping[str, Any], core_names: bool) -> float:
    """The version the fused QKV rows are read in, logged with where it came from."""
    recorded = metadata.get("checkpoint_version")
    version = _recorded_unless_given("checkpoint_version", given, recorded)
    if recorded is not None:
        why = "recorded in the checkpoint"
    elif version is not None:
        why = "given; the checkpoint records none"
    elif metadata.get("megatron_checkpoint"):
        # Megatron's load_checkpoint: state_dict.get('checkpoint_version', 0); versions began 2020-09.
        version, why = 0.0, "the checkpoint records none, and Megatron reads a missing version as 0"
    else:
        version, why = (
            3.0,
            "bare state dicts record none; 3.0, the per-head order Megatron has saved since late 2020",
        )
    if core_names:
        why += " (megatron-core linear_qkv rows are per head in every version)"
    logger.info("Megatron checkpoint_version %g: %s", version, why)
    return float(version)


def zero_centered_gamma(args: Any) -> bool:
    """Whether Megatron stored its LayerNorm weights zero-centred: with `apply_layernorm_1p` (older
    Megatron-LM) or `layernorm_zero_centered_gamma` (Megatron-core) it normalizes with `weight + 1`."""
    return bool(
        getattr(args, "apply_layernorm_1p", False) or getattr(args, "layernorm_zero_centered_gamma", False)
    )


def shift_layernorm_weights(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Every LayerNorm weight (input, post-attention, final) as the `weight + 1` Megatron applies, so a
    plain LayerNorm computes the same function; biases are used as stored. The 1 is added in fp32, as
    Transformer Engine's zero-centred-gamma kernels add it, and the sum cast once to `dtype` (default:
    the stored one): a 16-bit sum would round every gain (bf16's spacing near 1 is 2^-7)."""
    return {
        name: (tensor.float() + 1).to(dtype or tensor.dtype) if _LAYERNORM_WEIGHT.search(name) else tensor
        for name, tensor in tensors.items()
    }


_LAYERNORM_WEIGHT = re.compile(r"(input_layernorm|post_attention_layernorm|final_layernorm)\.weight$")


# [Note: which GeLU Megatron ran]
# TNLG's `gelu_new` is the tanh approximation, `gelu` the exact (erf) GeLU. Megatron chose by the code
# that built the model, which the tensor names tell (megatron-core `decoder.*`, legacy `language_model.*`):
# - megatron-core: TransformerConfig.activation_func is F.gelu (exact); openai_gelu and onnx_safe are
#   never read. The fused bias-GeLU kernel (bias_gelu_fusion, on by default) is the tanh approximation,
#   and so is Transformer Engine's GELU (use_te_activation_func, use_transformer_engine_op_fuser).
# - legacy ParallelMLP, by the era its args tell:
#   before 2020-04-14 (no openai_gelu arg): Megatron's own gelu_impl, tanh;
#   2020-04-14 to 2020-09-11 (no bias_gelu_fusion arg): openai_gelu tanh, else F.gelu or erf_gelu (exact);
#   2020-09-11 to 2023-04-01 (no swiglu arg): bias_gelu_fusion's tanh kernel wins over everything,
#   else openai_gelu tanh, else exact;
#   from 2023-04-01: openai_gelu tanh, then onnx_safe's erf_gelu (exact), then the fusion's tanh, else exact.
# Without args (bare state dicts) the default is `gelu_new`, the GeLU of GPT-2 and of Megatron's defaults.
def activation_from_args(args: Any, core_names: bool) -> str:
    """Megatron's GeLU as a TNLG `hidden_act` ([Note: which GeLU Megatron ran])."""
    if args is None:
        return "gelu_new"
    tanh = _core_gelu_is_tanh(args) if core_names else _legacy_gelu_is_tanh(args)
    return "gelu_new" if tanh else "gelu"


def _core_gelu_is_tanh(args: Any) -> bool:
    if getattr(args, "use_te_activation_func", False) or getattr(
        args, "use_transformer_engine_op_fuser", False
    ):
        return True
    return bool(getattr(args, "bias_gelu_fusion", getattr(args, "bias_activation_fusion", True)))


def _legacy_gelu_is_tanh(args: Any) -> bool:
    if not hasattr(args, "openai_gelu") or args.openai_gelu:
        return True
    if getattr(args, "onnx_safe", None) and hasattr(args, "swiglu"):
        return False  # from 2023-04 onnx_safe's erf GeLU is chosen before the fusion
    return bool(getattr(args, "bias_gelu_fusion", False))  # no such arg before 2020-09: no fused kernel
