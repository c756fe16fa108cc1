"""Stage 3 cuts blocks into units of at most the reduce bucket size, caps the reduce buckets in flight,
and prefetches by a pure policy that warns when `max_live_parameters` leaves no room to prefetch."""

from __future__ import annotations

import warnings

import pytest

from tests.support.zero_cases import SMALL, reduce_buckets_in_flight
from tests.support.zero_models import make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.sharding.params import blocks_to_prefetch, prefetch_floor
from tnlg.sharding.plan import plan_sharding
from tnlg.tools.spawn import run_distributed


def _stage3_plan(reduce_bucket_size: int):
    model = make_model()
    config = ZeroConfig(**{**SMALL, "stage": 3, "reduce_bucket_size": reduce_bucket_size})
    return plan_sharding(model, make_optimizer(model), config)


@pytest.mark.parametrize("bucket", [64, 300, 10**9])
def test_units_stay_within_one_block_and_the_bucket_size(bucket):
    plan = _stage3_plan(bucket)
    for group in plan.groups:
        for members, block in zip(group.units, group.unit_blocks, strict=True):
            numels = [group.params[i].numel() for i in members]
            assert sum(numels) <= bucket or len(members) == 1, (members, numels)
            if block is not None:  # every member of a gathered unit belongs to that unit's block
                prefix = plan.blocks[block].name
                assert all(group.names[i].startswith(prefix) for i in members)


def test_a_small_bucket_cuts_a_block_into_several_units():
    whole, cut = _stage3_plan(10**9), _stage3_plan(64)
    block_units = lambda plan: [  # noqa: E731
        sum(1 for group in plan.groups for b in group.unit_blocks if b == index)
        for index in range(len(plan.blocks) - 1)
    ]
    assert block_units(whole) == [2, 2]  # one unit per param group (decayed, not decayed) per block
    assert all(n > 2 for n in block_units(cut))


@pytest.mark.slow
def test_reduce_buckets_in_flight_are_capped_and_training_is_unchanged():
    small = run_distributed(reduce_buckets_in_flight, 2, 64, timeout=300)[0]
    large = run_distributed(reduce_buckets_in_flight, 2, 10**6, timeout=300)[0]
    cap = 2 * 64
    # After a launch, more than the cap stays in flight only as the single newest bucket.
    biggest = max(small["units"])
    assert max(small["in_flight"]) <= max(cap, biggest)
    assert any(numel > biggest for numel in large["in_flight"])  # without the cap, several pile up
    assert small["losses"] == pytest.approx(large["losses"], rel=1e-6)


def test_prefetch_policy_follows_budget_and_live_cap():
    numels = [10, 10, 10, 10]
    none_gathered = [False] * 4
    # The budget counts blocks already gathered or under way; the live cap stops at the first misfit.
    assert blocks_to_prefetch(numels, none_gathered, 0, 1, live=15, budget=25, max_live=100) == [1, 2, 3]
    assert blocks_to_prefetch(numels, none_gathered, 0, 1, live=15, budget=15, max_live=100) == [1, 2]
    assert blocks_to_prefetch(numels, none_gathered, 0, 1, live=15, budget=100, max_live=34) == [1]
    assert blocks_to_prefetch(
        numels, [False, True, False, False], 0, 1, live=25, budget=15, max_live=100
    ) == [2]
    assert blocks_to_prefetch(numels, none_gathered, 3, -1, live=15, budget=100, max_live=100) == [2, 1, 0]
    assert blocks_to_prefetch(numels, none_gathered, 0, 1, live=15, budget=0, max_live=100) == []
    assert prefetch_floor(7, [10, 30, 20, 5]) == 57
    assert prefetch_floor(7, [10]) == 7


@pytest.mark.slow
def test_engine_warns_when_max_live_parameters_leaves_no_room_to_prefetch():
    assert run_distributed(_stage3_warnings, 1, 10**9, timeout=120)[0] == []
    (message,) = run_distributed(_stage3_warnings, 1, 100, timeout=120)[0]
    # The model's root block holds 592 elements and each block 845: 592 + 2 * 845.
    assert "max_live_parameters=100 is below the 2,282 gathered elements that prefetching needs" in message


def _stage3_warnings(rank: int, world_size: int, max_live: int) -> list[str]:
    """The warnings initializing a stage 3 engine with `max_live_parameters=max_live` gives."""
    model = make_model()
    config = ZeroConfig(**{**SMALL, "stage": 3, "max_live_parameters": max_live})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        initialize(model, make_optimizer(model), config).close()
    return [str(w.message) for w in caught if "max_live_parameters" in str(w.message)]
