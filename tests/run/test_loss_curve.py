"""The loss curve a run checkpoint carries reads back as it was saved; JSON of another shape is a
ValueError naming what differs (a resume turns it into a CheckpointError naming the file), not an
AttributeError or a curve whose series no longer line up."""

from __future__ import annotations

import json

import pytest

from tnlg.run.metrics import LossCurve


def test_a_saved_curve_reads_back_equal():
    curve = LossCurve()
    curve.add(1, 3.5)
    curve.add(2, 3.25)
    curve.add_eval(2, 25.0)
    assert LossCurve.from_state_dict(json.loads(json.dumps(curve.state_dict()))) == curve
    assert LossCurve.from_state_dict({}) == LossCurve()  # saved before evaluation was recorded: empty series


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ([], "a loss curve is a JSON object of lists, got list"),
        ({"steps": 5, "losses": []}, "the loss curve's 'steps' is not a list of numbers"),
        ({"steps": [1], "losses": ["3.5"]}, "the loss curve's 'losses' is not a list of numbers"),
        ({"steps": [True], "losses": [3.5]}, "the loss curve's 'steps' is not a list of numbers"),
        ({"steps": [1, 2], "losses": [3.5]}, "the loss curve has 2 steps and 1 losses"),
        ({"eval_steps": [2], "perplexities": []}, "the loss curve has 1 eval_steps and 0 perplexities"),
    ],
)
def test_another_shape_is_refused_naming_what_differs(state, says):
    with pytest.raises(ValueError, match=says):
        LossCurve.from_state_dict(state)
