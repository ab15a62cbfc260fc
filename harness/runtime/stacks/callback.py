"""The harness's measurement, attached to a framework's trainer from outside: one `TrainerCallback`.

The trainer does everything a user's job does (its DeepSpeed or accelerate setup, optimizer, scheduler,
mixed precision, gradient clipping, its dataloader); the callback only marks the phases the harness
reports, with the same meaning as in the harness's own loop (`harness.runtime.train`):

* `on_train_begin`, after the trainer has built its engine and optimizer: the step phase starts
  (peaks reset, as the harness's loop resets them once the engine is ready);
* `on_step_begin` / `on_step_end`: each optimizer step (all its micro-steps) timed from a synchronised
  start; the clocks restart after the warm-up steps;
* `on_log`: the step's loss as the trainer logs it (logging every step).
"""

from __future__ import annotations

import time

from transformers import TrainerCallback


class MeasuringCallback(TrainerCallback):
    """Times and measures a trainer's steps into a `RankReport` (`harness.measure.records`)."""

    def __init__(self, meas, report, progress, history=None, steps: int | None = None):
        self.meas = meas
        self.report = report
        self.progress = progress
        self.history = history
        self.steps = steps
        self.t0: float | None = None

    def _phase(self, name: str) -> None:
        if self.history is not None:
            self.history.phase(name)

    def on_train_begin(self, args, state, control, **kwargs):
        self.meas.check_cpu_limit()
        self.progress("engine ready")
        self.meas.sync()
        self.meas.reset()

    def on_step_begin(self, args, state, control, **kwargs):
        self.meas.sync()
        self.t0 = time.perf_counter()
        self._phase("forward")

    def on_substep_end(self, args, state, control, **kwargs):
        self.meas.check_cpu_limit()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self.meas.sync()
        self.report.step_times_s.append(time.perf_counter() - self.t0)
        self.meas.check_cpu_limit()
        done = len(self.report.step_times_s)
        self.progress(f"step {done}/{self.steps or state.max_steps} in {self.report.step_times_s[-1]:.2f} s")
        if done == self.report.warmup_steps:
            self.meas.sampler.reset_clocks()  # the clock of the timed steps, not of the warm-up's compilation

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.report.losses.append(float(logs["loss"]))
