"""Evaluation: perplexity (sliding window, bits per byte; the in-run validation perplexity), LAMBADA-style
last-word accuracy, the task metrics of fine-tuning (`tasks`: the references' loss and ROUGE or SQuAD
EM / F1 of generated answers; `text_metrics`), and `suite`, what scripts/evaluate.py runs on a saved
checkpoint."""
