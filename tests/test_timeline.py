"""The memory timeline: built from an allocator snapshot's trace, kept compact, read back bounded."""

from __future__ import annotations

import gzip
import json

import pytest

from harness.measure.timeline import PHASES, MemoryTimeline, from_snapshot, site_of
from harness.models.inputs import InputError
from harness.runtime.memory_history import _phase_index

MODEL = {"filename": "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", "line": 77, "name": "forward"}
TORCH = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}
META = dict(case_id="001-x", fidelity="real", platform="nvidia", device_name="H100", torch_version="2.11",
            recorded="2026-11-26T00:00:00+00:00")


def _entry(action, addr, size, t, phase="", frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": list(frames),
            "user_metadata": f"oom-harness:{phase}" if phase else ""}


def _snapshot():
    return {"segments": [], "device_traces": [[
        _entry("segment_alloc", 0, 20 << 20, 100_000, "load"),
        _entry("alloc", 0, 8 << 20, 100_100, "load", [TORCH, MODEL]),
        _entry("alloc", 8 << 20, 4 << 20, 100_200, "forward", [TORCH]),
        _entry("free_requested", 8 << 20, 4 << 20, 100_300, "backward"),
        _entry("free_completed", 8 << 20, 4 << 20, 100_300, "backward"),
        _entry("alloc", 12 << 20, 6 << 20, 100_400, "backward", [MODEL]),
        _entry("segment_free", 100, 2 << 20, 100_500, "optimizer"),
        _entry("made_up_action", 0, 1, 100_600, "optimizer"),
    ]]}


def test_a_snapshot_becomes_columns_with_phases_and_named_sites():
    t = from_snapshot(_snapshot(), 0, lambda e: _phase_index(e, []), **META)
    assert len(t) == 7  # the unknown action is dropped, not guessed
    assert t.t_us[0] == 0 and t.t_us[-1] == 500
    assert [PHASES[p] for p in t.phase] == ["load", "load", "forward", "backward", "backward", "backward", "optimizer"]
    # the model's frame names the allocation, not the torch function under it
    assert t.sites[t.site[1]] == "qwen2/modeling_qwen2.py:77 forward"
    assert t.site[0] == -1  # a segment has no call site


def test_curve_peak_and_the_live_blocks_at_the_peak():
    t = from_snapshot(_snapshot(), 0, lambda e: _phase_index(e, []), **META)
    curve = t.curve()
    assert curve.allocated == [0, 8 << 20, 12 << 20, 8 << 20, 8 << 20, 14 << 20, 14 << 20]  # drops at the free request
    assert curve.reserved[0] == 20 << 20 and curve.reserved[-1] == 18 << 20
    index, peak = curve.peak("allocated")
    assert (index, peak) == (5, 14 << 20)
    live = t.live_at(index)
    assert [(b.size, b.phase) for b in live] == [(8 << 20, "load"), (6 << 20, "backward")]
    assert [s for s, _, _ in t.phase_spans()] == ["load", "forward", "backward", "optimizer"]


def test_phases_come_from_time_marks_where_torch_keeps_no_metadata():
    marks = [(1000, PHASES.index("load")), (1002, PHASES.index("forward")), (1004, PHASES.index("optimizer"))]
    assert _phase_index({"time_us": 999}, marks) == -1
    assert _phase_index({"time_us": 1003}, marks) == PHASES.index("forward")
    assert _phase_index({"time_us": 1004}, marks) == PHASES.index("optimizer")


def test_save_and_load_round_trip(tmp_path):
    t = from_snapshot(_snapshot(), 0, lambda e: _phase_index(e, []), **META)
    path = t.save(tmp_path / "rank0-memory.json.gz")
    assert MemoryTimeline.load(path) == t


def _write(path, data: bytes):
    path.write_bytes(gzip.compress(data))
    return path


def test_a_damaged_or_hostile_timeline_is_refused_with_the_file_named(tmp_path):
    t = from_snapshot(_snapshot(), 0, lambda e: _phase_index(e, []), **META).model_dump()
    t["size"] = t["size"][:-1]
    bad = _write(tmp_path / "short.json.gz", json.dumps(t).encode())
    with pytest.raises(InputError, match=r"short\.json\.gz"):
        MemoryTimeline.load(bad)
    not_gzip = tmp_path / "plain.json.gz"
    not_gzip.write_text("{}")
    with pytest.raises(InputError, match="not a gzip file"):
        MemoryTimeline.load(not_gzip)
    bomb = _write(tmp_path / "bomb.json.gz", b" " * (600 * 2**20))  # 600 MiB of spaces, ~600 KiB packed
    with pytest.raises(InputError, match="unpacks to more than"):
        MemoryTimeline.load(bomb)


def test_site_of_falls_back_to_the_innermost_frame():
    assert site_of([TORCH]) == "nn/functional.py:9 linear"
    assert site_of([]) is None


@pytest.mark.gpu
def test_a_gpu_run_records_its_timeline_and_it_agrees_with_the_measured_peak(tmp_path):
    """On a CUDA host: `run --memory-history` leaves rank 0's timeline in the run folder, with every
    phase of the step, named call sites, and an allocated curve whose step peak is the peak the
    worker measured with `torch.cuda.max_memory_allocated`."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA card")
    from harness.measure.records import RankReport

    cli = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--fidelity", "tiny", "--memory-history",
                          "-k", "003-qlora-fix-r16-seq512-gc", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    report_path = next(tmp_path.rglob("rank0.json"))
    report = RankReport.model_validate_json(report_path.read_text())
    assert report.memory_timeline == "rank0-memory.json.gz"
    timeline = MemoryTimeline.load(report_path.parent / report.memory_timeline)
    assert not timeline.dropped
    assert {"load", "forward", "backward", "optimizer"} <= {name for name, _, _ in timeline.phase_spans()}
    curve = timeline.curve()
    step_start = next(start for name, start, _ in timeline.phase_spans() if name == "forward")
    step_peak = max(curve.allocated[step_start:])
    assert step_peak == pytest.approx(report.step.allocated, rel=0.02)
    _, peak = curve.peak("allocated")
    assert any(b.site != "?" for b in timeline.live_at(curve.allocated.index(peak))[:5])


def test_segments_from_before_the_recording_come_first_so_the_replay_starts_empty():
    initial = [{"device": 0, "address": 1 << 30, "total_size": 2 << 20, "stream": 0,
                "blocks": [{"address": 1 << 30, "size": 512, "state": "active_allocated"},
                           {"address": (1 << 30) + 512, "size": (2 << 20) - 512, "state": "inactive"}]}]
    t = from_snapshot(_snapshot(), 0, lambda e: _phase_index(e, []), initial, **META)
    assert len(t) == 9
    curve = t.curve()
    assert curve.reserved[-1] == (2 << 20) + (18 << 20)
    assert curve.allocated[1] == 512 and t.phase[:2] == [-1, -1]


def test_times_are_kept_to_a_tenth_of_a_millisecond_and_stored_as_differences(tmp_path):
    snap = {"device_traces": [[_entry("alloc", 4096 * i, 512, 1_000_000 + 37 * i, "forward") for i in range(50)]]}
    t = from_snapshot(snap, 0, lambda e: _phase_index(e, []), **META)
    assert all(x % 100 == 0 for x in t.t_us) and t.t_us[-1] == 49 * 37 // 100 * 100
    stored = json.loads(gzip.decompress(t.save(tmp_path / "t.json.gz").read_bytes()))
    assert stored["addr"][1:] == [4096] * 49  # differences, not addresses
    assert MemoryTimeline.load(tmp_path / "t.json.gz").addr == t.addr
