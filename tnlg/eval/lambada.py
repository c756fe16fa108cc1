"""LAMBADA-style last-word evaluation (Paperno et al. 2016): accuracy and last-word perplexity, with the
boundaries of lm-evaluation-harness's `lambada_openai` task, so that tnlg's figures and lm-eval's are
the same numbers (tests/eval/test_lm_eval_parity.py compares them passage for passage).

[Note: LAMBADA boundaries]
lm-eval 0.4 defines the task in three places, each followed here:
- the split (tasks/lambada/lambada_openai.yaml, doc_to_text / doc_to_target): the context is the passage
  up to its last space, `" ".join(text.split(" ")[:-1])`, and the target is that space and the last
  word, `" " + text.split(" ")[-1]`: the target's leading space belongs to the target. Only a space
  splits (a line break inside the last "word" stays in it), and nothing is stripped;
- the tokens (api/model.py, TemplateLM._encode_pair): whitespace at the end of the context (a double
  space, a line break before the last space) moves to the start of the target, and the target's tokens
  are those of the whole passage's encoding after the context's own encoding (a BPE may merge across
  the boundary differently than it encodes the target alone);
- the scores (models/huggingface.py, HFLM._loglikelihood_tokens; api/task.py, process_results; api/
  metrics.py): the target's log-likelihood is the sum of its tokens' log-probabilities, one
  teacher-forced pass; it is "greedy" (accuracy) when the argmax at each of its positions is its next
  token, i.e. greedy decoding would produce it; perplexity is exp(-mean over passages of that summed
  log-likelihood): a mean per passage, not per token. A passage longer than the model's positions
  keeps its last `max_length + 1` tokens (the last one is predicted, not fed).

lm-eval feeds a context that is empty (a passage with no space) as the BOS token alone, and fails on
one that is only whitespace; here both are refused by name, as is an empty last word (a passage that
ends with a space): they are damaged rows, not LAMBADA passages.

With a process group each data rank scores a contiguous share of the passages (a tensor-sliced
replica's ranks the same ones); a rank with a shorter share
repeats one with no weight (under ZeRO stage 3 every forward is collective), and the sums are all-reduced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tnlg.inference.ranks import all_ranks_sum, model_device, rank_share, work_share


@dataclass(frozen=True)
class PassageScore:
    loglikelihood: float  # the target's summed log-probability, in nats
    greedy: bool  # every target token is the argmax after its prefix


@dataclass(frozen=True)
class LastWordResult:
    correct: int  # passages whose target is greedy
    total: int
    loglikelihood: float = 0.0  # summed over the passages, in nats

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError(f"last-word accuracy over {self.total} passages: nothing was evaluated")

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / self.total

    @property
    def perplexity(self) -> float:
        """lm-eval's "perplexity" aggregation: exp of minus the mean per-passage log-likelihood."""
        return math.exp(-self.loglikelihood / self.total)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "accuracy": self.accuracy,
            "perplexity": self.perplexity,
            "correct": self.correct,
            "total": self.total,
        }


def split_last_word(passage: str) -> tuple[str, str]:
    """(context, target): the passage cut at its last space, the space kept with the target (see
    [Note: LAMBADA boundaries])."""
    context, space, word = passage.rpartition(" ")
    if not space or not context.strip():
        raise ValueError(f"passage has no context before its last word: {passage[:80]!r}")
    if not word:
        raise ValueError(f"passage ends with a space, so its last word is empty: {passage[-80:]!r}")
    return context, space + word


def encode_passage(tokenizer, passage: str) -> tuple[list[int], list[int]]:
    """(context ids, target ids), tokenized as lm-eval's HFLM does (see [Note: LAMBADA boundaries])."""
    context, target = split_last_word(passage)
    trailing = len(context) - len(context.rstrip())
    if trailing:
        context, target = context[:-trailing], context[-trailing:] + target
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(context + target, add_special_tokens=False)["input_ids"][len(context_ids) :]
    if not context_ids or not target_ids:
        raise ValueError(f"passage tokenizes to an empty context or target: {passage[:80]!r}")
    return context_ids, target_ids


def check_last_word_fits(target_ids: Sequence[int], max_length: int | None) -> None:
    """ValueError unless the last word's tokens fit `max_length` positions (None: any length)."""
    if max_length is not None and len(target_ids) > max_length:
        raise ValueError(f"a last word of {len(target_ids)} tokens does not fit {max_length} positions")


@torch.no_grad()
def score_passage(
    model: nn.Module,
    context_ids: Sequence[int],
    target_ids: Sequence[int],
    *,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> PassageScore:
    """The target's log-likelihood after the context, and whether greedy decoding produces it; the
    input keeps its last `max_length` tokens (None: all of them)."""
    check_last_word_fits(target_ids, max_length)
    device = torch.device(device) if device is not None else model_device(model)
    tokens = list(context_ids) + list(target_ids)
    if max_length is not None:
        tokens = tokens[-(max_length + 1) :]
    ids = torch.tensor([tokens[:-1]], device=device)  # the last token is predicted, never fed
    logits = model(input_ids=ids, use_cache=False).logits[0, -len(target_ids) :]  # (N, V): t predicts t + 1
    log_probs = F.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids, device=device)
    loglikelihood = log_probs.gather(1, targets[:, None]).sum().item()
    return PassageScore(loglikelihood, bool(torch.equal(log_probs.argmax(-1), targets)))


def last_word_scores(
    model: nn.Module,
    tokenizer,
    passages: Sequence[str],
    *,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> LastWordResult:
    """Accuracy and last-word perplexity over `passages` (every rank returns the totals)."""
    encoded = [encode_passage(tokenizer, passage) for passage in passages]
    return encoded_last_word_scores(model, encoded, max_length=max_length, device=device)


def encoded_last_word_scores(
    model: nn.Module,
    encoded: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> LastWordResult:
    """`last_word_scores` of passages already encoded, (context ids, target ids) each."""
    if not encoded:
        raise ValueError("no passages to evaluate")
    device = torch.device(device) if device is not None else model_device(model)
    totals = torch.zeros(2, dtype=torch.float64)  # [greedy passages, summed log-likelihood]
    share = work_share(model)  # by data rank: the ranks of a sliced replica run each passage together
    for (context_ids, target_ids), weight in rank_share(list(encoded), share):
        score = score_passage(model, context_ids, target_ids, max_length=max_length, device=device)
        if weight:  # a repeat only keeps this rank in step (0 * a log-likelihood of -inf would be nan)
            totals += torch.tensor([float(score.greedy), score.loglikelihood], dtype=torch.float64)
    totals = all_ranks_sum(totals, share)
    return LastWordResult(round(totals[0].item()), len(encoded), totals[1].item())
