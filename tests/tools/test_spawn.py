"""The harness that runs a function on N gloo ranks (tnlg/tools/spawn.py)."""

from __future__ import annotations

import pytest

from tests.support.spawn_cases import (
    exit_on_rank_one,
    raise_on_rank_one,
    rank_view,
    read_the_store_after_rank_zero_returned,
)
from tnlg.tools.spawn import RankFailed, run_distributed


def test_results_come_back_in_rank_order_from_ranks_forked_off_the_preloaded_server():
    views = run_distributed(rank_view, 3, [])
    assert [view["rank"] for view in views] == [0, 1, 2]
    assert all(view["world_size"] == 3 and view["sum"] == 6.0 for view in views)
    assert all(view["preloaded"] for view in views)
    # Each rank seeds its generator afresh, as a new interpreter would, not the server's copy.
    assert len({view["draw"] for view in views}) == 3


def test_ranks_see_the_callers_environment_at_the_call_not_the_servers(monkeypatch):
    # The server started with the session (tests/conftest.py), before these changes.
    monkeypatch.setenv("TNLG_SPAWN_PROBE", "set after the server started")
    monkeypatch.delenv("PATH")  # present when the server started
    views = run_distributed(rank_view, 2, ["TNLG_SPAWN_PROBE", "PATH", "WORLD_SIZE"])
    for view in views:
        assert view["environ"] == {
            "TNLG_SPAWN_PROBE": "set after the server started",
            "PATH": None,
            "WORLD_SIZE": "2",  # what the harness sets for each rank comes on top
        }
        # Already in place when the function's module was imported in the rank.
        assert view["probe_at_import"] == "set after the server started"


def test_spawned_ranks_are_fresh_interpreters_with_the_same_results():
    views = run_distributed(rank_view, 2, [], start_method="spawn")
    assert [(view["rank"], view["sum"]) for view in views] == [(0, 3.0), (1, 3.0)]
    assert not any(view["preloaded"] for view in views)


def test_a_function_ranks_cannot_import_or_an_unknown_start_method_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="defined at a module's top level"):
        run_distributed(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match=r"start_method is one of .*'fork'"):
        run_distributed(rank_view, 2, [], start_method="fork")


def test_a_rank_that_raises_fails_the_run_with_its_traceback_and_rank():
    with pytest.raises(RankFailed, match=r"(?s)failed on rank 1 of 2.*ValueError: rank one refuses"):
        run_distributed(raise_on_rank_one, 2)


def test_a_rank_that_returns_first_keeps_the_store_up_for_the_others():
    # Without the wait, rank 0's exit closed the store and rank 1 failed with "Connection reset by peer".
    assert run_distributed(read_the_store_after_rank_zero_returned, 2) == ["returned", "still readable"]


def test_a_rank_that_dies_without_reporting_fails_the_run_with_its_exit_code():
    with pytest.raises(RankFailed, match="rank 1 of 2 died with exit code 3"):
        run_distributed(exit_on_rank_one, 2)
