"""Loss scaling for fp16: static, or dynamic with a growth window and hysteresis (as in DeepSpeed)."""

from __future__ import annotations

from .config import ZeroConfig


class LossScaleError(FloatingPointError):
    """fp16 gradients overflow even at the minimum loss scale."""


class LossScaler:
    """The factor the loss is multiplied by before backward (1.0 unless fp16).

    Dynamic scaling (DeepSpeed's hysteresis): an overflow skips the step; the first `hysteresis - 1`
    overflows since the last growth are absorbed, every further one halves the scale (not below
    `min_loss_scale`); clean steps double it once `loss_scale_window` of them have passed and re-arm the
    hysteresis (with `consecutive_hysteresis`, every clean step re-arms it). `loss_scale_counting`
    says when the window is full ([Note: loss-scale counting]).
    An overflow that would halve a scale already at the minimum raises `LossScaleError`, as DeepSpeed's
    scaler does: from there every step would be skipped, and the run would go on training nothing.
    """

    def __init__(self, config: ZeroConfig):
        self.fp16 = config.mixed_precision == "fp16"
        self.dynamic = config.mixed_precision == "fp16" and config.static_loss_scale is None
        if config.mixed_precision != "fp16":
            self.scale = 1.0
        else:
            self.scale = config.static_loss_scale or config.initial_loss_scale
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self.consecutive_hysteresis = config.consecutive_hysteresis
        # [Note: loss-scale counting]
        # `_clean_steps` counts toward the window: the scale doubles when it reaches `window`, and it
        # starts again from 0. torch's GradScaler (and Megatron-LM) count the clean steps themselves, from 0
        # at the start and after each overflow, so the window's last clean step doubles. DeepSpeed's
        # DynamicLossScaler doubles when the clean updates *before* this one since the last overflow (or
        # the start) are a positive multiple of the window: at the window's + 1st clean step, then every
        # window. Starting its count at -1 there, and again after each overflow, is that rule; the
        # DeepSpeed checkpoint reader writes its position in the same count (zero_checkpoint.py).
        self._count_start = -1 if config.loss_scale_counting == "deepspeed" else 0
        self._clean_steps = self._count_start
        self._overflows_left = config.hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = self._count_start
            if self._overflows_left > 1:
                self._overflows_left -= 1  # absorbed by hysteresis
            elif self.scale <= self.min_scale:
                raise LossScaleError(
                    f"the fp16 gradients overflowed at the minimum loss scale {self.min_scale} "
                    "(min_loss_scale): the steps would all be skipped from here. Look for the cause (a "
                    "learning rate too high, bad data), train in bf16, or lower min_loss_scale"
                )
            else:
                self.scale = max(self.scale / 2.0, self.min_scale)  # and every further overflow halves
            return
        self._clean_steps += 1
        if self.consecutive_hysteresis:
            self._overflows_left = self.hysteresis
        if self._clean_steps >= self.window:
            self.scale *= 2.0
            self._clean_steps = 0
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float | int | bool]:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "overflows_left": self._overflows_left,
            "dynamic": self.dynamic,
        }

    def resume(self, mixed_precision: str, state: dict[str, float | int | bool]) -> str | None:
        """Take back a checkpoint's scaler `state`, saved under `mixed_precision`, only where this scaler
        and the saved one both scale dynamically in fp16: the one case where the saved scale is a point
        on this scaler's own path. Anything else (a bf16 or fp32 checkpoint's 1.0, a static scale on
        either side) would replace the configured scale, so that is kept. Returns what was kept and why
        (None: restored, or nothing to restore). A checkpoint without "dynamic" (older than the key)
        counts as dynamic, fp16's default."""
        if not self.fp16:
            return None  # no loss scaling: the scale is 1.0 whatever was saved
        if not self.dynamic:
            if float(state["scale"]) == self.scale:
                return None
            return f"this engine's static fp16 loss scale {self.scale} is kept, as configured"
        if mixed_precision != "fp16":
            return (
                f"the checkpoint was saved with mixed_precision {mixed_precision!r}; this engine keeps "
                f"its initial fp16 loss scale {self.scale}"
            )
        if not state.get("dynamic", True):
            return (
                f"the checkpoint's fp16 loss scale was static ({state['scale']}); this engine keeps its "
                f"initial dynamic scale {self.scale}"
            )
        self.load_state_dict(state)
        return None

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
