"""Training runs: typed configs read from YAML with `--section.key value` overrides, and the loop that
pretraining and fine-tuning share.

- `config` (TrainingConfig's shared sections, RunConfig), `finetune_config` (FinetuneConfig)
- `build` (tokenizer, architecture, model), `optim` (AdamW groups, warmup-cosine schedule)
- `loop` (build_run / train_step / train around a TrainingJob), `pretrain`, `finetune`, `lora`
- `checkpoint` (run checkpoints: engine shards + data position + RNG + schedule + loss curve),
  `output` (the output directory), `metrics` (MFU, loss curve, trackers), `launch_checks`, `cli`

Submodules are imported where used: `import tnlg.run` loads nothing heavy.
"""
