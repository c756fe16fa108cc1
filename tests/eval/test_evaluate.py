"""Evaluations: sliding-window perplexity equals exp(mean NLL) computed directly, token by token;
last-word accuracy needs every token of the word, split at the last space as lm-eval splits it (the
passage-for-passage comparison with lm-eval is tests/eval/test_lm_eval_parity.py); SQuAD EM/F1 and
ROUGE match hand-computed values."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tnlg.eval.lambada import encode_passage, last_word_scores, split_last_word
from tnlg.eval.perplexity import perplexity
from tnlg.eval.tasks import predictions_for
from tnlg.eval.text_metrics import normalize_answer, rouge_scores, squad_scores, token_f1


@pytest.fixture
def tokens():
    return torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(0)).tolist()


PREFIX = 511  # the token the text's first token is predicted from (a tokenizer's BOS or EOS)


def test_perplexity_of_one_window_is_exp_of_the_models_mean_loss(debug_model, tokens):
    ids = torch.tensor([[PREFIX, *tokens]])
    mean_nll = debug_model(input_ids=ids, labels=ids).loss.item()  # Transformers' own shifted loss
    result = perplexity(debug_model, tokens, max_length=64, prefix_token_id=PREFIX)
    assert result.tokens == len(tokens)  # every token, the first predicted from the prefix
    assert result.perplexity == pytest.approx(math.exp(mean_nll), rel=1e-5)


@pytest.mark.parametrize("stride", [5, 16])  # overlapping windows, and windows that share one token
def test_sliding_window_scores_every_token_once_with_its_windows_context(debug_model, tokens, stride):
    max_length = 16
    result = perplexity(debug_model, tokens, max_length=max_length, stride=stride, prefix_token_id=PREFIX)
    # Brute force over the stream [PREFIX, *tokens]: token t is scored by the first window that predicts
    # it (window k feeds [k * stride, k * stride + max_length) and predicts up to one token past it),
    # with that window's inputs before it as context; the last window feeds the last max_length tokens.
    stream = [PREFIX, *tokens]
    last = max(0, len(stream) - 1 - max_length)
    nll = 0.0
    for t in range(1, len(stream)):
        k = next(k for k in range(len(stream)) if k * stride + max_length >= t)
        begin = k * stride if k * stride + max_length < len(stream) - 1 else last
        logits = debug_model(input_ids=torch.tensor([stream[begin:t]])).logits[0, -1]
        nll -= F.log_softmax(logits.float(), dim=-1)[stream[t]].item()
    assert result.tokens == len(tokens)
    assert result.nll == pytest.approx(nll, rel=1e-5)


def test_bits_per_byte_cover_the_scored_tokens_and_bad_arguments(debug_model, tokens):
    result = perplexity(debug_model, tokens, max_length=8, text_bytes=200, prefix_token_id=PREFIX)
    whole = perplexity(debug_model, tokens, max_length=64, text_bytes=200, prefix_token_id=PREFIX)
    assert result.tokens == whole.tokens == len(tokens)  # the same tokens however the text is cut
    assert result.bits_per_byte == pytest.approx(result.nll / math.log(2) / 200)
    assert result.as_dict()["tokens"] == len(tokens)
    with pytest.raises(ValueError, match="stride must be in"):
        perplexity(debug_model, tokens, max_length=8, stride=9, prefix_token_id=PREFIX)
    with pytest.raises(ValueError, match="no token: nothing to score"):
        perplexity(debug_model, [], max_length=8, prefix_token_id=PREFIX)


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class MemorizedText(nn.Module):
    """Greedy decoding continues `text` (whose characters are all different) wherever it is in it."""

    def __init__(self, text: str):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))
        self.following = {ord(a): ord(b) for a, b in itertools.pairwise(text)}

    def forward(self, input_ids, use_cache=None):
        assert use_cache is False  # scoring asks a causal LM for no KV cache: it would be thrown away
        logits = torch.zeros(*input_ids.shape, 256)
        for position, token in enumerate(input_ids[0].tolist()):
            logits[0, position, self.following.get(token, 0)] = 1.0
        return SimpleNamespace(logits=logits)


def test_last_word_accuracy_needs_every_token_of_the_word():
    model = MemorizedText("xyz abc")
    passages = ["xyz abc", "xyz abd", "xyz ab", "xy zab"]  # right; last token wrong; right; wrong start
    result = last_word_scores(model, CharTokenizer(), passages)
    assert (result.correct, result.total) == (2, 4)
    assert result.accuracy == 50.0
    # Each logit row is one 1.0 among 255 zeros: a hit scores log(e / (e + 255)), a miss log(1 / (e + 255)).
    hit, miss = 1 - math.log(math.e + 255), -math.log(math.e + 255)
    # " abc": 4 hits; " abd": its last token missed; " ab": 3 hits; " zab" after "xy": only "b" after "a"
    loglikelihood = 4 * hit + (3 * hit + miss) + 3 * hit + (3 * miss + hit)
    assert math.log(result.perplexity) == pytest.approx(-loglikelihood / 4, rel=1e-6)  # float32 logits


def test_the_last_word_is_split_at_the_last_space_as_lm_eval_splits_it():
    # The target keeps its leading space; only a space splits; nothing is stripped.
    assert split_last_word("a b\ncd") == ("a", " b\ncd")
    assert split_last_word("the end.\n") == ("the", " end.\n")
    # Whitespace ending the context moves to the target (lm-eval's TemplateLM._encode_pair).
    assert encode_passage(CharTokenizer(), "one two  three") == (
        [ord(c) for c in "one two"],
        [ord(c) for c in "  three"],
    )
    assert encode_passage(CharTokenizer(), "one\n last") == (
        [ord(c) for c in "one"],
        [ord(c) for c in "\n last"],
    )
    with pytest.raises(ValueError, match="no context"):
        split_last_word("lonely")
    with pytest.raises(ValueError, match="no context"):
        split_last_word("  lonely")
    with pytest.raises(ValueError, match="ends with a space"):
        split_last_word("a b ")


def test_squad_exact_match_and_f1_match_hand_computed_values():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert token_f1("Paris, France", ["Paris"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    scores = squad_scores(
        ["the Eiffel Tower", "Paris, France", "1889"],
        [["Eiffel Tower"], ["Paris"], ["in 1889", "1889"]],  # best of several answers
    )
    assert scores["exact_match"] == pytest.approx(100 * 2 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1) / 3)
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        squad_scores(["a", "b"], [["a"]])


def test_rouge_matches_hand_computed_values():
    scores = rouge_scores(["the cat sat on the mat"], ["the cat is on the mat"])
    # unigrams: 5 of 6 shared; bigrams: 3 of 5 (the-cat, on-the, the-mat); LCS "the cat on the mat": 5
    assert scores["rouge1"] == pytest.approx(100 * 5 / 6)
    assert scores["rouge2"] == pytest.approx(100 * 3 / 5)
    assert scores["rougeL"] == pytest.approx(100 * 5 / 6)
    assert scores["rougeLsum"] == scores["rougeL"]  # one line: the same
    assert rouge_scores(["a b", "c"], ["a b", "d"])["rouge1"] == pytest.approx(50.0)


def test_a_multi_line_reference_is_scored_against_the_whole_generation():
    # the first line alone was scored against a whole multi-line reference: a perfect copy scored ~56
    reference = "The cat sat.\nIt was on the mat.\nThen it left."
    completions = [f" {reference}\n", " The cat sat.\nand then some rambling"]
    assert predictions_for(completions, [[reference], [reference]]) == [reference, completions[1].strip()]
    assert rouge_scores(predictions_for(completions[:1], [[reference]]), [reference])["rougeLsum"] == 100.0
    # one-line references: the generation's first line, as before
    assert predictions_for([" Return a file.\nimport os"], [["Return a file."]]) == ["Return a file."]
