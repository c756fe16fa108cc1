"""Evaluation: perplexity (sliding window, bits per byte; the in-run validation perplexity), LAMBADA-style
last-word accuracy and perplexity with lm-eval's boundaries (`lambada`), the task metrics of fine-tuning
(`tasks`: the references' loss and ROUGE or SQuAD EM / F1 of generated answers; `text_metrics`), `suite`,
what scripts/evaluate.py runs on a saved checkpoint, and `harness`, lm-evaluation-harness in process."""
