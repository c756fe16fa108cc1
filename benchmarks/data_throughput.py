"""Tokens per second of the two data paths, in one process.

    python -m benchmarks.data_throughput

- streaming: read the embedded corpus (`.jsonl.zst`), tokenize with a trained 8192-token byte-level
  BPE, pack into 2048-token sequences, mix the two subsets, shuffle, batch;
- pre-tokenized: the same corpus prepared into the memory-mapped format, read as batches of
  2048-token sequences in the seeded global order.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

from tnlg.data.corpus import embedded_corpus
from tnlg.data.pretokenized import PretokenizedCorpus, PretokenizedStream, read_texts, write_pretokenized
from tnlg.data.sources import SourceConfig
from tnlg.data.stream import StreamConfig, TokenStream
from tnlg.data.tokenizer import train_byte_level_bpe

SEQ_LEN, BATCH = 2048, 8


def tokens_per_second(stream, batches: int) -> float:
    iterator = iter(stream)
    next(iterator)  # warm-up: first refills, page-ins
    start = time.perf_counter()
    for batch in itertools.islice(iterator, batches):
        assert batch["input_ids"].shape == (BATCH, SEQ_LEN)
    return batches * BATCH * SEQ_LEN / (time.perf_counter() - start)


def main() -> None:
    corpus = embedded_corpus()
    tokenizer = train_byte_level_bpe(itertools.islice(read_texts(corpus.files()), 300), vocab_size=8192)
    sources = tuple(SourceConfig(name=p.name, paths=(str(p),)) for p in corpus.files())
    streaming = TokenStream(
        StreamConfig(sources=sources, seq_len=SEQ_LEN, shuffle_buffer=64), tokenizer, BATCH
    )
    print(f"streaming tokenize + pack + mix + shuffle: {tokens_per_second(streaming, 20):,.0f} tokens/s")
    with tempfile.TemporaryDirectory() as directory:
        prefix = Path(directory) / "corpus"
        write_pretokenized(read_texts(corpus.files()), tokenizer, prefix)
        pretokenized = PretokenizedStream([PretokenizedCorpus(prefix, SEQ_LEN)], [1.0], BATCH, seed=0)
        print(f"pre-tokenized memory-mapped reader: {tokens_per_second(pretokenized, 300):,.0f} tokens/s")


if __name__ == "__main__":
    main()
