"""Generation across 2 gloo ranks with the model sharded by ZeRO stage 3: same text as one process.

One spawn of 2 ranks runs every case (spawning costs more than generating with the tiny model);
the tests then compare each case with single-process `generate_texts` on the unsharded model.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.support import REPO
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.data.tokenizer import byte_level_tokenizer
from tnlg.inference.distributed import generate_on_ranks, load_sharded_model
from tnlg.inference.generation import generate_texts, load_model_and_tokenizer
from tnlg.inference.ranks import rank_slice
from tnlg.inference.settings import GenerationSettings
from tnlg.sharding import ZeroConfig
from tnlg.tools.spawn import free_port, run_distributed

# Different lengths: rank 0 gets the first two (padded to a common length), rank 1 the last alone.
PROMPTS = ["The quick brown fox jumps", "Turing", "a much longer prompt than the others, padded least"]
GREEDY = GenerationSettings(max_new_tokens=8)
BEAMS = GenerationSettings(max_new_tokens=6, num_beams=2)
SAMPLING = GenerationSettings(max_new_tokens=6, do_sample=True, top_k=0, temperature=1.5)
SAMPLING_SEED = 100  # rank r seeds SAMPLING_SEED + r
# A small persistence threshold, so that stage 3 really shards (and gathers) the debug model's blocks.
STAGE_3 = ZeroConfig(stage=3, param_persistence_threshold=1_000, prefetch_bucket_size=20_000)


def _eos_at(tokenizer, token_id: int) -> None:
    """Make `token_id` the tokenizer's EOS (padding stays the end-of-text token)."""
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(token_id)


def _rank_cases(rank: int, world_size: int, path: str, early_eos: int) -> dict[str, list[str]]:
    engine, tokenizer = load_sharded_model(path, STAGE_3)
    results = {
        "greedy": generate_on_ranks(engine, tokenizer, PROMPTS, GREEDY, batch_size=2),
        # batch_size 1: rank 0 runs two batches, rank 1 one and then a throwaway one
        "greedy-batch-1": generate_on_ranks(engine, tokenizer, PROMPTS, GREEDY, batch_size=1),
        # fewer prompts than ranks: rank 1 only steps along
        "one-prompt": generate_on_ranks(engine, tokenizer, PROMPTS[1:2], GREEDY),
        "beams": generate_on_ranks(engine, tokenizer, PROMPTS, BEAMS, batch_size=2),
        "token-ids": generate_on_ranks(
            engine, tokenizer, [tokenizer(p)["input_ids"] for p in PROMPTS], GREEDY, batch_size=2
        ),
    }
    torch.manual_seed(SAMPLING_SEED + rank)
    results["sampling"] = generate_on_ranks(engine, tokenizer, PROMPTS, SAMPLING, batch_size=2)
    # The same three decodings without the KV cache (test_sharded_cached_generation_equals_uncached).
    for case, settings in {"greedy": GREEDY, "beams": BEAMS, "sampling": SAMPLING}.items():
        torch.manual_seed(SAMPLING_SEED + rank)
        uncached = replace(settings, use_cache=False)
        results[f"{case}-uncached"] = generate_on_ranks(engine, tokenizer, PROMPTS, uncached, batch_size=2)
    _eos_at(tokenizer, early_eos)
    results["early-eos"] = generate_on_ranks(engine, tokenizer, PROMPTS, GREEDY, batch_size=2)
    stage_0, tokenizer = load_sharded_model(path, {"stage": 0})
    results["stage-0"] = generate_on_ranks(stage_0, tokenizer, PROMPTS, GREEDY, batch_size=2)
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The debug model (seeded; wide init so greedy choices are far from ties) with the byte-level
    tokenizer; a 257-token vocabulary so that every generated id decodes to text."""
    torch.manual_seed(0)
    config = TNLGConfig.from_preset(
        "debug", vocab_size=257, bos_token_id=256, eos_token_id=256, initializer_range=0.2
    )
    path = tmp_path_factory.mktemp("debug-model")
    TNLGForCausalLM(config).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, tokenizer = load_model_and_tokenizer(checkpoint)
    return model, tokenizer


@pytest.fixture(scope="module")
def early_eos(reference) -> int:
    """A token the last prompt (alone on rank 1) produces within its first 3 tokens and no other
    prompt ever does: as EOS it ends rank 1's generation early while rank 0 runs to the limit."""
    model, tokenizer = reference
    config = GREEDY.to_generation_config(tokenizer)
    tokens = []
    for prompt in PROMPTS:
        batch = tokenizer([prompt], return_tensors="pt")
        output = model.generate(**batch, generation_config=config)
        tokens.append(output[0, batch["input_ids"].shape[1] :].tolist())
    others = {t for sequence in tokens[:-1] for t in sequence}
    candidates = [t for t in tokens[-1][:3] if t not in others and t != tokenizer.eos_token_id]
    assert candidates, f"no early token unique to the last prompt: {tokens}"
    return candidates[0]


@pytest.fixture(scope="module")
def ranks(checkpoint, early_eos) -> list[dict[str, list[str]]]:
    # A short collective timeout: a rank left waiting in a gather fails the run instead of stalling it.
    return run_distributed(_rank_cases, 2, str(checkpoint), early_eos, timeout=180, collective_timeout=30)


def _expected(reference, prompts, settings, batch_size=8) -> list[str]:
    model, tokenizer = reference
    return generate_texts(model, tokenizer, prompts, settings, batch_size)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["greedy", "greedy-batch-1", "token-ids", "stage-0"])
def test_greedy_on_2_ranks_equals_one_process(ranks, reference, case):
    expected = _expected(reference, PROMPTS, GREEDY)
    assert all(len(text) > 0 for text in expected)
    for rank in ranks:
        assert rank[case] == expected


@pytest.mark.slow
def test_fewer_prompts_than_ranks(ranks, reference):
    for rank in ranks:
        assert rank["one-prompt"] == _expected(reference, PROMPTS[1:2], GREEDY)


@pytest.mark.slow
def test_beam_search_on_2_ranks_equals_one_process(ranks, reference):
    for rank in ranks:
        assert rank["beams"] == _expected(reference, PROMPTS, BEAMS)


@pytest.mark.slow
def test_sequences_ending_at_different_steps_on_different_ranks(ranks, reference, early_eos):
    """Rank 1's only sequence ends after a few tokens, rank 0's run to max_new_tokens: rank 1 keeps
    stepping (synced_gpus) so that rank 0's stage 3 gathers are answered, and nobody hangs."""
    model, tokenizer = reference
    tokenizer = byte_level_tokenizer()
    _eos_at(tokenizer, early_eos)
    lengths = []
    for prompt in PROMPTS:
        batch = tokenizer([prompt], return_tensors="pt")
        output = model.generate(**batch, generation_config=GREEDY.to_generation_config(tokenizer))
        lengths.append(output.shape[1] - batch["input_ids"].shape[1])
    assert lengths[-1] <= 3 and lengths[:-1] == [GREEDY.max_new_tokens] * (len(PROMPTS) - 1)
    expected = generate_texts(model, tokenizer, PROMPTS, GREEDY)
    for rank in ranks:
        assert rank["early-eos"] == expected


@pytest.mark.slow
def test_sampling_on_2_ranks_draws_what_each_rank_would_alone(ranks, reference):
    """Each rank samples its own share with its own generator: rank r's share equals one process
    seeded like rank r sampling the same prompts."""
    start, end = rank_slice(len(PROMPTS), 1, 2)
    torch.manual_seed(SAMPLING_SEED)
    expected = _expected(reference, PROMPTS[:start], SAMPLING, batch_size=2)
    torch.manual_seed(SAMPLING_SEED + 1)
    expected += _expected(reference, PROMPTS[start:end], SAMPLING, batch_size=2)
    assert ranks[0]["sampling"] == ranks[1]["sampling"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("case", ["greedy", "beams", "sampling"])
def test_sharded_cached_generation_equals_uncached(ranks, case):
    """Stage 3 with the KV cache produces what it produces without one ([Note: the cache's name])."""
    for rank in ranks:
        assert all(len(text) > 0 for text in rank[case])
        assert rank[case] == rank[f"{case}-uncached"]


def test_rank_slices_are_contiguous_and_balanced():
    for count in range(7):
        for world in (1, 2, 3, 4):
            slices = [rank_slice(count, r, world) for r in range(world)]
            assert slices[0][0] == 0 and slices[-1][1] == count
            assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
            sizes = [end - start for start, end in slices]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_single_process_falls_back_to_generate_texts(checkpoint, reference):
    engine, tokenizer = load_sharded_model(checkpoint, STAGE_3)
    assert engine.inference_only
    assert generate_on_ranks(engine, tokenizer, PROMPTS, GREEDY) == _expected(reference, PROMPTS, GREEDY)


@pytest.mark.parametrize(
    ("dtype", "enabled", "computes"),
    [
        (None, "bf16", "bf16"),
        (torch.bfloat16, "bf16", "bf16"),
        (torch.float16, "no", "fp16"),
        (None, "no", "no"),
    ],
)
def test_sharded_loading_keeps_the_configs_precision_unless_a_dtype_is_given(
    checkpoint, dtype, enabled, computes
):
    engine, _ = load_sharded_model(checkpoint, ZeroConfig(stage=0, mixed_precision=enabled), dtype=dtype)
    assert engine.config.mixed_precision == computes


@pytest.mark.parametrize(("dtype", "enabled"), [(torch.float32, "bf16"), (torch.bfloat16, "fp16")])
def test_sharded_loading_refuses_a_dtype_the_config_disagrees_with(checkpoint, dtype, enabled):
    # it replaced the config's bf16 with float32 silently (scripts/evaluate.py passed float32 by default)
    with pytest.raises(
        ValueError, match=rf"dtype {dtype} conflicts with the ZeRO config, which enables {enabled}"
    ):
        load_sharded_model(checkpoint, ZeroConfig(stage=0, mixed_precision=enabled), dtype=dtype)


def test_sharded_loading_needs_a_checkpoint_directory():
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        load_sharded_model("debug", STAGE_3)


def _run_script(checkpoint: Path, *extra: str, launch: list[str] | None = None) -> list[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    arguments = [
        "--model", str(checkpoint), "--max-new-tokens", str(GREEDY.max_new_tokens), "--batch-size", "2",
        *[flag for prompt in PROMPTS for flag in ("--prompt", prompt)], *extra,
    ]  # fmt: skip
    command = [*(launch or [sys.executable]), str(REPO / "scripts" / "generate.py"), *arguments]
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.strip().splitlines()


@pytest.mark.slow
def test_script_on_2_processes_prints_what_one_process_prints(checkpoint, tmp_path, capsys):
    from scripts.generate import main

    main(["--model", str(checkpoint), "--max-new-tokens", str(GREEDY.max_new_tokens)] + [
        flag for prompt in PROMPTS for flag in ("--prompt", prompt)
    ])  # fmt: skip
    alone = capsys.readouterr().out.strip().splitlines()
    assert len(alone) == len(PROMPTS)
    zero_config = tmp_path / "zero.json"
    zero_config.write_text(json.dumps({"stage": 1, "param_persistence_threshold": 1_000}))
    # One CPU process is --cpu; several are --multi_gpu (Accelerate's --cpu starts only one).
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--main_process_port", str(free_port()),
        "--mixed_precision", "no", "--dynamo_backend", "no",
    ]  # fmt: skip
    # --zero-stage overrides the JSON's stage: 3 with its small persistence threshold.
    printed = _run_script(checkpoint, "--zero-config", str(zero_config), "--zero-stage", "3", launch=launch)
    assert printed == alone  # the main process prints every line; the other rank prints nothing
