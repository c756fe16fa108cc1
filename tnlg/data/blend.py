"""Blending corpora by weight: the weights' check, the deficit rule, and its counts before any sample.

[Note: the deficit rule]
Sample n of a blend goes to the corpus furthest below its share of the samples so far (this one
included): `argmax(shares * (n + 1) - counts)`, the first corpus on a tie (Megatron's blending rule).
The mix is then exact at every prefix, not only in expectation. The streamed `Mixture` (packing.py)
and the pre-tokenized stream (pretokenized.py) both choose with `next_corpus`, and the float
expression is part of the rule: its rounding breaks near-ties, and a saved data position, like the
committed loss baseline, means the order it gives.

[Note: blend counts at any index]
A stream resumed at global sample N needs the rule's counts before N. No closed form gives them: a
corpus's count depends on the other corpora's shares too, not on its own share and N alone (weights
5:3:2 and 5:4:1 give the first corpus 1 and 2 of the first three samples), and the rounding
of `shares * (n + 1)` decides near-ties. So the rule is run, but as segments side by side in numpy
(`counts_before`): the first segment starts from the known counts, every later one `overlap` samples
before its own part, from an estimate (the shares of its first sample, rounded). Two runs of the rule
come together: where they choose differently, the one further ahead on a corpus is the one that does
not take it, so their difference never grows, and in practice it is gone within a few
1 / smallest-share samples.
A segment is taken only when its counts at its predecessor's end equal that end's counts (from there
it runs the rule from the true counts, so its own end is true); at the first segment that has not
met its predecessor, the verified point is the new start and the rest is run again with twice the
overlap. The result is exact whatever the weights; meeting fast is what makes it cheap.

Cost of the counts before sample N: about N x corpora element operations in numpy, in about
N / SEGMENTS + overlap Python steps (N >= SEGMENTS x 4 x overlap), against N Python steps for a
replay from 0 (on one CPU core, seconds for 10^8 samples of a few corpora, where the replay took
minutes); a short distance (below about 10 x overlap) is replayed. Not O(corpora): linear in N, and
at worst, were segments never to meet, about log2(N / overlap) times that.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

SEGMENTS = 4096  # segments run side by side: wide enough that numpy, not Python, sets the pace
MIN_SEGMENT = 256  # samples a segment owns at least: shorter ones would be mostly overlap


def check_weight(owner: str, weight: float, hint: str = "") -> None:
    """A mixture weight must be a finite number > 0: a corpus weighted 0 or less is never sampled, and
    a NaN or infinite one makes every share NaN (or 0), so that the rule starves the other corpora."""
    is_number = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
    if not (is_number and math.isfinite(weight) and weight > 0):
        raise ValueError(f"{owner}: weight must be a finite number > 0, got {weight!r}{hint}")


def blend_shares(weights: Sequence[float]) -> np.ndarray:
    """Each corpus's share of the samples (the weights, checked by `check_weight`, normalised)."""
    total = float(sum(weights))
    return np.asarray([w / total for w in weights])


def next_corpus(shares: np.ndarray, sample: int, counts: np.ndarray) -> int:
    """The corpus of sample `sample`, given the counts of the samples before it ([Note: the deficit rule])."""
    return int(np.argmax(shares * (sample + 1) - counts))


def replay(shares: np.ndarray, counts: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The counts before `stop`, given `counts` before `start`: the rule run sample by sample."""
    counts = counts.copy()
    for sample in range(start, stop):
        counts[next_corpus(shares, sample, counts)] += 1
    return counts


def counts_before(
    shares: np.ndarray,
    index: int,
    start: int = 0,
    counts: np.ndarray | None = None,
    *,
    overlap: int | None = None,
) -> np.ndarray:
    """The rule's counts before sample `index`, given `counts` before `start` (none: start at 0), exactly
    as a replay gives them, in segments side by side ([Note: blend counts at any index])."""
    if index < start:
        raise ValueError(f"the counts before sample {index} cannot be found from those before {start}")
    counts = np.zeros(len(shares), dtype=np.int64) if counts is None else np.asarray(counts, np.int64)
    overlap = overlap or first_overlap(shares)
    while start < index:
        start, counts = _advance(shares, start, counts, index, overlap)
        overlap *= 2  # only used again when a segment did not meet its predecessor
    return counts


def first_overlap(shares: np.ndarray) -> int:
    """Samples a segment runs before its own part: two runs of the rule meet within a few times the
    smallest corpus's period (1 / its share), since each corpus's difference settles when it is chosen."""
    return 64 + math.ceil(8 / float(shares.min()))


def _advance(
    shares: np.ndarray, start: int, counts: np.ndarray, stop: int, overlap: int
) -> tuple[int, np.ndarray]:
    """(sample, counts before it) as far toward `stop` as the segments verify."""
    length = max(4 * overlap, MIN_SEGMENT, -(-(stop - start) // SEGMENTS))
    steps = length + overlap  # what every segment runs: its overlap, then the `length` samples it owns
    if stop - start < 2 * steps:
        return stop, replay(shares, counts, start, stop)
    later = 1 + (stop - start - steps) // length
    # Segment 0 starts at `start`; the last one ends at `stop`; each later one reaches its predecessor's
    # end after at least `overlap` samples (segment 1 after between overlap and `steps`).
    begins = np.asarray([start, *(stop - steps - length * np.arange(later - 1, -1, -1))], dtype=np.int64)
    state = np.vstack([counts, estimate(shares, begins[1:])])
    meets = begins[:-1] + steps - begins[1:]  # the step at which segment j + 1 is where segment j ends
    met = _run_segments(shares, begins, state, steps, meets)
    joined = (met == state[:-1]).all(axis=1)
    if joined.all():
        return stop, state[-1].copy()
    first = int(np.argmin(joined))  # segments 0..first are true: the later ones start over from there
    return int(begins[first]) + steps, state[first].copy()


def _run_segments(
    shares: np.ndarray, begins: np.ndarray, state: np.ndarray, steps: int, meets: np.ndarray
) -> np.ndarray:
    """Run every segment `steps` samples in place; the counts of segment j + 1 at step meets[j]."""
    met = np.empty_like(state[1:])
    at_step: dict[int, list[int]] = {}
    for later, step in enumerate(meets.tolist()):
        at_step.setdefault(step, []).append(later)
    rows = np.arange(len(state))
    after = begins[:, None] + 1  # n + 1 for each segment's next sample n: `next_corpus`'s float expression
    for step in range(steps + 1):
        for later in at_step.get(step, ()):
            met[later] = state[later + 1]
        if step < steps:
            state[rows, np.argmax(shares * after - state, axis=1)] += 1
            after += 1
    return met


def estimate(shares: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Counts summing to each of `samples`, near the shares: a start the rule pulls onto its own counts
    (each corpus's share rounded down, the rest to the largest remainders)."""
    ideal = shares * samples[:, None]
    counts = np.floor(ideal).astype(np.int64)
    short = samples - counts.sum(axis=1)  # 0..corpora: what rounding down left out
    order = np.argsort(counts - ideal, axis=1, kind="stable")  # largest remainder first
    ranks = np.argsort(order, axis=1, kind="stable")
    return counts + (ranks < short[:, None])
