"""Fine-tuning data: local files of every format through a column mapping, packing that keeps
examples apart, and batches that split evenly over ranks and resume where they stopped."""

from __future__ import annotations

import json

import pytest
import torch

from tnlg import TNLGForCausalLM
from tnlg.data.finetune import (
    FinetuneBatches,
    builder_for,
    collate_packed,
    encode_rows,
    load_rows,
    pack_examples,
    validation_rows,
)
from tnlg.data.tasks import IGNORE_INDEX, TaskFormat, pad_batch
from tnlg.data.tokenizer import byte_level_tokenizer

ROWS = [{"article": f"article number {i} " * (1 + i % 3), "highlights": f"summary {i}"} for i in range(10)]
CNN_DM = TaskFormat("summarization", columns={"document": "article", "summary": "highlights"}, max_length=64)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def write(path, rows, kind):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        pd = pytest.importorskip("pandas")  # not at module level: the GPU image may lack it
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd = pytest.importorskip("pandas")
        pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_local_files_of_every_format_load_through_the_column_mapping(tmp_path, tokenizer, kind):
    pytest.importorskip("datasets", reason="needs the datasets package")  # load_rows reads through it
    path = write(tmp_path / f"train.{kind}", ROWS, kind)
    rows = load_rows(None, [str(path)], "train")
    examples = encode_rows(rows, CNN_DM, tokenizer)
    assert len(examples) == len(ROWS)
    first = examples[0]
    target = [
        t for t, label in zip(first["input_ids"], first["labels"], strict=True) if label != IGNORE_INDEX
    ]
    assert tokenizer.decode(target) == " summary 0" + tokenizer.eos_token


def test_validation_files_are_read_whatever_the_training_set(tmp_path):
    """The default training set is embedded; validation files given with it are still the files (not
    the embedded set's rows, which an embedded dataset name would otherwise select)."""
    pytest.importorskip("datasets", reason="needs the datasets package")  # validation_rows reads through it
    from tnlg.run.finetune_config import FinetuneDataSection

    held_out = write(tmp_path / "held_out.jsonl", ROWS[:3], "jsonl")
    data = FinetuneDataSection(validation_paths=[str(held_out)])
    rows = validation_rows(data.dataset, data.validation_paths, data.validation_split, data.dataset_config)
    assert data.dataset.startswith("embedded:") and rows.column("article") == [r["article"] for r in ROWS[:3]]


def test_unknown_suffixes_and_mixed_formats_are_refused():
    assert builder_for(["a.jsonl", "b.json.gz"]) == "json"
    with pytest.raises(ValueError, match=r"notes.txt: cannot tell the file format"):
        builder_for(["notes.txt"])
    with pytest.raises(ValueError, match="several formats"):
        builder_for(["a.csv", "b.parquet"])
    with pytest.raises(FileNotFoundError, match="no data files match"):
        load_rows(None, ["/nonexistent/train.jsonl"], "train")


def test_a_target_that_cannot_fit_stops_naming_the_row_or_is_skipped(tokenizer, caplog):
    rows = [*ROWS[:3], {"article": "short", "highlights": "a very long summary " * 20}]
    with pytest.raises(ValueError, match=r"rows: row 3: the target .* is never truncated"):
        encode_rows(rows, CNN_DM, tokenizer, where="rows")
    assert len(encode_rows(rows, CNN_DM, tokenizer, on_long_example="skip")) == 3
    assert "1 examples skipped" in caplog.text
    with pytest.raises(ValueError, match=r"row 0: .*no column 'article'"):
        encode_rows([{"document": "x", "summary": "y"}], CNN_DM, tokenizer)


def test_packing_never_splits_an_example_and_restarts_positions(tokenizer):
    examples = encode_rows(ROWS, CNN_DM, tokenizer)
    rows = pack_examples(examples, 128)
    assert sum(len(r["input_ids"]) for r in rows) == sum(len(e["input_ids"]) for e in examples)
    assert all(len(r["input_ids"]) <= 128 for r in rows)
    assert len(rows) < len(examples)
    starts = [i for r in rows for i, p in enumerate(r["position_ids"]) if p == 0]
    assert len(starts) == len(examples)  # every example begins a run of positions at 0


def test_a_packed_row_scores_each_example_as_if_it_were_alone(tokenizer, debug_config):
    """Attention stays inside each example: the packed row's summed target loss equals the sum of
    the examples' losses computed one at a time."""
    model = TNLGForCausalLM(debug_config).eval()
    examples = encode_rows(ROWS[::3][:3], CNN_DM, tokenizer)
    rows = pack_examples(examples, 128)
    assert len(rows) == 1
    packed = collate_packed(rows, 128, tokenizer.eos_token_id)

    def summed(batch):
        targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        return model(**batch).loss * targets

    with torch.no_grad():
        alone = sum(summed(pad_batch([e], tokenizer.eos_token_id)) for e in examples)
        together = summed(packed)
        # without the restarting positions the examples would see each other
        crossing = summed({k: v for k, v in packed.items() if k != "position_ids"})
    assert together.item() == pytest.approx(alone.item(), rel=1e-5)
    assert crossing.item() != pytest.approx(alone.item(), rel=1e-3)


def batches_of(examples, rank, world, **kwargs):
    return FinetuneBatches(
        examples, micro_batch_size=2, rank=rank, world_size=world, seed=3, pad_token_id=0, **kwargs
    )


def first_tokens(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


@pytest.mark.parametrize("packing", [False, True])
def test_ranks_share_an_epoch_evenly_and_every_epoch_is_reshuffled(tokenizer, packing):
    examples = [{"input_ids": [i, i], "labels": [-100, i]} for i in range(11)]
    streams = [iter(batches_of(examples, r, 2, packing=packing, max_length=2)) for r in range(2)]
    epoch = [[first_tokens(next(s)) for _ in range(2)] for s in streams]  # 2 steps x 2 ranks x 2 rows
    seen = [t for rank in epoch for batch in rank for t in batch]
    assert len(set(seen)) == 8  # no example twice within the epoch; 3 of 11 left for the last slice
    second = [first_tokens(next(streams[0])) for _ in range(2)]
    assert second != epoch[0]


def test_batches_resume_mid_epoch_and_at_another_world_size():
    examples = [{"input_ids": [i, i], "labels": [-100, i]} for i in range(24)]
    reference = iter(batches_of(examples, 0, 1))
    expected = [first_tokens(next(reference)) for _ in range(20)]

    stopped = batches_of(examples, 0, 1)
    stream = iter(stopped)
    for _ in range(7):
        next(stream)
    state = json.loads(json.dumps(stopped.state_dict()))
    resumed = batches_of(examples, 0, 1)
    resumed.load_state_dict(state)
    assert [first_tokens(b) for b, _ in zip(resumed, range(13), strict=False)] == expected[7:]

    # two ranks from the same position: together they take the rows one rank would have
    halves = []
    for rank in range(2):
        wider = batches_of(examples, rank, 2)
        wider.load_state_dict({**state, "consumed": 8})
        halves.append(first_tokens(next(iter(wider))))
    assert halves[0] + halves[1] == expected[4] + expected[5]
    with pytest.raises(ValueError, match="had 5 examples, this run has 24"):
        resumed.load_state_dict({**state, "examples": 5})


def rows_taken(world: int, steps: int, state: dict | None = None) -> tuple[list[int], dict]:
    """The rows (first tokens) that `world` processes of 3 rows each take in `steps` steps, in the
    epoch's order (rank after rank within a step), and the position after them."""
    examples = [{"input_ids": [i, i], "labels": [-100, i]} for i in range(40)]
    ranks = [
        FinetuneBatches(examples, micro_batch_size=3, rank=r, world_size=world, seed=0, pad_token_id=0)
        for r in range(world)
    ]
    for batches in ranks:
        if state is not None:
            batches.load_state_dict(state)
    streams = [iter(batches) for batches in ranks]
    rows = [row for _ in range(steps) for stream in streams for row in first_tokens(next(stream))]
    return rows, json.loads(json.dumps(ranks[0].state_dict()))


@pytest.mark.parametrize(("saved_steps", "resumed_steps"), [(1, 2), (3, 1)])
def test_a_position_saved_by_two_processes_resumes_on_four_at_exactly_its_row(saved_steps, resumed_steps):
    uninterrupted, _ = rows_taken(2, 6)  # 36 of the epoch's 40 rows, 6 a step
    before, state = rows_taken(2, saved_steps)  # 6 or 18 rows: not a whole step of 4 x 3 rows
    after, _ = rows_taken(4, resumed_steps, state)
    # Nothing repeated, nothing skipped: the rows follow on exactly as the uninterrupted run takes them.
    assert before + after == uninterrupted[: len(before) + len(after)]


def test_a_position_outside_the_epoch_is_refused():
    with pytest.raises(ValueError, match=r"row 41 of epoch 0\) is outside the epoch's 40 rows"):
        rows_taken(4, 1, {"epoch": 0, "consumed": 41, "examples": 40})


def test_too_few_examples_for_one_step_are_refused():
    with pytest.raises(ValueError, match=r"make 3 rows, fewer than one step needs \(micro_batch_size 2 x 2"):
        batches_of([{"input_ids": [1], "labels": [1]}] * 3, 0, 2)
