"""Run metrics: model FLOPs utilisation's denominator, the loss curve written at the end of a run, and
the Accelerate trackers that record the metrics."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

logger = logging.getLogger(__name__)

# Dense peak FLOP/s per device for 16-bit matmuls (vendor datasheets, without sparsity).
PEAK_16BIT_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L4": 121e12,
    "V100": 125e12,
}


def peak_flops_per_device(device: torch.device, mixed_precision: str) -> float | None:
    """The device's peak FLOP/s for MFU, when known (CUDA GPUs in the table); None on CPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_16BIT_FLOPS.items():
        if key in name:
            return flops if mixed_precision in ("bf16", "fp16") else flops / 2  # TF32 is half the 16-bit rate
    logger.warning("unknown GPU %r: MFU is not reported (set train.peak_flops)", name)
    return None


@dataclass
class LossCurve:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    perplexities: list[float] = field(default_factory=list)

    def add(self, step: int, loss: float) -> None:
        self.steps.append(step)
        self.losses.append(loss)

    def add_eval(self, step: int, perplexity: float) -> None:
        self.eval_steps.append(step)
        self.perplexities.append(perplexity)

    def state_dict(self) -> dict[str, list]:
        return {name: list(values) for name, values in self.__dict__.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, list]) -> LossCurve:
        """The curve `state_dict` gave; a ValueError naming what differs when `state` is not one (a
        series that is not a list of numbers, series of unequal lengths)."""
        if not isinstance(state, dict):
            raise ValueError(f"a loss curve is a JSON object of lists, got {type(state).__name__}")
        series = {f.name: state.get(f.name, []) for f in fields(cls)}
        for name, values in series.items():
            if not isinstance(values, list) or not all(
                isinstance(value, (int, float)) and not isinstance(value, bool) for value in values
            ):
                raise ValueError(f"the loss curve's {name!r} is not a list of numbers")
        for steps, values in (("steps", "losses"), ("eval_steps", "perplexities")):
            if len(series[steps]) != len(series[values]):
                raise ValueError(
                    f"the loss curve has {len(series[steps])} {steps} and {len(series[values])} {values}"
                )
        return cls(**{name: list(values) for name, values in series.items()})

    def save(self, directory: Path) -> None:
        """`loss_curve.json` always, and `loss_curve.png` (training loss and validation perplexity) when
        matplotlib is installed."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "loss_curve.json").write_text(json.dumps(self.state_dict()))
        try:
            import matplotlib
        except ImportError:  # an offline image may lack it: the curve stays in loss_curve.json
            logger.warning("matplotlib is not installed: no loss_curve.png (pip install matplotlib)")
            return

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        axis.plot(self.steps, self.losses, label="training loss")
        axis.set_xlabel("step")
        axis.set_ylabel("loss")
        if self.eval_steps:
            other = axis.twinx()
            other.plot(
                self.eval_steps, self.perplexities, "o-", color="tab:orange", label="validation perplexity"
            )
            other.set_ylabel("perplexity")
        axis.set_title("tnlg pretraining")
        figure.legend(loc="upper right")
        figure.tight_layout()
        figure.savefig(directory / "loss_curve.png", dpi=100)
        plt.close(figure)


def tracker_names(requested: list[str]) -> list[str]:
    """Accelerate tracker names for `logging.trackers`; "auto" is TensorBoard when installed."""
    available = {str(t.value) if hasattr(t, "value") else str(t) for t in get_available_trackers()}
    known = sorted(str(t.value) for t in LoggerType if t is not LoggerType.ALL)
    names = []
    for name in requested:
        if name == "auto":
            names.extend(["tensorboard"] if "tensorboard" in available else [])
        elif name not in known:
            raise ValueError(
                f"logging.trackers: unknown tracker {name!r}; Accelerate knows {known} (or auto)"
            )
        elif name not in available:
            raise ValueError(f"logging.trackers: {name!r} is not installed (pip install {name})")
        else:
            names.append(name)
    return sorted(set(names))


def flat_settings(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The run config's settings by dotted key (`section.key`); a list or an empty mapping is one setting."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flat_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def flat_hyperparameters(tree: dict[str, Any]) -> dict[str, Any]:
    """The run config as `section.key` scalars (trackers such as TensorBoard take no nesting)."""
    return {
        name: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
        for name, value in flat_settings(tree).items()
    }
