"""Loss scaling for fp16: static, or dynamic with a growth window and hysteresis (as in DeepSpeed)."""

from __future__ import annotations

from .config import ZeroConfig


class LossScaler:
    """The factor the loss is multiplied by before backward (1.0 unless fp16).

    Dynamic scaling (DeepSpeed's rule): an overflow skips the step; the first `hysteresis - 1`
    overflows since the last growth are absorbed, every further one halves the scale (not below
    `min_loss_scale`); `loss_scale_window` clean steps in a row double it and re-arm the hysteresis.
    """

    def __init__(self, config: ZeroConfig):
        self.dynamic = config.mixed_precision == "fp16" and config.static_loss_scale is None
        if config.mixed_precision != "fp16":
            self.scale = 1.0
        else:
            self.scale = config.static_loss_scale or config.initial_loss_scale
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self._clean_steps = 0
        self._overflows_left = config.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._overflows_left > 1:
                self._overflows_left -= 1  # absorbed by hysteresis
            else:
                self.scale = max(self.scale / 2.0, self.min_scale)  # and every further overflow halves
            return
        self._clean_steps += 1
        if self._clean_steps >= self.window:
            self.scale *= 2.0
            self._clean_steps = 0
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
