"""Text metrics of the evaluations: SQuAD exact match and F1, and ROUGE-1/2/L.

SQuAD's normalisation is the official v1.1 evaluation script's (Rajpurkar et al. 2016): lower case,
punctuation removed, the articles "a", "an", "the" removed, whitespace collapsed; a prediction is
scored against each of its reference answers and keeps the best. ROUGE is Google's `rouge-score`
package (a re-implementation of ROUGE-1.5.5) with Porter stemming, F-measures averaged over examples.
All scores are percentages.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

# rougeLsum: the LCS line by line (rouge-score splits at "\n"), the usual ROUGE-L for multi-line summaries
# (CNN/DailyMail's highlights); on one-line texts it equals rougeL.
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """The SQuAD v1.1 script's `normalize_answer`."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(answer) for answer in answers)


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """The best token-overlap F1 of `prediction` against any of `answers` (0..1)."""
    return max(_f1(normalize_answer(prediction).split(), normalize_answer(a).split()) for a in answers)


def _f1(predicted: list[str], reference: list[str]) -> float:
    common = Counter(predicted) & Counter(reference)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(reference)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """{"exact_match", "f1"} in percent over the examples; each reference is a list of answers."""
    _check_pairs(predictions, references)
    if any(len(answers) == 0 for answers in references):
        raise ValueError("every question needs at least one reference answer")
    n = len(predictions)
    return {
        "exact_match": 100.0
        * sum(exact_match(p, r) for p, r in zip(predictions, references, strict=True))
        / n,
        "f1": 100.0 * sum(token_f1(p, r) for p, r in zip(predictions, references, strict=True)) / n,
    }


def rouge_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L/Lsum F-measures in percent (`rouge-score`, Porter stemming)."""
    _check_pairs(predictions, references)
    try:
        from rouge_score import rouge_scorer
    except ImportError as error:
        raise ImportError("ROUGE needs the rouge-score package: pip install rouge-score") from error
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        # rouge-score's argument order is (target, prediction)
        for kind, score in scorer.score(reference, prediction).items():
            totals[kind] += score.fmeasure
    return {kind: 100.0 * total / len(predictions) for kind, total in totals.items()}


def _check_pairs(predictions: Sequence, references: Sequence) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("no examples to score")
