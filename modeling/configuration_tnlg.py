"""`TNLGConfig`: the configuration of a pre-LayerNorm GPT decoder, with the Turing-NLG presets.

The field names are the standard Transformers ones (`hidden_size`, `num_hidden_layers`, ...), so code
written for other Transformers decoders reads this config unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .transformers_compat import CACHE_NAME

FUSED_CHOICES = ("auto", "triton", "none")  # TNLGConfig.fused_kernels

# GPT-2's byte-level BPE has 50257 tokens. Megatron pads the embedding table to a multiple of
# `make_vocab_size_divisible_by` (128) times the tensor-parallel size so that every shard is
# aligned; with one tensor-parallel rank that is 50304, the size every preset uses (the
# published T-NLG / MT-NLG figures are quoted for the 50257 tokenizer; the padding adds 47 rows,
# 0.2M parameters at 4256 wide). The padded rows are never produced by the tokenizer.
GPT2_VOCAB_SIZE = 50257
PADDED_GPT2_VOCAB_SIZE = 50304


class _DefaultTokenId(int):
    """A token id that is a field's default, not the user's choice: `TNLGConfig` drops it (None) when
    the vocabulary cannot hold it, while the same id given explicitly is refused. Transformers
    requires a config built from defaults plus any valid field to construct."""


# GPT-2's <|endoftext|>, TNLG's default beginning and end of text.
GPT2_END_OF_TEXT = _DefaultTokenId(GPT2_VOCAB_SIZE - 1)
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def in_vocabulary(value: int | list[int] | None, vocab_size: int) -> bool:
    """Whether a token id field (None, an id, or a list of ids) names only rows of the vocabulary."""
    ids = value if isinstance(value, list) else [value]
    return all(i is None or (isinstance(i, int) and 0 <= i < vocab_size) for i in ids)


@dataclass(frozen=True)
class Preset:
    """The shape of a published model; everything else takes `TNLGConfig`'s defaults."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    max_position_embeddings: int
    vocab_size: int = PADDED_GPT2_VOCAB_SIZE
    description: str = ""


PRESETS: dict[str, Preset] = {
    # Tiny, for tests and the default run on a CPU: builds and trains in milliseconds.
    "debug": Preset(2, 64, 4, 128, vocab_size=512, description="tiny model for tests"),
    # The GPT-3 paper's small / medium / XL shapes (Brown et al. 2020, table 2.1); XL with 16
    # heads of 128 as in Megatron-LM's 1.3B example, since 24 heads do not divide 2048.
    "tnlg-125m": Preset(12, 768, 12, 2048, description="GPT-3 Small shape"),
    "tnlg-350m": Preset(24, 1024, 16, 2048, description="GPT-3 Medium shape"),
    "tnlg-1.3b": Preset(24, 2048, 16, 2048, description="GPT-3 XL shape"),
    # Turing-NLG (Microsoft, Feb 2020): 78 layers, hidden 4256, 28 heads, 1024 tokens.
    "tnlg-17b": Preset(78, 4256, 28, 1024, description="Turing-NLG 17B"),
    # Megatron-Turing NLG (Smith et al. 2022): 105 layers, hidden 20480, 128 heads, 2048 tokens.
    "mt-nlg-530b": Preset(105, 20480, 128, 2048, description="Megatron-Turing NLG 530B"),
}


def _has_parameters(activation: str) -> bool:
    """Whether an ACT2FN activation carries weights (PReLU, xIELU, ...), which TNLG's MLP does not count."""
    try:
        return any(True for _ in ACT2FN[activation].parameters())
    except Exception:  # activations that need arguments to build are not usable here either
        return True


class TNLGConfig(PreTrainedConfig):
    r"""Configuration of a TNLG (pre-LayerNorm GPT-2 / Megatron GPT) decoder.

    Args:
        vocab_size: rows of the token embedding (and of the tied output layer).
        max_position_embeddings: number of learned absolute positions, the longest sequence.
        hidden_size: width of the residual stream.
        num_hidden_layers: number of decoder blocks.
        num_attention_heads: attention heads per block; must divide `hidden_size`.
        intermediate_size: width of the MLP; `None` means `4 * hidden_size`.
        hidden_act: MLP activation, a key of `transformers.activations.ACT2FN`. `gelu_new` (the tanh
            approximation) is what GPT-2 and Megatron's fused bias-GeLU compute.
        layer_norm_epsilon: epsilon of every LayerNorm.
        initializer_range: std of the normal init; residual output projections use
            `initializer_range / sqrt(2 * num_hidden_layers)` (GPT-2 / Megatron scaled init).
        embedding_dropout, attention_dropout, hidden_dropout: dropout probabilities.
        use_cache: return a KV cache from forward by default.
        bos_token_id, eos_token_id: default to GPT-2's end-of-text id 50256, or None when `vocab_size`
            cannot hold it; an id outside the vocabulary given explicitly is an error.
        pad_token_id: none by default.
        tie_word_embeddings: the output layer shares the token embedding matrix.
        fused_kernels: the Triton LayerNorm, bias + GeLU (`gelu_new` only) and chunked LM-head
            cross-entropy of `fused_ops.py`: `auto` uses the bias + GeLU and the loss on CUDA tensors
            when Triton is installed (so not on CPU) and keeps torch's LayerNorm, faster on an H100
            ([Note: LayerNorm stays torch's]); `triton` uses all three always (CPU tensors need
            TRITON_INTERPRET=1), `none` none. The
            fused loss returns no logits when given labels (they are never made in full); without
            autograd (evaluation) it computes the loss alone. The MLP's first projection and the LM
            head run fused only while they are plain `nn.Linear`s: one wrapped by a peft LoRA
            adapter or carrying hooks is called as a module (its logits then made in full).
    """

    model_type = "tnlg"
    keys_to_ignore_at_inference = [CACHE_NAME]  # the model output's cache field ([Note: the cache's name])
    # Megatron tensor slicing, declared the Transformers way (read by `from_pretrained(tp_plan="auto")`
    # and by tnlg's own `tnlg.modeling.tensor_parallel.apply_tensor_parallel`). Keys are module names of
    # `TNLGModel`; `*` stands for a layer index only. The fused QKV is cut per head inside each of its
    # [q | k | v] blocks ("packed_colwise_qkv", registered by tensor_parallel.py); the token embedding is
    # cut by vocabulary rows. A class attribute: never saved in config.json.
    base_model_tp_plan = {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.qkv_proj": "packed_colwise_qkv",
        "layers.*.self_attn.out_proj": "rowwise",
        "layers.*.mlp.fc_in": "colwise",
        "layers.*.mlp.fc_out": "rowwise",
    }

    vocab_size: int = PADDED_GPT2_VOCAB_SIZE
    max_position_embeddings: int = 2048
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int | None = None
    hidden_act: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    use_cache: bool = True
    bos_token_id: int | None = GPT2_END_OF_TEXT  # None when vocab_size cannot hold it
    eos_token_id: int | list[int] | None = GPT2_END_OF_TEXT
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    fused_kernels: str = "auto"

    def __post_init__(self, **kwargs: Any) -> None:
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if isinstance(value, _DefaultTokenId):  # a plain int from here on: it is saved and compared
                fits = isinstance(self.vocab_size, int) and in_vocabulary(int(value), self.vocab_size)
                setattr(self, name, int(value) if fits else None)
        super().__post_init__(**kwargs)
        self.check_architecture()

    # Not named `validate_*`: Transformers' strict-dataclass machinery would wrap the ValueError
    # in its own exception type, and callers catch ValueError.
    def check_architecture(self) -> None:
        """Raise `ValueError` naming the first field whose value cannot build a model."""
        for name in (
            "vocab_size",
            "max_position_embeddings",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TNLGConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            divisors = [h for h in range(1, min(self.hidden_size, 256) + 1) if self.hidden_size % h == 0]
            raise ValueError(
                f"TNLGConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); head counts that divide it: {divisors}"
            )
        for name in ("embedding_dropout", "attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"TNLGConfig.{name} must be a probability in [0, 1), got {value!r}")
        if not isinstance(self.layer_norm_epsilon, (int, float)) or self.layer_norm_epsilon <= 0:
            raise ValueError(f"TNLGConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")
        if not isinstance(self.initializer_range, (int, float)) or self.initializer_range <= 0:
            raise ValueError(f"TNLGConfig.initializer_range must be > 0, got {self.initializer_range!r}")
        if self.hidden_act not in ACT2FN or _has_parameters(self.hidden_act):
            allowed = sorted(name for name in ACT2FN if not _has_parameters(name))
            raise ValueError(
                f"TNLGConfig.hidden_act {self.hidden_act!r} is not a parameter-free activation Transformers "
                f"knows; allowed: {allowed}"
            )
        if self.fused_kernels not in FUSED_CHOICES:
            raise ValueError(
                f"TNLGConfig.fused_kernels must be one of {list(FUSED_CHOICES)}, got {self.fused_kernels!r}"
            )
        self.check_token_ids()

    def check_token_ids(self) -> None:
        """Raise `ValueError` naming every special token id (bos, eos, pad) that names no row of the
        vocabulary: no token the model produces could be it."""
        outside = [
            f"TNLGConfig.{name} {getattr(self, name)!r}"
            for name in TOKEN_ID_FIELDS
            if not in_vocabulary(getattr(self, name), self.vocab_size)
        ]
        if outside:
            verb = "is" if len(outside) == 1 else "are"
            raise ValueError(
                f"{' and '.join(outside)} {verb} outside the vocabulary [0, {self.vocab_size}): set each to an "
                "id below vocab_size, or None"
            )

    def check_tensor_parallel(self, degree: int) -> None:
        """Raise `ValueError` unless tensor slicing of `degree` cuts whole heads, MLP columns and
        vocabulary rows; the message lists the degrees that work."""
        if isinstance(degree, bool) or not isinstance(degree, int) or degree <= 0:
            raise ValueError(f"tensor-parallel degree must be a positive integer, got {degree!r}")
        heads = self.num_attention_heads
        if heads % degree:
            valid = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            raise ValueError(
                f"tensor-parallel degree {degree} does not divide num_attention_heads ({heads}): "
                f"valid degrees are {valid}"
            )
        if self.intermediate_size % degree:
            raise ValueError(
                f"tensor-parallel degree {degree} does not divide intermediate_size ({self.intermediate_size})"
            )
        if self.vocab_size % degree:
            padded = -(-self.vocab_size // (128 * degree)) * 128 * degree
            raise ValueError(
                f"tensor-parallel degree {degree} does not divide vocab_size ({self.vocab_size}): pad the "
                f"vocabulary to a multiple of {degree} (Megatron pads to a multiple of 128 x degree: {padded})"
            )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TNLGConfig:
        """The config of a named preset (`TNLGConfig.presets()`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown TNLG preset {name!r}; allowed: {sorted(PRESETS)}")
        preset = PRESETS[name]
        fields = {
            "num_hidden_layers": preset.num_hidden_layers,
            "hidden_size": preset.hidden_size,
            "num_attention_heads": preset.num_attention_heads,
            "max_position_embeddings": preset.max_position_embeddings,
            "vocab_size": preset.vocab_size,
        }
        fields.update(overrides)
        if fields["vocab_size"] < GPT2_VOCAB_SIZE:
            # A vocabulary smaller than GPT-2's cannot hold its end-of-text id; the last row plays it.
            for name in ("bos_token_id", "eos_token_id"):
                fields.setdefault(name, fields["vocab_size"] - 1)
        return cls(**fields)

    @staticmethod
    def presets() -> dict[str, Preset]:
        """The named presets, by name."""
        return dict(PRESETS)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, *, include_embeddings: bool = True) -> int:
        """The exact parameter count of `TNLGForCausalLM` with this config, computed analytically.

        Per block: fused QKV (H x 3H + 3H), attention output (H x H + H), MLP in (H x I + I) and out
        (I x H + H), and two LayerNorms (2H each). Outside the blocks: token and position
        embeddings, the final LayerNorm, and an untied output layer when embeddings are not tied.
        """
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attention = h * 3 * h + 3 * h + h * h + h
        mlp = h * i + i + i * h + h
        layer_norms = 2 * 2 * h
        blocks = self.num_hidden_layers * (attention + mlp + layer_norms)
        final_norm = 2 * h
        if not include_embeddings:
            return blocks + final_norm
        embeddings = v * h + self.max_position_embeddings * h
        output_layer = 0 if self.tie_word_embeddings else v * h
        return blocks + final_norm + embeddings + output_layer

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6N plus the attention term 12 * L * T * H.

        N counts the parameters that take part in matmuls: the blocks plus the output projection
        (the embedding lookups are not matmuls, the logits are). The attention term is the QK^T and
        AV matmuls, 2 FLOPs x T x H each per token per layer forward, tripled for forward + backward;
        this is PaLM's MFU definition (Chowdhery et al. 2022, appendix B), with no causal discount.
        Activation recomputation is not counted: MFU uses model FLOPs, not hardware FLOPs.
        """
        seq_len = self.max_position_embeddings if seq_len is None else seq_len
        if seq_len <= 0:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
        matmul_params = self.num_parameters(include_embeddings=False) + self.vocab_size * self.hidden_size
        attention = 12 * self.num_hidden_layers * seq_len * self.hidden_size
        return 6 * matmul_params + attention

    def describe(self) -> str:
        """One line: layers, width, heads, parameters."""
        count = self.num_parameters()
        size = next(
            f"{count / scale:.1f}{unit}"
            for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
            if count >= scale
        )
        return (
            f"{self.num_hidden_layers} layers x {self.hidden_size} hidden x {self.num_attention_heads} heads "
            f"(head dim {self.head_dim}), {self.max_position_embeddings} positions, vocab {self.vocab_size}: "
            f"{size} parameters"
        )


def has_dropout(config: TNLGConfig) -> bool:
    """Whether any dropout is on: tensor-sliced training must then agree its dropout RNG across the group."""
    return any((config.embedding_dropout, config.attention_dropout, config.hidden_dropout))
