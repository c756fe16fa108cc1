"""Stage 3's all-gathers run on a process group of their own, so that a backward prefetch does not
queue behind the gradient reduce-scatters (see [Note: gather group] in sharding/collectives.py); the
engine destroys that group when it closes or is dropped. That training still equals the
single-process reference is tests/sharding/test_zero_equivalence.py's job (its stage 3 cases).
"""

from __future__ import annotations

import pytest

from tests.support.zero_cases import SMALL, gather_group_use
from tests.support.zero_models import make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.collectives import Collectives
from tnlg.tools.spawn import run_distributed


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(gather_group_use, 2)


@pytest.mark.slow
def test_gathers_run_on_a_second_group_with_the_same_ranks(ranks):
    for result in ranks:
        assert result["recorded"]["all_gather"]["calls"] > 0
        assert result["recorded"]["reduce_scatter"]["calls"] > 0
        assert result["gathers_on_gather_group"]
        assert result["reductions_on_engine_group"]
        assert not result["gather_group_is_world"]
        assert result["gather_group_ranks"] == [0, 1]
        assert result["groups_with_engine"] == result["groups_before"] + 1


@pytest.mark.slow
def test_comm_stats_count_every_collective_on_either_group(ranks):
    for result in ranks:
        for kind, recorded in result["recorded"].items():
            assert result["stats"][kind] == recorded, kind


@pytest.mark.slow
def test_closing_or_dropping_engines_destroys_their_gather_groups(ranks):
    for result in ranks:
        assert result["gather_group_after_close_is_engine_group"]
        assert result["groups_after_closed_engines"] == result["groups_before"]
        assert result["groups_after_dropped_engine"] == result["groups_before"]


def test_a_single_process_opens_no_second_group():
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": 3}))
    assert engine.collectives.gather_group is engine.collectives.group
    assert not engine.collectives.owns_gather_group
    engine.close()


def test_closing_collectives_that_own_no_group_changes_nothing():
    collectives = Collectives()
    collectives.open_gather_group()
    collectives.close()
    collectives.close()
    assert collectives.gather_group is None and not collectives.owns_gather_group
