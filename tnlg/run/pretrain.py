"""Pretraining: the run loop (tnlg.run.loop) on a packed token stream, evaluated by validation perplexity.

The stream is the configured corpora (`data.sources`, streamed and packed; or `data.pretokenized`
memmaps), else the embedded default corpus; the validation perplexity reads `data.validation_sources`
(the embedded corpus's validation split by default; none when a corpus is configured without them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from tnlg.data.corpus import embedded_corpus
from tnlg.data.pretokenized import PretokenizedCorpus, PretokenizedStream
from tnlg.data.sources import SourceConfig
from tnlg.data.stream import StreamConfig, TokenStream
from tnlg.eval.perplexity import batch_perplexity
from tnlg.run.config import DataSection, RunConfig
from tnlg.run.loop import TrainingJob, pipeline_micro_batches, train
from tnlg.sharding import ZeroEngine


def pretrain(config: RunConfig, resume: str | None = None) -> dict[str, Any]:
    """Train per `config`; returns the losses logged (main process) and where the model was saved."""
    job = TrainingJob(
        name="pretraining",
        seq_len=config.data.seq_len,
        tokenizer=config.data.tokenizer,
        batches=lambda tokenizer, rank, world: training_stream(config, tokenizer, rank, world),
        evaluate=lambda model, tokenizer, accelerator: evaluate(config, model, tokenizer, accelerator),
    )
    return train(config, job, resume)


def evaluate(config: RunConfig, engine: ZeroEngine, tokenizer, accelerator) -> dict[str, float]:
    """The validation perplexity over `train.eval_batches` batches per data replica (none without
    validation sources); the ranks of one tensor group and pipeline read the same batches."""
    settings = stream_config(config.data, config.train.seed, "validation")
    if settings is None:
        return {}
    rank, world = accelerator.data_parallel_rank, accelerator.data_parallel_size
    stream = TokenStream(settings, tokenizer, config.train.micro_batch_size, rank, world)
    if engine.pipeline is not None:
        return {"eval_perplexity": pipeline_perplexity(engine, stream, config.train.eval_batches)}
    return {"eval_perplexity": batch_perplexity(engine, stream, config.train.eval_batches, accelerator)}


def pipeline_perplexity(engine: ZeroEngine, batches: Iterable[dict], max_batches: int) -> float:
    """`batch_perplexity` under pipeline stages, where no rank can run the whole model: the first
    `max_batches` batches go through the stages as the micro-batches of one forward-only schedule
    (`engine.eval_batch`, whose mean loss is over the batches and the data replicas)."""
    loaded = [batch for batch, _ in zip(batches, range(max_batches), strict=False)]
    if not loaded:  # every rank reads the same validation sources: all of them stop here together
        raise ValueError("the validation sources yielded no batch to evaluate (train.eval_batches > 0)")
    micro_batches = pipeline_micro_batches(loaded, engine.parallel.dims.pipeline)
    engine.eval()
    try:
        loss = engine.eval_batch(micro_batches)
    finally:
        engine.train()
    return math.exp(loss.item())


def stream_config(data: DataSection, seed: int, split: str) -> StreamConfig | None:
    sections = data.sources if split == "train" else data.validation_sources
    if sections:
        # The config section has SourceConfig's fields (lists where SourceConfig keeps tuples).
        sources = tuple(SourceConfig(**{**dataclasses.asdict(s), "paths": tuple(s.paths)}) for s in sections)
    elif split == "validation" and not data.has_validation_text:
        return None  # a configured corpus without validation sources: no evaluation on unrelated text
    else:
        sources = tuple(
            SourceConfig(name=p.name.split(".")[0], paths=(str(p),)) for p in embedded_corpus().files(split)
        )
    buffer = data.shuffle_buffer if split == "train" else 1
    return StreamConfig(
        sources=sources,
        seq_len=data.seq_len,
        seed=seed,
        shuffle_buffer=buffer,
        on_bad_record=data.on_bad_record,
    )


def training_stream(config: RunConfig, tokenizer, rank: int, world: int):
    """Pre-tokenized corpora when configured, else the streaming pipeline."""
    data, train = config.data, config.train
    if data.pretokenized:
        corpora = [PretokenizedCorpus(p.prefix, data.seq_len) for p in data.pretokenized]
        for corpus in corpora:
            corpus.check_tokenizer(tokenizer)  # [Note: corpus tokenizer] in tnlg/data/pretokenized.py
        weights = [p.weight for p in data.pretokenized]
        return PretokenizedStream(corpora, weights, train.micro_batch_size, train.seed, rank, world)
    return TokenStream(
        stream_config(data, train.seed, "train"), tokenizer, train.micro_batch_size, rank, world
    )
