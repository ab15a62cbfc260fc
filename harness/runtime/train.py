"""The step phase: the case's optimizer steps, each of `grad_accum` micro-steps, timed one by one from a
synchronised start, with the loss of each; the clocks are read over the steps after the warm-up.

Each step is timed twice: on the host's wall clock (what a user waits for) and, on a GPU, on the
device's own clock (CUDA events recorded on the stream around the step: the time from the step's
first kernel being queued to its last finishing, which a busy host or a slow Python loop shows
less of than the wall clock does).

`HARNESS_INJECT_DELAY` (a test hook, documented in docs/baselines.md) slows every step on purpose so
that the regression checks' power can be measured: `5%` makes each step 5% longer than the steps
would take without it, `0.02s` adds 0.02 s to each step. The delay is spent in backward: after each
micro-step's backward the device is waited for and the host sleeps (`Delay`). Unset, nothing changes.
"""

from __future__ import annotations

import os
import statistics
import time

INJECT_ENV = "HARNESS_INJECT_DELAY"


class DelayError(ValueError):
    """An `HARNESS_INJECT_DELAY` value that is neither a percentage nor seconds."""


class Delay:
    """The injected delay of `HARNESS_INJECT_DELAY`: a share of the step's own undelayed time, or seconds
    per step. A share is spent as the step goes: at each micro-step's backward (and once more at the
    step's end, for the optimizer) the device is waited for and the host sleeps that share of the time
    since the last such point, so every step is that share longer than it would have been."""

    def __init__(self, text: str | None):
        self.share = self.seconds = 0.0
        text = (text or "").strip()
        try:
            if text.endswith("%"):
                self.share = float(text[:-1]) / 100
            elif text.endswith("s"):
                self.seconds = float(text[:-1])
            elif text:
                raise ValueError(text)
        except ValueError:
            raise DelayError(f"{INJECT_ENV}={text!r}: give a share of the step ('5%') or seconds per step "
                             f"('0.02s'), or unset it") from None
        if not (0 <= self.share <= 10 and 0 <= self.seconds <= 3600):
            raise DelayError(f"{INJECT_ENV}={text!r}: a delay from 0% to 1000%, or 0 s to an hour per step")
        self.mark = 0.0  # the end of the last delay (time.perf_counter)

    @property
    def active(self) -> bool:
        return bool(self.share or self.seconds)

    def start(self) -> None:
        self.mark = time.perf_counter()

    def spend(self, share_of_seconds: float, sync) -> None:
        """Wait for the device, then sleep: a share of the time since the last delay, or `share_of_seconds`
        of the fixed seconds per step."""
        sync()
        now = time.perf_counter()
        wait = self.share * (now - self.mark) + self.seconds * share_of_seconds
        if wait > 0:
            time.sleep(wait)
        self.mark = time.perf_counter()


def train_steps(trainer, shape, batches, device, meas, report, progress, history=None, turns=None) -> None:
    """Run `shape.steps` optimizer steps; append each step's seconds and mean loss to `report`, and
    on a GPU each step's device seconds (`report.step_device_s`).
    `history` (harness.runtime.memory_history), where recording, labels each phase of the step;
    `turns` (harness.runtime.turns), where a compare takes turns on the card, stops at its gates."""
    import torch

    def phase(name: str) -> None:
        if history is not None:
            history.phase(name)

    delay = Delay(os.environ.get(INJECT_ENV))
    if delay.active:
        report.injected_delay = os.environ[INJECT_ENV].strip()
    on_gpu = device.type == "cuda"
    engine, model = trainer.engine, trainer.model
    for _ in range(shape.steps):
        if turns is not None:
            turns.before_step(len(report.step_times_s))
        meas.sync()
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        delay.start()
        losses = []
        for _micro in range(shape.grad_accum):
            phase("forward")
            batch = next(batches).to(device, non_blocking=True)
            out = trainer.runner(input_ids=batch, labels=batch)
            loss = out.loss
            phase("backward")
            if engine is not None:
                engine.backward(loss)
                if delay.active:
                    delay.spend(1 / shape.grad_accum, meas.sync)
                phase("optimizer")
                engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            else:
                (loss / shape.grad_accum).backward()
                if delay.active:
                    delay.spend(1 / shape.grad_accum, meas.sync)
            losses.append(float(loss.detach()))
            del out, loss
            meas.check_cpu_limit()
        if engine is None:
            phase("optimizer")
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        if delay.active:
            delay.spend(0.0, meas.sync)  # the share of the optimizer's time
        if on_gpu:
            end.record()
        meas.sync()
        report.step_times_s.append(time.perf_counter() - t0)
        if on_gpu:
            report.step_device_s.append(start.elapsed_time(end) / 1000)
        report.losses.append(statistics.fmean(losses))
        progress(f"step {len(report.step_times_s)}/{shape.steps} in {report.step_times_s[-1]:.2f} s")
        if len(report.step_times_s) == report.warmup_steps:
            meas.sampler.reset_clocks()  # the clock of the timed steps, not of the warm-up's compilation
