"""The harness's measurement, attached to a framework's trainer from outside: one `TrainerCallback`.

The trainer does everything a user's job does (its DeepSpeed or accelerate setup, optimizer, scheduler,
mixed precision, gradient clipping, its dataloader); the callback only marks the phases the harness
reports, with the same meaning as in the harness's own loop (`harness.runtime.train`):

* `on_train_begin`, after the trainer has built its engine and optimizer: the step phase starts
  (peaks reset, as the harness's loop resets them once the engine is ready);
* `on_step_begin` / `on_step_end`: each optimizer step (all its micro-steps) timed from a synchronised
  start, on a GPU also by CUDA events (`step_device_s`, as the harness's loop times it); the clocks
  restart after the warm-up steps;
* `on_substep_end` / `on_pre_optimizer_step`: where `HARNESS_INJECT_DELAY` is set, each micro-step's
  share of the delay, spent after its backward as the harness's loop spends it (`harness.runtime.train.Delay`),
  and the optimizer's share at the step's end;
* `on_log`: the step's loss as the trainer logs it (logging every step).
"""

from __future__ import annotations

import os
import time

import torch
from transformers import TrainerCallback

from harness.runtime.train import INJECT_ENV, Delay


class MeasuringCallback(TrainerCallback):
    """Times and measures a trainer's steps into a `RankReport` (`harness.measure.records`)."""

    def __init__(self, meas, report, progress, history=None, steps: int | None = None, turns=None):
        self.meas = meas
        self.turns = turns  # harness.runtime.turns: a compare's gates between bursts of steps
        self.report = report
        self.progress = progress
        self.history = history
        self.steps = steps
        self.t0: float | None = None
        self.delay = Delay(os.environ.get(INJECT_ENV))
        if self.delay.active:
            report.injected_delay = os.environ[INJECT_ENV].strip()
        self.events: tuple | None = None
        self.micro_share = 1.0

    def _phase(self, name: str) -> None:
        if self.history is not None:
            self.history.phase(name)

    def on_train_begin(self, args, state, control, **kwargs):
        self.meas.check_cpu_limit()
        self.progress("engine ready")
        self.meas.sync()
        self.meas.reset()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.turns is not None:
            self.turns.before_step(len(self.report.step_times_s))
        self.meas.sync()
        self.micro_share = 1 / max(1, args.gradient_accumulation_steps)
        if torch.cuda.is_available() and not args.use_cpu:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()
        self.delay.start()
        self._phase("forward")

    def on_substep_end(self, args, state, control, **kwargs):
        if self.delay.active:
            self.delay.spend(self.micro_share, self.meas.sync)
        self.meas.check_cpu_limit()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.delay.active:  # the last micro-step's backward is done
            self.delay.spend(self.micro_share, self.meas.sync)
        self._phase("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.delay.active:
            self.delay.spend(0.0, self.meas.sync)  # the share of the optimizer's time
        if self.events is not None:
            self.events[1].record()
        self.meas.sync()
        self.report.step_times_s.append(time.perf_counter() - self.t0)
        if self.events is not None:
            self.report.step_device_s.append(self.events[0].elapsed_time(self.events[1]) / 1000)
        self.meas.check_cpu_limit()
        done = len(self.report.step_times_s)
        self.progress(f"step {done}/{self.steps or state.max_steps} in {self.report.step_times_s[-1]:.2f} s")
        if done == self.report.warmup_steps:
            self.meas.sampler.reset_clocks()  # the clock of the timed steps, not of the warm-up's compilation

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.report.losses.append(float(logs["loss"]))
