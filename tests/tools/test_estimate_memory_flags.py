"""scripts/estimate_memory.py --config estimates the run the config builds: flags it decides are refused."""

from __future__ import annotations

import pytest

from scripts.estimate_memory import parse_args


def test_the_optimizer_is_the_runs_with_a_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", "run.yaml", "--optimizer", "sgd"])
    assert exit_info.value.code == 2 and "--config decides --optimizer" in capsys.readouterr().err
    assert parse_args(["--config", "run.yaml"]).optimizer == "adamw"
    assert parse_args(["--optimizer", "sgd"]).optimizer == "sgd"


@pytest.mark.parametrize(("flag", "value"), [("--world-sizes", ","), ("--stages", "")])
def test_an_empty_list_is_refused(flag, value, capsys):
    # it printed an empty table and exited 0
    with pytest.raises(SystemExit) as exit_info:
        parse_args([flag, value])
    assert (
        exit_info.value.code == 2
        and f"expected at least one integer, got {value!r}" in capsys.readouterr().err
    )
