"""The dispatch table (harness.predict.dispatch): which row a kind of config takes, which method sizes each part
of its peak, and `oom-harness check --explain`, which prints both with each stage's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.predict.dispatch import ALLOCATED, DEVICE, RESERVED, TABLE, route_for, table_text
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.schema import Offload
from harness.spec.suite import ARCH_CASES_DIR, FITTED_CASES_DIR
from harness.spec.units import gib_rounded

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "configs" / "examples"
PLAIN_LORA = ARCH_CASES_DIR / "mistral-7b-lora-r8-qv-mb1-s2048.yaml"


def _with(case, env: str | None = None, **ds):
    """The case with DeepSpeed settings (and PYTORCH_CUDA_ALLOC_CONF) changed."""
    update = {}
    if ds:
        update["deepspeed"] = case.deepspeed.model_copy(update=ds)
    if env is not None:
        update["launch"] = case.launch.model_copy(update={"env": {"PYTORCH_CUDA_ALLOC_CONF": env}})
    return case.model_copy(update=update)


def test_every_row_names_known_methods_and_the_last_row_takes_every_config():
    for row in TABLE:
        assert row.allocated in ALLOCATED and row.reserved in RESERVED and row.fallback in RESERVED
        assert row.device in DEVICE
        # a fallback follows every allocator: it is what sizes the reserve where the row's method cannot
        assert set(RESERVED[row.fallback].allocators) == {"native", "expandable", "async"}
    assert not TABLE[-1].when()
    assert len({row.name for row in TABLE}) == len(TABLE)


@pytest.mark.parametrize(("case_file", "row", "allocated", "reserved"), [
    (CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml", "no-deepspeed", "terms", "stream"),
    (PLAIN_LORA, "no-deepspeed", "terms", "stream"),
    (CASES_DIR / "001-ladder-rung1-zero2.yaml", "zero2-stream", "zero2_stream", "zero2_stream"),
    (CASES_DIR / "001-ladder-rung2-zero2-offload.yaml", "zero2-stream", "zero2_stream", "zero2_stream"),
    (CASES_DIR / "001-ladder-rung3-zero3.yaml", "zero3", "terms", "zero3_ratio"),
    # expandable segments: the row's model's stream stands down to the ratio and the cached gathers
    (CASES_DIR / "002-gemma27b-full-z3-offload-len2048.yaml", "zero3-full-offload", "zero3_step_stream",
     "zero3_ratio"),
    (CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16-nonreentrant.yaml", "zero3-lora-offload", "zero3_step_stream",
     "zero3_model_stream"),
    (CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16-nonreentrant-no-overlap.yaml", "zero3-lora-offload-one-pool",
     "zero3_step_stream", "zero3_one_pool"),
    (ARCH_CASES_DIR / "gemma2-2b-full-z3-mb2-s1024-gc.yaml", "zero3-full-model-stream", "zero3_step_stream",
     "zero3_model_stream"),
])
def test_the_bundled_configs_take_their_rows(case_file, row, allocated, reserved):
    route = route_for(load_case(case_file))
    assert (route.row.name, route.allocated, route.reserved, route.device) == (row, allocated, reserved,
                                                                                "device_parts")


def test_every_bundled_case_takes_a_row():
    files = sorted(CASES_DIR.glob("*.yaml")) + sorted(ARCH_CASES_DIR.glob("*.yaml"))
    files += sorted(FITTED_CASES_DIR.glob("*.yaml"))
    rows = {route_for(load_case(f)).row.name for f in files}
    # the suite exercises every row but the ZeRO-3 full fine-tune without overlap_comm and the catch-all
    assert rows >= {row.name for row in TABLE} - {"zero3-full-gather-pool", "deepspeed"}


def test_the_columns_pick_the_row():
    rung3 = load_case(CASES_DIR / "001-ladder-rung3-zero3.yaml")  # LoRA, ZeRO-3, everything on the device
    assert route_for(_with(rung3, overlap_comm=False, offload_optimizer=Offload.cpu)).row.name == "zero3-lora-one-pool"
    assert route_for(_with(rung3, overlap_comm=False)).row.name == "zero3"
    assert route_for(_with(rung3, stage=2)).row.name == "zero2-stream"
    assert route_for(_with(rung3, stage=2, contiguous_gradients=False)).row.name == "deepspeed"
    assert route_for(_with(rung3, stage=1)).row.name == "deepspeed"
    gemma = load_case(CASES_DIR / "002-gemma27b-full-z3-offload-len2048.yaml")  # full, parameters on the host
    assert route_for(_with(gemma, offload_param=Offload.none)).row.name == "zero3-full-model-stream"
    assert route_for(_with(gemma, offload_param=Offload.none, overlap_comm=False)).row.name == "zero3-full-gather-pool"
    assert route_for(_with(gemma, overlap_comm=False)).row.name == "zero3"
    assert route_for(_with(gemma, env="")).reserved == "zero3_model_stream"  # the native allocator without expandable


def test_the_allocator_picks_the_rows_fallback():
    no_overlap = load_case(CASES_DIR / "000-lora-z3-offload-cutoff1024-ga16-nonreentrant-no-overlap.yaml")
    assert route_for(no_overlap).reserved == "zero3_one_pool"
    expandable = _with(no_overlap, env="expandable_segments:True")
    assert (route_for(expandable).allocated, route_for(expandable).reserved) == ("zero3_step_stream", "zero3_ratio")
    plain = load_case(PLAIN_LORA)
    assert route_for(_with(plain, env="expandable_segments:True")).reserved == "stream"
    assert route_for(_with(plain, env="backend:cudaMallocAsync")).reserved == "ratio"


def test_the_docs_hold_the_table():
    assert table_text() in (ROOT / "docs" / "predictor.md").read_text()


def _explained(capsys, *argv) -> dict:
    code = main(["check", *argv, "--explain", "--json"])
    out, _ = capsys.readouterr()
    assert code in (0, 1)
    return json.loads(out)


def test_explain_names_the_zero3_path_of_a_zero3_offload_config(capsys):
    out = _explained(capsys, str(EXAMPLES / "000-ds32b-optimized.yaml"), "--gpu-memory", "64GiB", "--gpus", "8")
    explain = out["explain"]
    assert explain["route"] == "zero3-lora-offload-one-pool"
    assert explain["kind"]["zero"] == "3" and explain["kind"]["params"] == "host"
    stages = {s["name"]: s for s in explain["stages"]}
    assert list(stages) == ["trace", "states", "allocated", "calibration", "reserved", "device", "host"]
    assert stages["allocated"]["method"] == "zero3_step_stream"
    assert stages["reserved"]["method"] == "zero3_one_pool"
    # the stage figures are the prediction's
    assert gib_rounded(stages["allocated"]["figures"]["allocated"]) == out["peak_allocated_gib"]
    assert gib_rounded(stages["reserved"]["figures"]["reserved"]) == out["peak_reserved_gib"]
    assert gib_rounded(stages["device"]["figures"]["device"]) == out["device_peak_gib"]
    device = stages["device"]["figures"]
    assert device["device"] == device["reserved"] + device["beside_allocator"]
    assert stages["allocated"]["figures"]["by_terms"] != stages["allocated"]["figures"]["allocated"]


def test_explain_names_the_allocator_simulation_for_a_plain_lora(capsys):
    code = main(["check", str(PLAIN_LORA), "--explain"])
    out, _ = capsys.readouterr()
    assert code == 0
    text = out[out.index("dispatch:"):]
    assert text.startswith("dispatch: row `no-deepspeed` (when ZeRO none)")
    assert "allocated by `terms`, reserved by `stream`" in text
    assert "  reserved: `stream` (the allocator model over the traced load and optimizer steps; " \
           "harness.predict.allocator.stream)" in text
    table = out[:out.index("dispatch:")]
    reserved_row = next(line for line in table.splitlines() if line.strip().startswith("peak reserved"))
    reserved_stage = text[text.index("  reserved: `stream`"):]
    reserved_figure = next(line for line in reserved_stage.splitlines() if line.strip().startswith("reserved "))
    assert reserved_row.split()[-2:] == reserved_figure.split()[-2:]  # the same GiB figure in both


def test_without_explain_the_output_has_no_dispatch(capsys):
    main(["check", str(PLAIN_LORA)])
    out, _ = capsys.readouterr()
    assert "dispatch:" not in out


def test_a_one_rank_zero2_offload_takes_the_streams_allocated_peak():
    """Guide 001's rung 2 on one card (variant u): DeepSpeed's flat gradient partition is the whole model,
    which the traced step does not hold; the ZeRO-2 stream's allocated peak is above the terms' and is
    the figure (measured on an H200: 25.21 GiB; the terms gave 25.01, the stream 25.22)."""
    from harness.predict.predictor import predict

    p = predict(load_case(CASES_DIR / "001-ladder-rung2-zero2-offload.yaml"), platform="nvidia-h200-x1",
                variant="u")
    allocated = next(s for s in p.stages if s.name == "allocated")
    assert allocated.method == "zero2_stream"
    assert allocated.figures["allocated"] == p.allocated > p.terms["allocated_by_terms"]
    assert any(n.startswith("allocated: the ZeRO-2 stream's peak") for n in p.notes)


def test_explain_describes_each_stage_by_its_own_methods(capsys):
    """`zero2_stream` sizes allocated and reserved, each its own way: each stage line says its own."""
    main(["check", str(CASES_DIR / "001-ladder-rung2-zero2-offload.yaml"), "--explain"])
    out, _ = capsys.readouterr()
    allocated = next(line for line in out.splitlines() if line.startswith("  allocated: `"))
    reserved = next(line for line in out.splitlines() if line.startswith("  reserved: `"))
    assert allocated == f"  allocated: `zero2_stream` ({ALLOCATED['zero2_stream'].what}; harness.predict.zero2.stream)"
    assert reserved == f"  reserved: `zero2_stream` ({RESERVED['zero2_stream'].what}; harness.predict.zero2.stream)"
