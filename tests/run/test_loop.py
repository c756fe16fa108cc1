"""The loop's parts on their own: `build_run` gives a run ready to step, and `train_step` accumulates
micro-batches into one optimizer step the way one larger batch would be."""

from __future__ import annotations

import pytest
import torch

from tests.support.run_cases import build_debug_run
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)


def _two_steps(rank, world_size, cache, output, micro_batch_size, accumulation):
    """Two optimizer steps of the debug run through build_run / train_step; the metrics, the stream's
    position and the consolidated parameters after them."""
    from tnlg.run.loop import train_step

    run = build_debug_run(
        cache,
        [
            "--train.output_dir", output, "--logging.trackers", "[]", "--data.shuffle_buffer", "1",
            "--train.micro_batch_size", str(micro_batch_size),
            "--train.gradient_accumulation_steps", str(accumulation),
        ],
    )  # fmt: skip
    batches = iter(run.stream)
    metrics = [train_step(run, batches, step) for step in range(2)]
    state = {k: v.clone() for k, v in run.engine.full_state_dict().items()}
    run.engine.close()
    return {"metrics": metrics, "state": state}


@pytest.fixture(scope="module")
def accumulated_and_whole(cache, tmp_path_factory):
    def steps(micro, accumulation):
        output = tmp_path_factory.mktemp(f"loop-{micro}x{accumulation}")
        (result,) = run_distributed(_two_steps, 1, str(cache), str(output), micro, accumulation, timeout=300)
        return result

    return steps(4, 2), steps(8, 1)


def test_a_step_reports_its_metrics(accumulated_and_whole):
    accumulated, _ = accumulated_and_whole
    first, second = accumulated["metrics"]
    assert set(first) >= {"loss", "lr", "tokens_per_s", "grad_norm", "memory_mb", "nonfinite_steps"}
    assert first["nonfinite_steps"] == 0 and first["grad_norm"] > 0 and first["tokens_per_s"] > 0
    assert second["lr"] > first["lr"]  # warming up
    assert second["loss"] < first["loss"]


def test_two_micro_batches_of_four_step_like_one_batch_of_eight(accumulated_and_whole):
    accumulated, whole = accumulated_and_whole
    for a, w in zip(accumulated["metrics"], whole["metrics"], strict=True):
        assert a["loss"] == pytest.approx(w["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    assert accumulated["state"].keys() == whole["state"].keys()
    for name, value in accumulated["state"].items():
        # atol 1e-5: Adam divides by sqrt(v), so an element whose gradient is near zero moves by a
        # summation-order difference times up to the step size (here ~1e-4); the grad norm above
        # already pins the gradient's scale, which Adam's update alone would not show.
        torch.testing.assert_close(value, whole["state"][name], rtol=1e-5, atol=1e-5, msg=name)


def _overflowing_steps(rank, world_size, cache, output, pipeline):
    """Three fp16 steps of the debug run at a loss scale so large that every one overflows; each step's
    metrics and the schedule's position after them."""
    from tnlg.run.loop import train_step

    run = build_debug_run(
        cache,
        [
            "--train.output_dir", output, "--logging.trackers", "[]", "--data.shuffle_buffer", "1",
            "--train.mixed_precision", "fp16", "--zero.initial_loss_scale", str(2.0**40),
            "--zero.hysteresis", "1", "--parallel.pipeline", str(pipeline),
        ],
    )  # fmt: skip
    batches = iter(run.stream)
    metrics = [train_step(run, batches, step) for step in range(3)]
    skipped = run.engine.step_was_skipped
    run.engine.close()
    return {"metrics": metrics, "schedule_steps": run.scheduler.last_epoch, "skipped": skipped}


@pytest.mark.parametrize("pipeline", [1, 2], ids=["data-parallel", "pipeline-stages"])
def test_an_overflow_skipped_step_holds_the_schedule_back(cache, tmp_path, pipeline):
    # the loop stepped the schedule whenever the loss was finite, which an fp16 overflow leaves it: the
    # learning rate warmed up through steps that applied no update (DeepSpeed's schedule holds back)
    results = run_distributed(_overflowing_steps, pipeline, str(cache), str(tmp_path), pipeline, timeout=300)
    for result in results:
        lrs, scales = [m["lr"] for m in result["metrics"]], [m["loss_scale"] for m in result["metrics"]]
        assert result["skipped"] and scales == [2.0**39, 2.0**38, 2.0**37]  # every step overflowed
        assert result["schedule_steps"] == 0 and lrs == [lrs[0]] * 3


def _with_collective_timeout(rank, world_size, cache, output, minutes):
    """Whether the debug run builds with train.collective_timeout_minutes `minutes` in a rank whose
    process group the harness made (with a 60 s timeout) before the run: the error if not."""
    try:
        run = build_debug_run(
            cache,
            [
                "--train.output_dir",
                output,
                "--logging.trackers",
                "[]",
                "--train.collective_timeout_minutes",
                minutes,
            ],
        )
    except ValueError as error:
        return str(error)
    run.engine.close()
    return "built"


def test_a_collective_timeout_the_process_group_does_not_have_is_refused(cache, tmp_path):
    # Accelerate gives the timeout only to a process group it creates; one created before the run keeps its
    # own, so the setting would go unapplied: the run refuses it then, and builds when the two agree.
    (refused,) = run_distributed(_with_collective_timeout, 1, str(cache), str(tmp_path / "a"), "7")
    assert "train.collective_timeout_minutes 7: the process group was created before the run" in refused
    assert "a timeout of 1 minutes" in refused
    (built,) = run_distributed(_with_collective_timeout, 1, str(cache), str(tmp_path / "b"), "1")
    assert built == "built"
