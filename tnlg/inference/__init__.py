"""Inference: how to decode (`settings`: GenerationSettings, importable by config code without the
model), loading a checkpoint with its tokenizer and generating (`generation`), generation sharded by
the ZeRO engine across launched ranks (`distributed`), and the split of evaluation or generation work
across ranks (`ranks`). Imports run one way: data <- inference <- eval <- run."""
