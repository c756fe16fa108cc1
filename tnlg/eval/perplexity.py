"""Model evaluations: sliding-window perplexity (and bits per byte), and the in-run validation perplexity
(LAMBADA-style last-word accuracy and perplexity are in tnlg.eval.lambada).

Perplexity follows the WikiText-103 practice (Transformers' "Perplexity of fixed-length models"): the
text is one token stream; windows of `max_length` tokens advance by `stride`, and each window scores
only the tokens the previous one did not, each with up to `max_length - 1` tokens of context. With
`stride == max_length` the windows are disjoint and the first token of each has no context in it, so it
is not scored (as in Transformers' recipe); neither is the stream's first token. Bits per byte divide the summed NLL (in bits) by the text's UTF-8 bytes, which makes
models with different tokenizers comparable.

Sliding-window perplexity runs distributed when a process group exists: each rank takes a contiguous
share of the windows, ranks with a shorter share repeat one with no weight (so that under ZeRO stage 3,
where every forward pass is collective, all ranks run as many), and the sums are all-reduced.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tnlg.inference.ranks import all_ranks_sum, model_device, rank_share


@dataclass(frozen=True)
class PerplexityResult:
    nll: float  # summed negative log-likelihood of the scored tokens, in nats
    tokens: int  # tokens scored
    bytes: int | None = None  # UTF-8 bytes of the text, when known

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
    """(begin, end, first scored) of each window over a stream of `tokens` tokens."""
    windows, begin, scored_until = [], 0, 1  # tokens before scored_until are scored (token 0 never is)
    while True:
        end = min(begin + max_length, tokens)
        # a window's first token has no context in it: its scored targets start one later at least
        first = max(scored_until, begin + 1)
        if first < end:
            windows.append((begin, end, first))
        scored_until = end
        if end == tokens:
            return windows
        begin += stride


@torch.no_grad()
def perplexity(
    model: nn.Module,
    token_ids: Sequence[int] | torch.Tensor,
    *,
    max_length: int,
    stride: int | None = None,
    text_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of a token stream (see the module docstring). With a process group,
    each rank scores a contiguous share of the windows and every rank returns the total."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    stride = max_length if stride is None else stride
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (a token and its context), got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be in [1, max_length={max_length}], got {stride}")
    if ids.numel() < 2:
        raise ValueError(f"the text has {ids.numel()} token(s): perplexity needs at least 2")
    device = torch.device(device) if device is not None else model_device(model)
    windows = sliding_windows(ids.numel(), max_length, stride)
    totals = torch.zeros(2, dtype=torch.float64)  # [summed NLL, tokens scored]
    for (begin, end, first), weight in rank_share(windows):
        window = ids[begin:end].to(device)[None]  # (1, W)
        # (W, V): position t predicts token t + 1; no KV cache, which scoring would throw away
        logits = model(input_ids=window, use_cache=False).logits[0]
        log_probs = F.log_softmax(logits[first - begin - 1 : end - begin - 1].float(), dim=-1)
        targets = window[0, first - begin : end - begin]
        nll = -log_probs.gather(1, targets[:, None]).sum().item()
        totals += weight * torch.tensor([nll, targets.numel()], dtype=torch.float64)
    totals = all_ranks_sum(totals)
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
