"""Perplexity and LAMBADA with a tensor-sliced model on 2 gloo ranks (one replica): the ranks of a
replica score the same windows and passages together, so the totals equal one process's. They split
the work by global rank: each rank fed its own windows into the shared sliced forward, giving other
numbers when the shapes happened to agree and a gloo size mismatch when they did not."""

from __future__ import annotations

import pytest

from tests.support.tensor_parallel_cases import make_model
from tnlg.eval.lambada import encoded_last_word_scores
from tnlg.eval.perplexity import perplexity
from tnlg.sharding import ParallelDims, ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # spawns processes

IDS = [(i * 37) % 250 + 3 for i in range(64)]
# (context, target) ids of different lengths: ranks given different passages would disagree on shapes
PASSAGES = [(IDS[:9], IDS[9:11]), (IDS[20:41], IDS[41:42]), (IDS[3:7], IDS[7:10])]


def _model():
    return make_model(vocab_size=258, eos_token_id=None).eval()


def _scores(model) -> dict:
    sliding = perplexity(model, IDS, max_length=32, stride=7, prefix_token_id=1)
    last_word = encoded_last_word_scores(model, PASSAGES)
    return {
        "perplexity": (sliding.nll, sliding.tokens),
        "lambada": (last_word.correct, last_word.loglikelihood),
    }


def _sliced_scores(rank: int, world_size: int) -> dict:
    return _scores(initialize(_model(), None, ZeroConfig(stage=0), parallel=ParallelDims(tensor=2)).eval())


def test_a_sliced_replica_scores_like_one_process():
    expected = _scores(_model())
    for result in run_distributed(_sliced_scores, 2, timeout=180, collective_timeout=30):
        assert result["perplexity"][1] == expected["perplexity"][1]
        assert result["perplexity"][0] == pytest.approx(expected["perplexity"][0], rel=1e-5)
        assert result["lambada"][0] == expected["lambada"][0]
        assert result["lambada"][1] == pytest.approx(expected["lambada"][1], rel=1e-5)
