"""`model.compile` in a pretraining run: the debug run with compiled blocks trains like the committed
baseline, reports what compiling cost in its metrics, and leaves inductor's cache in the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run.test_pretrain_parallel import BASELINE, FP32_STEPS
from tests.support.compile_cases import compiled_debug_run
from tests.support.run_cases import DEBUG
from tnlg.run.config import CompileSection, load_run_config
from tnlg.sharding import CompileConfig
from tnlg.sharding.compile import dotted_options
from tnlg.tools.spawn import run_distributed


@pytest.mark.slow
def test_the_compiled_debug_run_trains_like_the_baseline_and_reports_compiling(tmp_path):
    overrides = [*FP32_STEPS, "--model.compile.enabled", "true"]
    result = run_distributed(
        compiled_debug_run, 2, str(tmp_path / "cache"), str(tmp_path / "run"), overrides, timeout=900
    )[0]
    steps = result["steps"]
    assert [s["loss"] for s in steps] == pytest.approx(BASELINE["losses"][: len(steps)], rel=1e-5)
    assert steps[0]["compiles"] >= 1 and steps[0]["compile_s"] > 0  # the first step compiled the blocks
    assert steps[-1]["compiles"] == steps[0]["compiles"]  # and none after it
    assert (
        result["cached_files"] > 0
    )  # inductor's cache, under the run's output directory for a resumed run to read


def test_compile_settings_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match=r"compile backend 'inductr' is not one torch knows"):
        load_run_config(DEBUG, ["--model.compile.enabled", "true", "--model.compile.backend", "inductr"])
    config = load_run_config(
        DEBUG, ["--model.compile.enabled", "true", "--model.compile.mode", "max-autotune"]
    )
    assert config.model.compile.settings(Path("out")) == CompileConfig(
        mode="max-autotune", cache_dir=str(Path("out") / "compile_cache")
    )
    assert CompileSection().settings(Path("out")) is None  # off unless enabled
    assert CompileSection(enabled=True, cache_dir="elsewhere").settings(Path("out")).cache_dir == "elsewhere"


def test_compile_options_reach_the_engine_and_are_checked_when_the_config_is_read():
    config = load_run_config(
        DEBUG, ["--model.compile.enabled", "true", "--model.compile.options", "{max_autotune: true}"]
    )
    assert config.model.compile.settings(Path("out")).options == {"max_autotune": True}
    with pytest.raises(
        ValueError, match=r"Unexpected optimization option max_autotun \(did you mean max_autotune\?"
    ):
        load_run_config(
            DEBUG, ["--model.compile.enabled", "true", "--model.compile.options", "{max_autotun: true}"]
        )
    with pytest.raises(ValueError, match=r"give compile mode or options, not both"):
        CompileSection(enabled=True, mode="max-autotune", options={"max_autotune": True})


@pytest.mark.parametrize(
    "given",
    [
        ["--model.compile.options", "{triton.cudagraphs: true}"],
        ["--model.compile.options", "{triton: {cudagraphs: true}}"],
        ["--model.compile.options.triton.cudagraphs", "true"],
    ],
    ids=["dotted name", "nested", "dotted override"],
)
def test_inductor_options_are_taken_by_their_dotted_names_or_nested(given):
    config = load_run_config(DEBUG, ["--model.compile.enabled", "true", *given])
    assert config.model.compile.settings(Path("out")).options == {"triton.cudagraphs": True}


def test_an_option_whose_value_is_a_mapping_stays_whole():
    fusions = {"post_grad_fusion_options": {"batch_linear_post_grad": {}}}
    assert CompileSection(enabled=True, options=fusions).settings(Path("out")).options == fusions
    nested = {"aot_inductor": {"metadata": {"key": "value"}}}  # a mapping-valued option under a prefix
    assert dotted_options(nested) == {"aot_inductor.metadata": {"key": "value"}}


@pytest.mark.parametrize(
    ("setting", "value"), [("mode", "max-autotune"), ("options", "{max_autotune: true}")]
)
def test_compile_settings_without_enabled_are_named(setting, value):
    with pytest.raises(
        ValueError, match=rf"model.compile.{setting} is set but model.compile.enabled is false"
    ):
        load_run_config(DEBUG, [f"--model.compile.{setting}", value])
