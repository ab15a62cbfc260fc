"""The card's SM clock, and what slowed it, while the steps are timed.

Speed baselines come from lent hosts, and hosts of one card kind differ: on 2026-11-26 guide 003's
r32 QLoRA fixes ran about 33% below their baselines on one H100 host whose peaks matched them to the
byte, while the r16 fix (more, smaller kernels) ran at its usual speed there. A slower host CPU, a
card held below its clock by a power cap or heat, and a regression in the code all read as the
same refuted speed. So the sampler (`harness.tracker.Sampler`) reads, beside the device memory,
NVML's current SM clock and its clock-event reasons (the bits `nvidia-smi -q -d PERFORMANCE`
prints), and the run keeps their summary (`report.Clocks`); the speed verdict names it
(`clock_note`). The host's CPU model is kept beside it (`host_cpu`).

NVIDIA only: ROCm's amdsmi reports clocks differently and is not read here (the run records none).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.report import Clocks

# NVML's clock-event reasons (nvml.h, nvmlClocksEventReason*). Idle: nothing runs on the card and
# its clock drops; such samples (a step waiting on the host, as CPU Adam under offload makes it)
# say nothing of the clock the kernels ran at, and their share is counted apart.
IDLE = 0x1
# the reasons that hold a busy card's clock down; the others (application clock setting, display)
# are not a slowdown
SLOWDOWNS = {
    0x4: "power cap",  # SwPowerCap: the board's power limit
    0x8: "hardware slowdown",  # HwSlowdown: thermal or power brake, by the hardware
    0x20: "thermal (software)",  # SwThermalSlowdown
    0x40: "thermal (hardware)",  # HwThermalSlowdown
    0x80: "power brake",  # HwPowerBrakeSlowdown: an external signal
}


class NvmlClockReader:
    """The SM clock (MHz) and clock-event reasons of one NVIDIA card."""

    def __init__(self, nvml, handle) -> None:
        self._nvml, self._handle = nvml, handle
        self.max_mhz = int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
        try:
            self.power_limit_w: float | None = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
        except nvml.NVMLError:
            self.power_limit_w = None
        # renamed in NVML 12.x (ClocksThrottleReasons -> ClocksEventReasons); either may be present
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)

    def read(self) -> tuple[int, int]:
        return (int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)),
                int(self._reasons(self._handle)))


class ClockSamples:
    """Clock readings taken by the sampler; `summary()` is what the run keeps."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.samples: list[tuple[int, int]] = []

    def sample(self) -> None:
        self.samples.append(self.reader.read())

    def reset(self) -> None:
        self.samples = []

    def summary(self) -> Clocks | None:
        busy = [(mhz, reasons) for mhz, reasons in self.samples if not reasons & IDLE]
        if not busy:  # no sample, or the card idle throughout: no clock the kernels ran at
            return None
        mhz = [m for m, _ in busy]
        slowed = {}
        for bit, name in SLOWDOWNS.items():
            hits = sum(1 for _, reasons in busy if reasons & bit)
            if hits:
                slowed[name] = hits / len(busy)
        return Clocks(samples=len(busy), idle=1 - len(busy) / len(self.samples),
                      sm_mhz_median=int(statistics.median(mhz)), sm_mhz_min=min(mhz), sm_mhz_max=self.reader.max_mhz,
                      power_limit_w=self.reader.power_limit_w, slowed=slowed)


def clock_note(clocks: Clocks | None, baseline_mhz: list[int] | None = None) -> str:
    """'; SM clock 1,410 MHz while busy (median of 2,950 samples; the card's maximum 1,980), the
    baseline's 1,980 MHz; held down by power cap in 64% of them; the card idle in 12% of all
    samples': the card's side of a speed, for a speed verdict."""
    if clocks is None:
        return ""
    note = (f"; SM clock {clocks.sm_mhz_median:,} MHz while busy (median of {clocks.samples:,} samples; "
            f"the card's maximum {clocks.sm_mhz_max:,})")
    if baseline_mhz:
        note += f", the baseline's {int(statistics.median(baseline_mhz)):,} MHz"
    held = [f"{name} in {share:.0%}" for name, share in sorted(clocks.slowed.items(), key=lambda kv: -kv[1])
            if share >= 0.01]
    if held:
        note += f"; held down by {', '.join(held)} of them"
    if clocks.idle >= 0.01:
        note += f"; the card idle in {clocks.idle:.0%} of all samples"
    return note


def host_cpu() -> str | None:
    """The host CPU's model name (Linux /proc/cpuinfo), or None. py-cpuinfo would also give it, but
    it is not a dependency of every stack here and takes a second; one line of /proc is enough."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return None
