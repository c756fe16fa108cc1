"""The TNLG model: a pre-LayerNorm GPT decoder (GPT-2 / Megatron GPT layout) for Transformers.

Reads top to bottom: attention → MLP → block → PreTrainedModel → TNLGModel → TNLGForCausalLM.
Shapes use B = batch, T = new tokens, S = tokens attended to (cache + new), H = hidden size,
nh = heads, hd = head dim. The model knows nothing about sharding: the ZeRO engine wraps it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from . import fused_ops, tensor_parallel
from .configuration_tnlg import TOKEN_ID_FIELDS, TNLGConfig, has_dropout, in_vocabulary
from .loading import (
    check_model_config,
    check_weight_files,
    config_model_type,
    raise_on_mismatch,
    replacing_weight_files,
    saved_output_layer,
    tied_output_layer_error,
    weight_files,
    write_checksums,
)
from .pipeline import PipelineSplit, pipeline_split, split_pipeline
from .transformers_compat import (
    CACHE_NAME,
    CheckpointedLayer,
    accepts_legacy_cache_name,
    cache_kwarg,
    causal_mask,
    output_cache,
)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (B, nh, T, hd)
    key: torch.Tensor,  # (B, nh, S, hd)
    value: torch.Tensor,  # (B, nh, S, hd)
    attention_mask: torch.Tensor | None,  # (B, 1, T, S) additive, or None
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out; the reference the fused implementations (sdpa, flash) must match."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, nh, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    # Softmax in fp32 even for 16-bit inputs: large logits overflow fp16 and lose bf16 precision.
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value).transpose(1, 2).contiguous()  # (B, T, nh, hd)
    return output, probs


class TNLGResidualLinear(nn.Linear):
    """A linear layer whose output is added to the residual stream (attention out, MLP out).

    Its own type, so `_init_weights` can give it the depth-scaled std: Transformers initialises
    leaf modules one by one and skips container modules without direct parameters (for models
    outside its package), so the scaling cannot be applied from `TNLGAttention` / `TNLGMLP`.
    """


def is_plain_linear(module: nn.Module) -> bool:
    """Whether a fused path may read `module.weight` / `.bias` into its own kernel instead of calling
    `module`: only when calling it would compute exactly `nn.Linear`'s product.

    Anything else would be skipped silently: a peft LoRA layer (`lora.Linear`, or a
    `ModulesToSaveWrapper`, wraps the original Linear and keeps its `weight` reachable), accelerate's
    hooks (which replace `forward` on the instance) or forward / backward hooks (module or global).
    """
    hook_tables = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
        nn.modules.module._global_forward_hooks,
        nn.modules.module._global_forward_pre_hooks,
        nn.modules.module._global_backward_hooks,
        nn.modules.module._global_backward_pre_hooks,
    )
    return type(module) is nn.Linear and "forward" not in vars(module) and not any(hook_tables)


class TNLGAttention(nn.Module):
    """Causal self-attention with one fused QKV projection whose output rows are `[q | k | v]`.

    The `[q | k | v]` order is GPT-2's; Megatron interleaves per head (`[nh, 3, hd]`), and
    `tnlg.tools.convert` reorders its rows on the way in.
    """

    def __init__(self, config: TNLGConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True  # read by the sdpa / flash interfaces
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = TNLGResidualLinear(config.hidden_size, config.hidden_size)
        self.resid_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, H)
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)  # (B, T, 3H)
        # -1, not num_heads: under tensor slicing this rank holds nh / t heads of each of q, k, v.
        qkv = qkv.view(batch, length, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)  # each (B, nh, T, hd)

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # (B, nh, S, hd)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        dropout = self.config.attention_dropout if self.training else 0.0
        # Under tensor slicing this rank's heads drop out with masks of their own (tensor_parallel.py).
        sliced = dropout > 0 and tensor_parallel.tensor_group(self.qkv_proj) is not None
        with tensor_parallel.sliced_region_rng(self.qkv_proj, query.device) if sliced else nullcontext():
            output, weights = attention_interface(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
            )
        output = output.reshape(batch, length, -1).contiguous()  # (B, T, H)
        return self.resid_dropout(self.out_proj(output)), weights


class TNLGLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters and state dict) that runs the fused Triton kernel only when
    `config.fused_kernels` is `triton`; `auto` keeps torch's (see [Note: LayerNorm stays torch's])."""

    def __init__(self, config: TNLGConfig):
        super().__init__(config.hidden_size, eps=config.layer_norm_epsilon)
        # [Note: LayerNorm stays torch's]
        # On an H100 (docs/benchmarks.md, the first device run) torch's LayerNorm took 0.18 ms forward
        # + backward at 8192 x 2048 bf16 and the Triton one 0.53 ms, almost all of it host time per
        # launch (three launches and a partial-sum reduction against torch's two). In a profiled
        # 1.3B step the device sat idle 71 ms of 241 with the Triton kernels and 9 ms without, and the
        # longest gaps followed layer_norm_forward. `auto` therefore keeps torch's; `triton` still
        # forces the Triton kernel (the CPU tests run it under the interpreter).
        self.fused = "triton" if config.fused_kernels == "triton" else "none"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return fused_ops.layer_norm(hidden_states, self.weight, self.bias, self.eps, self.fused)


class TNLGMLP(nn.Module):
    """H → intermediate → H with a GeLU between (4H wide by default)."""

    def __init__(self, config: TNLGConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc_out = TNLGResidualLinear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)
        # Megatron's fused bias-GeLU: the bias add and the tanh GeLU in one pass (gelu_new only).
        self.fused = config.fused_kernels if config.hidden_act == "gelu_new" else "none"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # fc_in is read past its forward only while it is a plain Linear (not a LoRA layer, say).
        if fused_ops.use_block_kernel(self.fused, hidden_states) and is_plain_linear(self.fc_in):
            activated = fused_ops.bias_gelu(
                nn.functional.linear(hidden_states, self.fc_in.weight), self.fc_in.bias, self.fused
            )
        else:
            activated = self.act(self.fc_in(hidden_states))
        return self.dropout(self.fc_out(activated))


class TNLGBlock(CheckpointedLayer):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x)).

    The LayerNorm before each sublayer (GPT-2, Megatron) keeps the residual stream unnormalized,
    which is what lets very deep stacks (78 and 105 layers) train stably. Under activation checkpointing
    its forward is what is recomputed, its hooks outside ([Note: checkpointing the forward]).
    """

    def __init__(self, config: TNLGConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = TNLGLayerNorm(config)
        self.self_attn = TNLGAttention(config, layer_idx)
        self.post_attention_layernorm = TNLGLayerNorm(config)
        self.mlp = TNLGMLP(config)

    @accepts_legacy_cache_name  # called with the cache under the release's name ([Note: the cache's name])
    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, H)
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, cache=cache, **kwargs
        )
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class TNLGPreTrainedModel(PreTrainedModel):
    config_class = TNLGConfig
    config: TNLGConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TNLGBlock"]
    _skip_keys_device_placement = [CACHE_NAME]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {"hidden_states": TNLGBlock, "attentions": TNLGAttention}

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike | None,
        *args: Any,
        strict: bool = True,
        verify_checksums: bool | str = True,
        **kwargs: Any,
    ):
        """Transformers' `from_pretrained`, failing on missing, unexpected or mis-shaped tensors.

        With `strict=False` it behaves as in Transformers (random init for missing tensors); with
        `ignore_mismatched_sizes=True`, as there, mis-shaped tensors are initialised randomly (and
        reported), while missing or unexpected ones are still refused unless `strict=False`. With
        `output_loading_info=True` it returns `(model, loading_info)` and reports the mismatches
        there instead of raising, as Transformers does (a saved output layer that differs from the
        tied embedding is one of its `error_msgs`). See `tnlg.modeling.loading` for why.

        A local directory's weight files are checked before Transformers reads them: each must
        open as safetensors (else a `CheckpointFileError` naming it), and is compared with the sha256
        recorded at save when the directory has a `tnlg_checksums.json`: a file another tool has
        changed since loads with a warning naming it, `verify_checksums="strict"` refuses it, and
        `verify_checksums=False` skips the hashing ([Note: checksums] in loading.py). A directory whose
        config names another model type (a GPT-2 one) is refused in one line naming the way in.

        Hub kernels stay off unless asked for (`use_kernels=True` is passed on): Transformers 5.25
        turned them on by default, and its default mapping replaces the `gelu_new` module TNLG's MLP
        calls when its own fused kernel is off with a kernel fetched from the Hub (CUDA, ROCm and
        XPU, inference mode). tnlg runs without network access and brings its own fused kernels
        (`TNLGConfig.fused_kernels`); the releases before 5.25 default to off, so this keeps one
        behaviour across the supported range.
        """
        kwargs.setdefault("use_kernels", False)
        want_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        state_dict = kwargs.get("state_dict")
        variant = kwargs.get("variant")
        directory = _local_directory(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        if (
            directory is not None
            and kwargs.get("config") is None
            and not (directory / "config.json").is_file()
        ):
            # Transformers would build the default config and then fail on the weights' shapes.
            raise FileNotFoundError(
                f"{directory} has no config.json: a saved model directory needs the config next to its "
                "weights (save_pretrained writes both), or pass config= to from_pretrained"
            )
        if directory is not None and kwargs.get("config") is None:
            _check_model_type(directory, cls.config_class.model_type)
        if directory is not None and state_dict is None:  # given a state_dict, no weight file is read
            check_weight_files(directory, weight_files(directory, variant), verify=verify_checksums)
        if _asks_for_tensor_parallel(kwargs):
            _check_tensor_parallel_load(pretrained_model_name_or_path, kwargs)
        # Under `strict`, Transformers finishes loading so that its report of mis-shaped tensors
        # reaches us (its own error for them names none of the tensors); whether they are refused is
        # the caller's `ignore_mismatched_sizes`, checked below.
        model, info = super().from_pretrained(
            pretrained_model_name_or_path,
            *args,
            output_loading_info=True,
            ignore_mismatched_sizes=strict or ignore_mismatched,
            **kwargs,
        )
        if not strict:
            return (model, info) if want_info else model
        if cls.base_model_prefix and not hasattr(model, cls.base_model_prefix):
            # The base model loading a causal-LM checkpoint: the head is not part of it.
            info["unexpected_keys"] = {k for k in info["unexpected_keys"] if not k.startswith("lm_head.")}
        source = str(pretrained_model_name_or_path) if state_dict is None else "the state_dict given"
        if state_dict is not None:
            saved_head = state_dict.get("lm_head.weight")
        else:
            saved_head = saved_output_layer(directory, variant) if directory is not None else None
        tied_error = tied_output_layer_error(model, saved_head, source)
        if want_info:
            if tied_error is not None:
                info.setdefault("error_msgs", []).append(str(tied_error))
            return model, info
        raise_on_mismatch(info, source, ignore_mismatched_sizes=ignore_mismatched)
        if tied_error is not None:
            raise tied_error
        return model

    def save_pretrained(
        self, save_directory: str | os.PathLike, is_main_process: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Transformers' `save_pretrained`, replacing the directory's previous weights of this variant
        whole (Transformers keeps an old single file that `from_pretrained` then prefers), and only once
        the save has succeeded ([Note: replacing a model's weights] in loading.py), and recording each
        weight file's sha256 in `tnlg_checksums.json` ([Note: checksums] in loading.py).

        A model cut into pipeline stages or tensor slices holds part of the weights: it is refused
        unless `state_dict=` gives the whole model's (as its engine's consolidation does). So is a
        config that `from_pretrained` would refuse (special token ids past a vocabulary that
        `resize_token_embeddings` shrank): nothing is written either way.
        """
        _refuse_unloadable_config(self)
        state_dict = kwargs.get("state_dict", args[0] if args else None)
        if state_dict is None:
            _refuse_partial_save(self)
        directory, variant = Path(save_directory), kwargs.get("variant")
        with replacing_weight_files(directory, variant) if is_main_process else nullcontext():
            super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
        if is_main_process and directory.is_dir():
            write_checksums(directory, weight_files(directory, variant))

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, initializer_range) for matmuls and embeddings, zero biases, unit norms.

        The two projections that write into the residual stream (attention out, MLP out) get
        std / sqrt(2 * num_hidden_layers): each block adds two such outputs, so the stream's
        variance stays independent of depth (GPT-2 paper, section 2.3; Megatron's scaled init).
        """
        std = self.config.initializer_range
        if isinstance(module, TNLGResidualLinear):
            std = std / math.sqrt(2 * self.config.num_hidden_layers)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)


def _refuse_unloadable_config(model: PreTrainedModel) -> None:
    """Raise before a save whose config.json `from_pretrained` would refuse (loading builds the config
    again and runs the same checks), or whose generation config names special tokens the model cannot
    produce (generate() would never stop on such an eos). `resize_token_embeddings` changes vocab_size
    alone, so a smaller vocabulary leaves bos / eos / pad ids in both that name no row."""
    problems = []
    try:
        model.config.check_architecture()
    except ValueError as error:
        problems.append(f"from_pretrained would refuse model.config: {error}")
    generation, vocab_size = getattr(model, "generation_config", None), model.config.vocab_size
    outside = [
        f"model.generation_config.{name} {getattr(generation, name)!r}"
        for name in (TOKEN_ID_FIELDS if generation is not None else ())
        if not in_vocabulary(getattr(generation, name, None), vocab_size)
    ]
    if outside:
        problems.append(
            f"{' and '.join(outside)} outside the vocabulary [0, {vocab_size}): generate() would never "
            "produce them; set each to an id below vocab_size, or None"
        )
    if problems:
        raise ValueError(f"save_pretrained refused, nothing written: {'; '.join(problems)}")


def _refuse_partial_save(model: nn.Module) -> None:
    """Raise before a save that would write this rank's part of the model as if it were the whole.

    The state-dict names of a cut model are the whole model's ([Note: pipeline split] in pipeline.py),
    so Transformers would write the part without complaint and a later load would find tensors missing
    (pipeline stages) or mis-shaped against the config (tensor slices)."""
    split = pipeline_split(model)
    if split is not None:
        held = f"stages {split.stage_indices} of {split.num_stages}"
        cut = f"is cut into pipeline stages (split_pipeline): this rank holds {held}"
    elif tensor_parallel.is_sliced(model):
        degree = next(m.tp_degree for m in model.modules() if tensor_parallel.tensor_group(m) is not None)
        cut = (
            f"is cut into tensor slices (apply_tensor_parallel, degree {degree}): this rank holds 1/{degree}"
        )
    else:
        return
    raise RuntimeError(
        f"save_pretrained refused: the model {cut}, and would be saved as a partial model. Save it whole through "
        "its engine, on every rank: accelerator.save_model(model, directory), ZeroTrainer.save_model(), or "
        "save_pretrained(directory, state_dict=engine.full_state_dict()) (full_state_dict is collective)"
    )


def _asks_for_tensor_parallel(kwargs: dict[str, Any]) -> bool:
    """Whether `from_pretrained` is asked for Transformers' tensor parallelism, by the keywords
    (`tp_plan=`, `tp_size=`) or by `distributed_config=DistributedConfig(tp_plan=..., tp_size=...)`."""
    if kwargs.get("tp_plan") is not None or kwargs.get("tp_size") is not None:
        return True
    distributed = kwargs.get("distributed_config")
    # DistributedConfig settles tp_size when built: 1 without a plan, the world's share with one.
    return distributed is not None and (
        getattr(distributed, "tp_plan", None) is not None or (getattr(distributed, "tp_size", None) or 1) > 1
    )


def _check_tensor_parallel_load(path: str | os.PathLike | None, kwargs: dict[str, Any]) -> None:
    """Transformers cuts heads unevenly without a word: refuse a degree that does not divide them."""
    degree = kwargs.get("tp_size")
    if degree is None and getattr(kwargs.get("distributed_config"), "tp_size", None) is not None:
        degree = kwargs["distributed_config"].tp_size
    if degree is None:
        import torch.distributed as dist

        degree = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    config = kwargs.get("config")
    if not isinstance(config, TNLGConfig):
        config = TNLGConfig.from_pretrained(path, subfolder=kwargs.get("subfolder") or "")
    config.check_tensor_parallel(degree)


def _check_model_type(directory: Path, model_type: str) -> None:
    """A directory of another model (a GPT-2 one, say) is refused in one line naming the model_type
    found and the way in, before Transformers reads its config as this model's and every tensor fails
    to match. A config naming no model_type is read as this model's, as Transformers does."""
    if config_model_type(directory / "config.json") is not None:
        check_model_config(directory, model_type)


def _local_directory(path: str | os.PathLike | None, subfolder: str) -> Path | None:
    """The local directory `from_pretrained` reads, or None for a Hub id or no path."""
    if path is None:
        return None
    directory = Path(path) / subfolder
    return directory if directory.is_dir() else None


class TNLGModel(TNLGPreTrainedModel):
    """Embeddings (tokens + learned positions) → blocks → final LayerNorm."""

    def __init__(self, config: TNLGConfig):
        config.check_architecture()  # a config mutated after construction is checked again here
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.embed_dropout = nn.Dropout(config.embedding_dropout)
        self.layers = nn.ModuleList([TNLGBlock(config, i) for i in range(config.num_hidden_layers)])
        self.final_layernorm = TNLGLayerNorm(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @accepts_legacy_cache_name
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, S): 1 = attend, 0 = padding
        position_ids: torch.LongTensor | None = None,  # (B, T)
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,  # (B, T, H)
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("TNLGModel.forward needs exactly one of input_ids or inputs_embeds")
        _refuse_token_type_ids(kwargs)
        tp_group = tensor_parallel.tensor_group(self.embed_tokens)
        if self.training and tp_group is not None and has_dropout(self.config):
            # [Note: dropout under tensor slicing] in tensor_parallel.py
            tensor_parallel.check_rng_in_sync(self.embed_tokens, self.embed_tokens.weight.device)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        length = inputs_embeds.shape[1]

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past_length = cache.get_seq_length() if cache is not None else 0
        self._check_lengths(attention_mask, past_length, length)
        # Only the caller's positions go on to the mask and the attention kernels, which search them for
        # sequences packed in a row (see causal_mask): the model's own count holds one a row.
        given_positions = position_ids
        if position_ids is None:
            position_ids = self._default_position_ids(
                attention_mask, past_length, length, inputs_embeds.device
            )

        mask = causal_mask(self.config, inputs_embeds, attention_mask, cache, given_positions)

        hidden_states = self.embed_dropout(inputs_embeds + self.embed_positions(position_ids))  # (B, T, H)
        for block in self.layers:
            # The cache under the release's name: GradientCheckpointingLayer drops it by that name.
            hidden_states = block(
                hidden_states,
                attention_mask=mask,
                position_ids=given_positions,
                **cache_kwarg(cache),
                **kwargs,
            )
        hidden_states = self.final_layernorm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states, **cache_kwarg(cache if use_cache else None)
        )

    def _check_lengths(self, attention_mask: torch.Tensor | None, past_length: int, length: int) -> None:
        """A 2D mask covers the cached and the new tokens, and together they fit the learned positions."""
        if (
            attention_mask is not None
            and attention_mask.dim() == 2
            and attention_mask.shape[-1] != past_length + length
        ):
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} tokens but the cache holds {past_length} and "
                f"{length} are new: pass the mask of every token attended to ({past_length + length})"
            )
        if past_length + length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {past_length + length} tokens is longer than the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )

    @staticmethod
    def _default_position_ids(
        attention_mask: torch.Tensor | None, past_length: int, length: int, device: torch.device
    ) -> torch.LongTensor:
        """Positions of the new tokens: counted over attended tokens only when a 2D mask is given.

        Counting from the mask makes a left-padded row see the same positions as the unpadded
        sequence, so batched and single-sequence forwards agree. Padding slots get position 0;
        they are masked out of attention anyway.
        """
        if attention_mask is not None and attention_mask.dim() == 2:
            positions = attention_mask.long().cumsum(-1) - 1
            return positions.clamp(min=0)[:, -length:]  # (B, T)
        return torch.arange(past_length, past_length + length, device=device).unsqueeze(0)  # (1, T)


def _refuse_token_type_ids(kwargs: dict[str, Any]) -> None:
    """GPT-2 adds token-type embeddings (rows of its token embedding) for `token_type_ids`; TNLG has
    none, so taking them in silently would give a converted GPT-2 model other logits than GPT-2's.
    They stay out of `forward`'s signature, so that `generate()` refuses them in its own words and the
    Trainer drops such a dataset column, as it drops every column `forward` does not name."""
    if kwargs.get("token_type_ids") is not None:
        raise ValueError(
            "token_type_ids given, but TNLG has no token-type embeddings (GPT-2 adds them to the input): "
            "leave them out of the batch (a tokenizer returns none with return_token_type_ids=False)"
        )


class TNLGForCausalLM(TNLGPreTrainedModel, GenerationMixin):
    """TNLGModel plus the output layer (tied to the token embedding by default) and the LM loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor slicing of the head (with config.base_model_tp_plan): cut by vocabulary rows, like the
    # embedding it is tied to; called as a module it returns the full, gathered logits.
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: TNLGConfig):
        super().__init__(config)
        self.model = TNLGModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @accepts_legacy_cache_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,  # (B, T); -100 = no loss; shifted inside
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        if use_cache is None and cache is None and (labels is not None or self.training):
            # A loss, or a training forward whose loss is the caller's, needs no cache: building one
            # would hold every layer's keys and values for nothing. Generation asks for one explicitly.
            # (Packed sequences are kept apart with or without the fresh cache an evaluation forward
            # builds: [Note: packed sequences and an empty cache] in transformers_compat.py.)
            use_cache = False
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(
                "labels need the logits of every position: do not combine them with logits_to_keep"
            )
        hidden_states = outputs.last_hidden_state
        # From a loss that never makes the (B, T, V) logits, which are then not returned.
        loss = self._loss_without_logits(hidden_states, labels, kwargs) if labels is not None else None
        if loss is not None:
            return CausalLMOutputWithPast(
                loss=loss,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
                **cache_kwarg(output_cache(outputs)),
            )
        # Generation needs only the last position's logits: skip the (B, T, V) matmul for the rest.
        # A head cut for tensor slicing gathers its logits over the vocabulary: full (B, T', V).
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])  # (B, T', V)

        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **cache_kwarg(output_cache(outputs)),
        )

    def _loss_without_logits(
        self, hidden_states: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """The causal-LM loss straight from the final hidden states where a path exists that never makes
        the (B, T, V) logits (tensor slicing, the fused Triton head); None where the logits are needed.
        Both honour the keywords Transformers' `ForCausalLMLoss` takes (`shift_labels`, `ignore_index`,
        `num_items_in_batch`), as the logits path does."""
        ignore_index = kwargs.get("ignore_index", tensor_parallel.IGNORE_INDEX)
        if tensor_parallel.tensor_group(self.lm_head) is not None:
            # Cut by tnlg's apply_tensor_parallel: a vocabulary-parallel loss on local logits (B, T, V/t).
            return tensor_parallel.vocab_parallel_causal_lm_loss(
                self.lm_head, hidden_states, labels,
                num_items_in_batch=kwargs.get("num_items_in_batch"), shift_labels=kwargs.get("shift_labels"),
                ignore_index=ignore_index,
            )  # fmt: skip
        if fused_ops.use_triton(self.config.fused_kernels, hidden_states) and is_plain_linear(self.lm_head):
            # The LM head and its loss chunk by chunk. A wrapped head (LoRA, modules_to_save) is called
            # instead: the kernel reads only the weight.
            targets = kwargs.get("shift_labels")  # Transformers' keyword: labels already shifted
            if targets is None:
                targets = nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]  # t predicts t + 1
            return fused_ops.linear_cross_entropy(
                hidden_states.reshape(-1, hidden_states.shape[-1]), self.lm_head.weight,
                targets.reshape(-1).to(hidden_states.device), ignore_index=ignore_index,
                num_items=kwargs.get("num_items_in_batch"), choice=self.config.fused_kernels,
            )  # fmt: skip
        return None

    def split_pipeline(self, stages: Sequence[int], num_stages: int) -> PipelineSplit:
        """The model's declared pipeline split, as `base_model_tp_plan` is its declared tensor plan: cut
        in place down to `stages` of `num_stages` (see [Note: pipeline split] in pipeline.py). Engines
        call this hook (tnlg.sharding's `parallel.pipeline`), so that they need no TNLG class."""
        return split_pipeline(self, stages, num_stages)

    def pipeline_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's loss: the mean causal-LM loss of `labels` (B, T; -100 = none) from the
        final hidden states (B, T, H), by the same paths as `forward` (see modeling/pipeline.py)."""
        loss = self._loss_without_logits(hidden_states, labels, {})
        if loss is None:
            logits = self.lm_head(hidden_states)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return loss


__all__ = ["TNLGForCausalLM", "TNLGModel", "TNLGPreTrainedModel"]
