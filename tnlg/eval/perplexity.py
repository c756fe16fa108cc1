"""Model evaluations: sliding-window perplexity (and bits per byte), and the in-run validation perplexity
(LAMBADA-style last-word accuracy and perplexity are in tnlg.eval.lambada).

[Note: every token scored]
Perplexity scores every token of the text, as lm-eval's rolling log-likelihood does (the figure its
wikitext task reports): the stream is the text's tokens after one prefix token (the tokenizer's BOS, else
its EOS, lm-eval's `prefix_token_id`), so the text's first token is predicted from it. Windows of
`max_length` input tokens advance by `stride`, and each window scores the tokens the previous one did not:
up to `max_length` of them, the first with `max_length - stride + 1` tokens of context or more (at least
one, with `stride == max_length`: each window's inputs start at the previous window's last target). The
last window starts `max_length` inputs before the end, so its tokens have as much context as fits. With
`stride == max_length` the windows are lm-eval's, token for token (tests/eval/test_lm_eval_parity.py).
Bits per byte divide the summed NLL (in bits) of every token by the text's UTF-8 bytes: the numerator
and the denominator cover the same text, which makes models with different tokenizers comparable.

Until this was so, the first token of each window (of the stream, with disjoint windows) had no context
and was not scored while bits per byte counted every byte: about 1/max_length too low.

Sliding-window perplexity runs distributed when a process group exists: each data rank takes a
contiguous share of the windows (the ranks of a tensor-sliced replica take the same ones, [Note:
evaluation by data rank] in tnlg.inference.ranks), ranks with a shorter share repeat one with no weight (so that under ZeRO stage 3,
where every forward pass is collective, all ranks run as many), and the sums are all-reduced.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tnlg.inference.ranks import all_ranks_sum, model_device, rank_share, work_share


@dataclass(frozen=True)
class PerplexityResult:
    nll: float  # summed negative log-likelihood of the scored tokens (every token of the text), in nats
    tokens: int  # tokens scored
    bytes: int | None = None  # UTF-8 bytes of the text (of the scored tokens), when known

    def __post_init__(self) -> None:
        if self.tokens <= 0:  # exp(0 / 0) would be reported as a perplexity of nan
            raise ValueError(f"perplexity over {self.tokens} scored tokens: nothing was evaluated")

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else self.nll / math.log(2) / self.bytes

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "perplexity": self.perplexity,
            "nll_per_token": self.nll / self.tokens,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
        }


def sliding_windows(tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window over a stream of `tokens` tokens whose token 0 is the
    prefix: the window feeds tokens [begin, end - 1) and scores [first, end) (see [Note: every token
    scored])."""
    windows, begin, scored_until = [], 0, 1  # the prefix, token 0, is context only
    while scored_until < tokens:
        end = min(begin + max_length + 1, tokens)
        if end == tokens:  # the last window: as much context as fits
            begin = max(0, end - max_length - 1)
        windows.append((begin, end, scored_until))
        scored_until = end
        begin += stride
    return windows


@torch.no_grad()
def perplexity(
    model: nn.Module,
    token_ids: Sequence[int] | torch.Tensor,
    *,
    max_length: int,
    prefix_token_id: int,
    stride: int | None = None,
    text_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of every token of a text (see [Note: every token scored]), the first
    predicted from `prefix_token_id`. With a process group, each rank scores a contiguous share of the
    windows and every rank returns the total."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    stride = max_length if stride is None else stride
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (a token and its context), got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}], got {stride}")
    if ids.numel() < 1:
        raise ValueError("the text has no token: nothing to score")
    device = torch.device(device) if device is not None else model_device(model)
    stream = torch.cat([torch.tensor([prefix_token_id], dtype=torch.long), ids])
    totals = torch.zeros(2, dtype=torch.float64)  # [summed NLL, tokens scored]
    share = work_share(model)  # by data rank: the ranks of a sliced replica run each window together
    for (begin, end, first), weight in rank_share(sliding_windows(stream.numel(), max_length, stride), share):
        window = stream[begin : end - 1].to(device)[None]  # (1, W): input t predicts token t + 1
        # (W, V); no KV cache, which scoring would throw away
        logits = model(input_ids=window, use_cache=False).logits[0]
        log_probs = F.log_softmax(logits[first - begin - 1 :].float(), dim=-1)
        targets = stream[first:end].to(device)
        nll = -log_probs.gather(1, targets[:, None]).sum().item()
        totals += weight * torch.tensor([nll, targets.numel()], dtype=torch.float64)
    totals = all_ranks_sum(totals, share)
    return PerplexityResult(totals[0].item(), int(totals[1].item()), text_bytes)


@torch.no_grad()
def batch_perplexity(model: nn.Module, batches: Iterable[dict], max_batches: int, accelerator) -> float:
    """exp(mean loss) over the first `max_batches` of `batches` on every rank, averaged over the ranks
    (`accelerator.reduce`): the validation perplexity a run reports every `train.eval_every` steps. The
    batches are packed rows of one length, so the mean of the batch means is the mean token loss."""
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), 0
    for batch, _ in zip(batches, range(max_batches), strict=False):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        total += model(**batch).loss
        count += 1
    model.train()
    if count == 0:  # every rank reads the same validation sources, so all of them stop here together
        raise ValueError("the validation sources yielded no batch to evaluate (train.eval_batches > 0)")
    return math.exp(accelerator.reduce(total / count, "mean").item())
