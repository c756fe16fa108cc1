"""Batched generation on several ranks with a model sharded by the ZeRO engine (stage 3 included).

    engine, tokenizer = load_sharded_model("ckpt", ZeroConfig(stage=3))  # each rank reads its slices
    completions = generate_on_ranks(engine, tokenizer, prompts, GenerationSettings(max_new_tokens=64))

Every rank gets the same prompt list, generates a contiguous share of it and returns all the
completions, in prompt order. Under stage 3 every forward pass gathers parameters collectively, so
the ranks must make the same number of `generate` calls and, within each, the same number of
forward passes: a rank whose sequences hit EOS first, or that ran out of prompts, would otherwise
stop calling forward and leave the others waiting in a gather forever. Hence `synced_gpus=True`
(a finished rank keeps doing throwaway forward passes until every rank is done) and throwaway
batches for ranks with fewer prompts. Stages 0-2 do not need it, and it costs them one tiny
all-reduce per token.

Under tensor slicing the ranks of one replica generate the same prompts together, and must feed the
model the same ids: each call first checks that they were given the same prompts and settings, then
samples from one stream per replica ([Note: one stream per replica] in tnlg.inference.ranks).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from tnlg.data.tokenizer import pad_id
from tnlg.inference.generation import (
    Prompt,
    check_prompts,
    check_vocabulary,
    generate_batch,
    generate_texts,
    generation_config,
    load_tokenizer_for,
)
from tnlg.inference.ranks import (
    WorkShare,
    model_device,
    rank_slice,
    replica_differs,
    replica_rng,
    work_share,
)
from tnlg.inference.settings import GenerationSettings
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.loading import check_model_config
from tnlg.sharding import ZeroConfig, ZeroEngine, initialize, meta_from_pretrained
from tnlg.sharding.deepspeed import zero_config_from

logger = logging.getLogger(__name__)

MIXED_PRECISION = {torch.float32: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The scripts' --dtype names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_process_group_from_environment() -> bool:
    """Join the process group a launcher (torchrun, `accelerate launch`) describes in the environment.

    With `WORLD_SIZE` > 1: NCCL with this process on GPU `LOCAL_RANK` when CUDA is present, else gloo
    on the CPU. Returns whether a process group is active (False for a plain single process).
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def load_sharded_model(
    model_dir: str | Path,
    zero_config: ZeroConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> tuple[ZeroEngine, PreTrainedTokenizerBase]:
    """A saved TNLG checkpoint sharded across the ranks for inference, and its tokenizer.

    The model is built on the meta device from the checkpoint's config and each rank reads only its
    slices of the safetensors (see [Note: pretrained shards]), so no rank ever holds the whole
    model under stage 3. The engine is inference only (no optimizer, gradients or optimizer state).
    `dtype` is the compute dtype, settled with `zero_config`'s mixed precision by `sharded_precision`
    (None keeps the config's; a dtype the config's bf16/fp16 disagrees with is refused); `device` defaults to the current CUDA device, else the CPU. The tokenizer is
    `load_tokenizer_for(model_dir, tokenizer)`'s. Collective: every rank of the group must call it.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(
            f"{model_dir!r} is not a checkpoint directory: sharded loading reads a saved model's safetensors"
        )
    check_model_config(path, TNLGConfig.model_type)
    loaded = load_tokenizer_for(path, tokenizer)
    config = sharded_precision(zero_config_from(zero_config), dtype)
    model = meta_from_pretrained(TNLGForCausalLM, path)
    check_vocabulary(loaded, model.config.vocab_size)
    engine = initialize(model, None, config, device=device)
    return engine.eval(), loaded


def sharded_precision(
    config: ZeroConfig, dtype: torch.dtype | None, given: str | None = None, source: str = "the ZeRO config"
) -> ZeroConfig:
    """`config` computing in `dtype`: None keeps its mixed precision, a config that enables none takes
    the dtype's, and one that enables another is a ValueError naming both (`given`: how the dtype was
    set, e.g. "--dtype float32"; `source`: where the config came from). The rule of every front door
    (`DeepSpeedConfig.with_mixed_precision`), except that an explicit float32 is a choice here, not
    "whatever the config enables": a model asked for in float32 is not computed in bf16."""
    if dtype is None:
        return config
    if dtype not in MIXED_PRECISION:
        raise ValueError(f"dtype {dtype} is not one of {sorted(map(str, MIXED_PRECISION))}")
    wanted = MIXED_PRECISION[dtype]
    if config.mixed_precision not in ("no", wanted):
        raise ValueError(
            f"{given or f'dtype {dtype}'} conflicts with {source}, which enables {config.mixed_precision}: "
            "leave the dtype out to compute in it, or make them agree"
        )
    return config.replace(mixed_precision=wanted)


def sharding_from_flags(
    zero_config: str | None, zero_stage: int | None, dtype: str | None, *, default_stage: int
) -> ZeroConfig:
    """The ZeroConfig a script's --zero-config, --zero-stage and --dtype (a `DTYPES` name) ask for, settled
    once, before any process group or model: the --zero-config (else stage `default_stage`), its stage
    replaced by --zero-stage, its mixed precision settled with --dtype by `sharded_precision`, so the
    result's precision is the compute dtype. A conflict is a ValueError naming the flags."""
    config = zero_config_from(zero_config) if zero_config else ZeroConfig(stage=default_stage)
    if zero_stage is not None:
        config = config.replace(stage=zero_stage)
    given = None if dtype is None else DTYPES[dtype]
    return sharded_precision(config, given, f"--dtype {dtype}", f"--zero-config {zero_config}")


@torch.inference_mode()
def generate_on_ranks(
    model: ZeroEngine | TNLGForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    settings: GenerationSettings | None = None,
    batch_size: int = 8,
) -> list[str]:
    """Every prompt's completion, in prompt order, on every rank; each rank generates its share.

    Collective: every rank of the default process group calls it with the same `prompts` (text or
    token ids, as for `generate_texts`), `settings` and `batch_size`. `model` is a `ZeroEngine` (any
    stage; it must shard over the default group, which `synced_gpus` synchronises on), a plain model
    replicated on every rank, or one cut by `apply_tensor_parallel` over every rank. The prompts are
    shared by data-parallel rank: under tensor slicing the ranks of one replica generate the same share
    together, refuse (all of them, with a ValueError) prompts or settings that differ between them, and
    sample from the stream of the replica's first rank, however each rank was seeded; that rank's
    generator advances, the others' are left as they were. Data-parallel replicas each sample from
    their own generator: seeding them (differently, or not) is the caller's choice. Without a process
    group (or with one data-parallel share) this is `generate_texts`.
    """
    settings = settings or GenerationSettings()
    module = model.module if isinstance(model, ZeroEngine) else model
    # By data-parallel rank: the ranks of one tensor-sliced replica generate the same prompts together
    # (see [Note: evaluation by data rank] in tnlg.inference.ranks).
    share = work_share(model)
    check_replica_agrees(share, tokenizer, prompts, settings, batch_size)
    # After the replica agrees (collective): every rank then holds the same prompts, so all refuse alike.
    check_prompts(module, tokenizer, prompts, settings)
    with replica_rng(share.replica, model_device(module)):
        if share.count == 1:
            return generate_texts(module, tokenizer, prompts, settings, batch_size)
        return _generate_share(module, tokenizer, prompts, settings, batch_size, share)


def _generate_share(
    module: TNLGForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    settings: GenerationSettings,
    batch_size: int,
    share: WorkShare,
) -> list[str]:
    """`generate_on_ranks` with several data-parallel shares: this rank's, then everyone's gathered."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    start, end = rank_slice(len(prompts), share.index, share.count)
    mine = prompts[start:end]
    # Share 0 is the largest (it starts at 0): every rank runs as many batches as it does.
    largest = rank_slice(len(prompts), 0, share.count)[1]
    batches = -(-largest // batch_size)
    config = generation_config(settings, tokenizer, module)
    completions: list[str] = []
    for index in range(batches):
        batch = mine[index * batch_size : (index + 1) * batch_size]
        if batch:
            completions.extend(generate_batch(module, tokenizer, batch, config, synced_gpus=True))
        else:
            # Out of prompts while the other ranks still gather parameters in every forward: keep
            # stepping with them on a throwaway one-prompt batch.
            generate_batch(module, tokenizer, prompts[:1], config, synced_gpus=True)
    shares: list[list[str] | None] = [None] * share.count
    dist.all_gather_object(shares, completions, group=share.group)
    return [text for share in shares for text in share or []]


def check_replica_agrees(
    share: WorkShare,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    settings: GenerationSettings,
    batch_size: int,
) -> None:
    """Raise ValueError, on every rank of this rank's replica, unless all of them were given the same
    prompts and the same settings (batch size and tokenizer's special ids included): one small
    all-gather of two digests per call. [Note: one stream per replica] in tnlg.inference.ranks"""
    if not share.replica:
        return
    wanted = (repr(settings), batch_size, len(tokenizer), pad_id(tokenizer), tokenizer.eos_token_id)
    digests = torch.tensor([_digest(map(repr, prompts)), _digest([repr(wanted)])])
    found = replica_differs(share.replica, digests)
    differ = [name for name, differs in zip(("prompts", "settings"), found, strict=True) if differs]
    if differ:
        raise ValueError(
            f"generate_on_ranks: the ranks of one tensor-sliced model replica were given different "
            f"{' and different '.join(differ)}: they run every forward pass together, so every rank of a "
            "replica must pass the same prompts, settings and batch_size"
        )


def _digest(parts) -> int:
    """A signed 64-bit digest of the strings `parts`, in order."""
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        hasher.update(part.encode())
        hasher.update(b"\0")  # "ab", "c" and "a", "bc" differ
    return int.from_bytes(hasher.digest(), "little", signed=True)
