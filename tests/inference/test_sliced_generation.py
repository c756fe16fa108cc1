"""Generation with a tensor-sliced model on 2 gloo ranks (one replica): the same text as one process.

The two ranks of a replica run every forward pass together, so they must embed the same ids: they
sample from one stream (the replica's first rank's generator, whatever each rank was seeded with),
take the same prompts whether the model is a ZeroEngine or a plain model cut by
`apply_tensor_parallel`, and refuse, on every rank, prompts or settings that differ between them.
One spawn runs every case; the tests compare each with `generate_texts` on the unsliced model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.tensor_parallel_cases import make_model
from tnlg.inference.distributed import generate_on_ranks
from tnlg.inference.generation import generate_texts, load_tokenizer_for
from tnlg.inference.ranks import work_share
from tnlg.inference.settings import GenerationSettings
from tnlg.modeling.tensor_parallel import apply_tensor_parallel
from tnlg.sharding import ParallelDims, ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

PROMPTS = ["hello there", "abc", "The model"]
GREEDY = GenerationSettings(max_new_tokens=8)
SAMPLING = GenerationSettings(max_new_tokens=8, do_sample=True, top_k=0, temperature=1.5)
SEED = 5  # rank r seeds SEED + r, as scripts/generate.py seeds seed + rank
VOCAB = 258  # the byte-level tokenizer's 257 ids, padded to split over 2 ranks


def _model():
    return make_model(vocab_size=VOCAB, eos_token_id=None).eval()


def _refusal(function, *args) -> str:
    try:
        function(*args)
    except ValueError as error:
        return str(error)
    return "no error"


def _rank_cases(rank: int, world_size: int) -> dict:
    tokenizer = load_tokenizer_for("debug", "byte-level")
    engine = initialize(_model(), None, ZeroConfig(stage=0), parallel=ParallelDims(tensor=2)).eval()
    torch.manual_seed(SEED + rank)  # after building: make_model seeds the generator itself
    results = {
        "sampled": generate_on_ranks(engine, tokenizer, PROMPTS, SAMPLING),
        "sampled-again": generate_on_ranks(engine, tokenizer, PROMPTS, SAMPLING),
        "rng-after": torch.rand(4),  # the caller's generator: advanced on the first rank only
    }
    plain = _model()
    apply_tensor_parallel(plain, dist.group.WORLD)
    results["plain-greedy"] = generate_on_ranks(plain, tokenizer, PROMPTS, GREEDY)
    rotated = PROMPTS[rank:] + PROMPTS[:rank]  # same shapes: without the check, wrong text and no error
    results["other-prompts"] = _refusal(generate_on_ranks, engine, tokenizer, rotated, GREEDY)
    # One batch either way (3 prompts): the same forward passes, so only the check can tell.
    results["other-settings"] = _refusal(generate_on_ranks, engine, tokenizer, PROMPTS, GREEDY, 8 - 4 * rank)
    return results


def _pair_cut_share(rank: int, world_size: int) -> str:
    """work_share of a plain model cut over a pair of the 4 ranks: which pair is which replica is unknown."""
    pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank creates every group
    model = _model()
    apply_tensor_parallel(model, pairs[rank // 2])
    return _refusal(work_share, model)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_rank_cases, 2, timeout=180, collective_timeout=30)


@pytest.fixture(scope="module")
def reference():
    return _model(), load_tokenizer_for("debug", "byte-level")


@pytest.mark.slow
def test_tensor_ranks_seeded_apart_sample_what_the_first_rank_samples_alone(ranks, reference):
    """Rank 0's seed, in one process, on the unsliced model: both calls, on both ranks. Rank 0's
    generator advanced as that process's did; rank 1's is left as it was seeded."""
    model, tokenizer = reference
    torch.manual_seed(SEED)
    first = generate_texts(model, tokenizer, PROMPTS, SAMPLING)
    second = generate_texts(model, tokenizer, PROMPTS, SAMPLING)
    advanced = torch.rand(4)
    assert first != second  # successive calls draw on
    for rank in ranks:
        assert rank["sampled"] == first
        assert rank["sampled-again"] == second
    torch.manual_seed(SEED + 1)
    untouched = torch.rand(4)
    assert torch.equal(ranks[0]["rng-after"], advanced)
    assert torch.equal(ranks[1]["rng-after"], untouched)


@pytest.mark.slow
def test_a_plain_sliced_model_generates_every_prompt_on_every_rank(ranks, reference):
    model, tokenizer = reference
    expected = generate_texts(model, tokenizer, PROMPTS, GREEDY)
    for rank in ranks:
        assert rank["plain-greedy"] == expected


@pytest.mark.slow
@pytest.mark.parametrize(("case", "named"), [("other-prompts", "prompts"), ("other-settings", "settings")])
def test_tensor_ranks_given_different_work_refuse_it_on_every_rank(ranks, case, named):
    for rank in ranks:
        assert f"different {named}" in rank[case]


@pytest.mark.slow
def test_a_plain_model_cut_over_part_of_the_ranks_is_refused_not_split():
    """Split by rank, the two ranks of a pair would take different prompts (and gloo abort on a
    collective of another size): refused on every rank, naming what to do instead."""
    for message in run_distributed(_pair_cut_share, 4, timeout=180, collective_timeout=30):
        assert "over 2 of the 4 ranks" in message and "ParallelDims(tensor=...)" in message
