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
