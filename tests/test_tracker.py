"""The CPU tracker counts live tensor storage exactly: a known allocation is measured within
0 bytes for plain tensors, and within 1% where an operator may allocate scratch space."""

from pathlib import Path

import pytest
import torch

from harness.measure.trackers import LiveTensorTracker

MIB = 2**20


def test_a_known_allocation_is_measured_exactly():
    with LiveTensorTracker() as tracker:
        before = tracker.current()
        t = torch.empty(MIB // 4, dtype=torch.float32)  # 1 MiB
        assert tracker.current() - before == MIB
        assert tracker.peak_bytes() - before == MIB
        del t
        assert tracker.current() == before
        assert tracker.peak_bytes() - before == MIB  # the peak stays


def test_views_share_their_storage_and_count_once():
    with LiveTensorTracker() as tracker:
        t = torch.zeros(256, 1024, dtype=torch.float32)
        base = tracker.current()
        views = [t[i] for i in range(10)] + [t.view(-1), t.t()]
        assert tracker.current() == base
        del views, t


def test_peak_sees_a_transient_inside_a_computation():
    with LiveTensorTracker() as tracker:
        a = torch.ones(512, 512)
        tracker.reset_peak()
        start = tracker.current()
        b = (a * 2).sum()  # a 1 MiB temporary, freed before we look again
        assert tracker.current() - start < 1024
        transient = tracker.peak_bytes() - start
        assert abs(transient - MIB) <= 0.01 * MIB
        del a, b


def test_in_place_resize_is_followed():
    with LiveTensorTracker() as tracker:
        t = torch.empty(0, dtype=torch.uint8)
        start = tracker.current()
        t.resize_(3 * MIB)
        assert tracker.current() - start == 3 * MIB
        del t


def test_backward_activations_are_counted_and_released():
    with LiveTensorTracker() as tracker:
        w = torch.randn(256, 256, requires_grad=True)
        x = torch.randn(64, 256)
        start = tracker.current()
        y = torch.tanh(x @ w).sum()
        held = tracker.current() - start
        assert held >= 64 * 256 * 4  # tanh's output is saved for backward
        y.backward()
        del y
        assert tracker.current() - start <= w.numel() * 4 + 1024  # only the gradient remains


# --- ROCm / DCU device figures ------------------------------------------------------------------


def test_amdsmi_records_give_this_process_vram_in_either_layout():
    from harness.measure.trackers import amdsmi_process_vram

    records = [{"pid": 11, "memory_usage": {"vram_mem": 5 * 2**30, "gtt_mem": 1}},
               {"pid": 12, "mem": 7 * 2**30}]  # older amdsmi releases
    assert amdsmi_process_vram(records, 11) == 5 * 2**30
    assert amdsmi_process_vram(records, 12) == 7 * 2**30
    assert amdsmi_process_vram(records, 13) is None


def test_rocm_smi_and_hy_smi_json_give_the_cards_used_vram():
    from harness.measure.trackers import smi_card_used_vram

    text = ('{"card0": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "1073741824"},'
            ' "card1": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "42"}}')
    assert smi_card_used_vram(text, 0) == 2**30
    assert smi_card_used_vram(text, 1) == 42
    assert smi_card_used_vram(text, 2) is None
    assert smi_card_used_vram("ERROR: no GPU", 0) is None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the split is read from Linux's /proc")
def test_host_memory_tells_reclaimable_file_pages_from_anonymous_memory(tmp_path):
    """A memory-mapped file read through counts in the resident set, not in the anonymous part;
    heap memory counts in both."""
    import mmap

    from harness.measure.trackers import Sampler

    size = 256 * 2**20
    path = tmp_path / "checkpoint.bin"
    path.write_bytes(b"\1" * size)
    sampler = Sampler()
    sampler.sample()
    rss0, anon0 = sampler.host_peak, sampler.host_anon_peak
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, size, 4096)) == size // 4096  # every page touched
        sampler.sample()
    assert sampler.host_peak - rss0 > 0.9 * size
    assert sampler.host_anon_peak - anon0 < 0.1 * size
    heap = bytearray(b"\2" * size)
    sampler.sample()
    assert sampler.host_anon_peak - anon0 > 0.9 * size
    del heap


class _Clock:
    """A card whose SM clock reads `mhz` with NVML's clock-event `reasons` and utilization (%), one
    reading per sample."""

    max_mhz, power_limit_w = 1980, 700.0

    def __init__(self, readings):
        self.readings = iter(readings)

    def read(self):
        return next(self.readings)


def test_the_sampler_keeps_the_cards_clock_and_what_held_it_down():
    from harness.measure.trackers import Sampler

    power_cap = 0x4
    sampler = Sampler(clock_reader=_Clock([(1980, 0, 0),  # the warm-up step compiling: no kernel
                                           (1410, power_cap, 100),  # the warm-up step running
                                           (1980, power_cap, 100),  # the bit at the maximum clock: not held down
                                           (1410, power_cap, 100), (1980, 0, 0),  # no kernel in its window
                                           (1395, power_cap, 60)]))
    sampler.reset()  # the memory peaks start before the warm-up step (reset takes a reading)...
    sampler.sample()
    assert sampler.clocks().utilization == pytest.approx(0.5)  # ...and leave the clock's window alone
    sampler.reset_clocks()  # the timed steps begin
    for _ in range(4):
        sampler.sample()
    clocks = sampler.clocks()
    # the sample whose window saw no kernel (the card waiting on the host) gives no clock, and lowers
    # the share of the time kernels ran
    assert (clocks.samples, clocks.sm_mhz_median, clocks.sm_mhz_min) == (3, 1410, 1395)
    assert clocks.utilization == pytest.approx((100 + 100 + 0 + 60) / 400)
    assert clocks.sm_mhz_max == 1980 and clocks.power_limit_w == 700.0
    assert clocks.slowed == {"power cap": pytest.approx(2 / 3)}


def test_a_card_running_no_kernel_has_no_clock_to_report():
    from harness.measure.trackers import Sampler

    sampler = Sampler(clock_reader=_Clock([(1980, 0, 0)] * 3))
    sampler.sample()
    sampler.sample()
    assert sampler.clocks() is None


def test_a_clock_the_card_will_not_report_leaves_the_memory_sampled():
    from harness.measure.trackers import Sampler

    class Refusing(_Clock):
        def read(self):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    sampler = Sampler(clock_reader=Refusing([]))
    sampler.sample()
    assert sampler.clocks() is None and sampler.host_peak > 0


def test_the_slowdown_bits_and_the_clock_queries_are_nvmls():
    """The clock reader cannot run without a GPU here: at least its bits and calls are nvidia-ml-py's."""
    pynvml = pytest.importorskip("pynvml")
    from harness.measure.clocks import SLOWDOWNS

    for name in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetEnforcedPowerLimit",
                 "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetUtilizationRates", "NVML_CLOCK_SM"):
        assert hasattr(pynvml, name), name

    assert set(SLOWDOWNS) == {pynvml.nvmlClocksThrottleReasonSwPowerCap, pynvml.nvmlClocksThrottleReasonHwSlowdown,
                              pynvml.nvmlClocksThrottleReasonSwThermalSlowdown,
                              pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
                              pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown}
