"""The blend's counts before any sample are exactly the deficit rule's, replayed sample by sample, and a
stream resumed far into its data gets them without replaying from 0 ([Note: blend counts at any
index] in tnlg/data/blend.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tnlg.data import blend
from tnlg.data.pretokenized import PretokenizedCorpus, PretokenizedStream, write_pretokenized
from tnlg.data.tokenizer import byte_level_tokenizer

WEIGHTS = {
    "two": [2.0, 1.0],
    "equal, a tie every step": [1.0, 1.0, 1.0],
    "integers": [5, 3, 2],
    "awkward floats": [3.7, 1.1, 0.013, 2.9],
    "tenths that do not add up": [0.1, 0.2, 0.1 + 0.2, 1 / 3],
    "a tiny corpus": [1e-3, 1.0, 1.0],
    "fifteen random": (np.random.default_rng(0).random(15) + 0.01).tolist(),
}
SAMPLES = 12_000


def replayed(shares: np.ndarray, stop: int) -> np.ndarray:
    """The reference: the counts before each sample 0..stop, the rule run one sample at a time."""
    counts = np.zeros(len(shares), dtype=np.int64)
    before = np.empty((stop + 1, len(shares)), dtype=np.int64)
    before[0] = counts
    for n in range(stop):
        counts[int(np.argmax(shares * (n + 1) - counts))] += 1
        before[n + 1] = counts
    return before


@pytest.fixture
def small_segments(monkeypatch):
    """Segments small enough that these sample counts are split, and a count of the segmented runs."""
    monkeypatch.setattr(blend, "SEGMENTS", 16)
    monkeypatch.setattr(blend, "MIN_SEGMENT", 8)
    runs = []
    run_segments = blend._run_segments
    monkeypatch.setattr(blend, "_run_segments", lambda *args: runs.append(1) or run_segments(*args))
    return runs


@pytest.mark.parametrize("weights", WEIGHTS.values(), ids=WEIGHTS)
def test_counts_before_any_sample_are_the_replayed_rules(weights, small_segments):
    shares = blend.blend_shares(weights)
    reference = replayed(shares, SAMPLES)
    indices = [0, 1, SAMPLES, *np.random.default_rng(1).integers(0, SAMPLES, 25).tolist()]
    # overlap 1 and 3: most segments have not met their predecessor, and are run again from there
    for overlap in (None, 1, 3):
        for index in indices:
            assert (blend.counts_before(shares, index, overlap=overlap) == reference[index]).all()
        known = SAMPLES // 7  # from a known point, as a stream continues from its last index
        assert (
            blend.counts_before(shares, SAMPLES, known, reference[known], overlap=overlap) == reference[-1]
        ).all()
    assert small_segments  # the segmented path ran, not only the replay


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpora")
    tokenizer = byte_level_tokenizer()
    for name in ("a", "b"):
        write_pretokenized([f"{name} {i} " * 5 for i in range(20)], tokenizer, directory / name)
    return [PretokenizedCorpus(directory / name, 8) for name in ("a", "b")]


def test_a_stream_resumed_far_in_replays_no_rule_from_0(two_corpora, monkeypatch):
    far = 200_000
    expected = replayed(blend.blend_shares([2.0, 1.0]), far)[-1]
    stream = PretokenizedStream(two_corpora, [2.0, 1.0], batch_size=4, seed=0)
    stream.load_state_dict({"global_samples": far, "seed": 0, "world_size": 1})
    argmax, rule_steps = np.argmax, []  # each step of the rule, replayed or segmented, is one argmax
    monkeypatch.setattr(np, "argmax", lambda *args, **kwargs: rule_steps.append(1) or argmax(*args, **kwargs))
    next(iter(stream))
    assert len(rule_steps) < far // 100  # a replay from 0 took one step per sample: 200,000
    monkeypatch.undo()
    assert (stream._counts_before(far) == expected).all()
