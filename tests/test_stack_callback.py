"""The measuring callback a framework's trainer carries (harness.runtime.stacks.callback): it times each
optimizer step and spends `HARNESS_INJECT_DELAY` as the harness's own loop does, so a throughput check
can be tried on a framework's run too."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from harness.runtime.stacks.callback import MeasuringCallback


class _Meas:
    def __init__(self):
        self.syncs = 0
        self.sampler = SimpleNamespace(reset_clocks=lambda: None)

    def sync(self):
        self.syncs += 1

    def check_cpu_limit(self):
        pass

    def reset(self):
        pass


def _step(callback, work_s: float, micro_steps: int) -> None:
    args = SimpleNamespace(gradient_accumulation_steps=micro_steps, use_cpu=True)
    state = SimpleNamespace(max_steps=1)
    callback.on_step_begin(args, state, None)
    for i in range(micro_steps):
        time.sleep(work_s)  # a micro-step's forward and backward
        if i < micro_steps - 1:
            callback.on_substep_end(args, state, None)
    callback.on_pre_optimizer_step(args, state, None)
    callback.on_step_end(args, state, None)


@pytest.mark.parametrize("delay, low", [(None, 0.08), ("50%", 0.115)])
def test_a_step_is_timed_with_its_injected_share_of_delay(monkeypatch, delay, low):
    if delay is None:
        monkeypatch.delenv("HARNESS_INJECT_DELAY", raising=False)
    else:
        monkeypatch.setenv("HARNESS_INJECT_DELAY", delay)
    report = SimpleNamespace(step_times_s=[], step_device_s=[], losses=[], warmup_steps=5, injected_delay=None)
    callback = MeasuringCallback(_Meas(), report, progress=lambda _: None)
    _step(callback, 0.04, micro_steps=2)
    assert report.injected_delay == delay
    # 0.08 s of work, and with the delay half as much again (a lower bound: a loaded host only lengthens both)
    assert report.step_times_s[0] >= low, report.step_times_s
    assert report.step_device_s == []  # no CUDA events on a CPU
