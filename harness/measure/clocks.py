"""The card's SM clock, and what slowed it, while the steps are timed.

Speed baselines come from several hosts, and hosts of one card kind differ: on 2026-11-26 guide
003's r32 QLoRA fixes ran about 33% below their baselines on one H100 host whose peaks matched them to
the byte, while the r16 fix (more, smaller kernels) ran at its usual speed there. A slower host CPU, a
card held below its clock by a power cap or heat, and a regression in the code all read as the
same refuted speed. So the sampler (`harness.measure.trackers.Sampler`) reads, beside the device memory,
NVML's current SM clock, its clock-event reasons (the bits `nvidia-smi -q -d PERFORMANCE`
prints) and the card's utilization, and the run keeps their summary (`report.Clocks`); the speed
verdict names it (`clock_note`). The host's CPU model is kept beside it (`host_cpu`).

NVIDIA only: ROCm's amdsmi reports clocks differently and is not read here (the run records none).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from harness.measure.records import Clocks

# NVML's clock-event reasons (nvml.h, nvmlClocksEventReason*) that hold a busy card's clock down;
# the others (application clock setting, display) are not a slowdown. A bit can be set while the
# clock stands at its maximum (power cap, seen on an H100 at 1,980 MHz): a sample counts as held
# down only where its clock is below the card's maximum.
SLOWDOWNS = {
    0x4: "power cap",  # SwPowerCap: the board's power limit
    0x8: "hardware slowdown",  # HwSlowdown: thermal or power brake, by the hardware
    0x20: "thermal (software)",  # SwThermalSlowdown
    0x40: "thermal (hardware)",  # HwThermalSlowdown
    0x80: "power brake",  # HwPowerBrakeSlowdown: an external signal
}


class NvmlClockReader:
    """The SM clock (MHz), clock-event reasons and utilization (%) of one NVIDIA card.

    Whether the card is running kernels comes from NVML's utilization (the share of its last sample
    period, 1/6 s to 1 s, in which a kernel ran), not from the GpuIdle clock-event reason: on an H100
    with a CUDA context that bit stayed clear and the clock at 1,980 MHz through 491 s of Triton
    compilation with no kernel to run (2026-11-26)."""

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

    def read(self) -> tuple[int, int, int]:
        return (int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)),
                int(self._reasons(self._handle)),
                int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))


class ClockSamples:
    """Clock readings taken by the sampler; `summary()` is what the run keeps."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.samples: list[tuple[int, int, int]] = []  # (SM MHz, clock-event reasons, utilization %)

    def sample(self) -> None:
        self.samples.append(self.reader.read())

    def reset(self) -> None:
        self.samples = []

    def summary(self) -> Clocks | None:
        # the clock the kernels ran at: samples whose utilization window saw a kernel
        busy = [(mhz, reasons) for mhz, reasons, util in self.samples if util > 0]
        if not busy:  # no sample, or no kernel throughout: no clock the kernels ran at
            return None
        mhz = [m for m, _ in busy]
        top = self.reader.max_mhz
        slowed = {}
        for bit, name in SLOWDOWNS.items():
            hits = sum(1 for m, reasons in busy if reasons & bit and m < top)
            if hits:
                slowed[name] = hits / len(busy)
        return Clocks(samples=len(busy), utilization=statistics.fmean(u for _, _, u in self.samples) / 100,
                      sm_mhz_median=int(statistics.median(mhz)), sm_mhz_min=min(mhz), sm_mhz_max=top,
                      power_limit_w=self.reader.power_limit_w, slowed=slowed)


def clock_note(clocks: Clocks | None, baseline: list[Clocks] | None = None) -> str:
    """'; SM clock 1,410 MHz while busy (median of 2,950 samples; the card's maximum 1,980), the
    baseline's 1,980 MHz; held down by power cap in 64% of them; kernels running 58% of the time,
    the baseline's 91%': the card's side of a speed, for a speed verdict. A card that runs kernels
    a small share of the time waits on its host (launches, the CPU's part of the step)."""
    if clocks is None:
        return ""
    note = (f"; SM clock {clocks.sm_mhz_median:,} MHz while busy (median of {clocks.samples:,} samples; "
            f"the card's maximum {clocks.sm_mhz_max:,})")
    if baseline:
        note += f", the baseline's {int(statistics.median(c.sm_mhz_median for c in baseline)):,} MHz"
    # a clock that never fell below the maximum was held down by nothing (runs recorded before
    # `summary` required it counted a power-cap bit set at 1,980 MHz)
    held = [f"{name} in {share:.0%}" for name, share in sorted(clocks.slowed.items(), key=lambda kv: -kv[1])
            if share >= 0.01 and clocks.sm_mhz_min < clocks.sm_mhz_max]
    if held:
        note += f"; held down by {', '.join(held)} of them"
    if clocks.utilization is not None:
        note += f"; kernels running {clocks.utilization:.0%} of the time"
        theirs = [c.utilization for c in baseline or [] if c.utilization is not None]
        if theirs:
            note += f", the baseline's {statistics.median(theirs):.0%}"
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
