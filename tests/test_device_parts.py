"""The device figure from its parts: the probe's record (harness.measure.device_parts), the predictor
adding the parts a config uses (harness.predict.device), the fallback to the fitted overhead, and
the probe itself (harness.runtime.device_probe; on a GPU only in the `gpu` test)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from harness.measure.device_parts import PARTS, DeviceRecord, DeviceRecordError, Part, platform_key, record_for
from harness.predict import device as device_module
from harness.predict.calibration import calibrate
from harness.predict.constants import PRIORS
from harness.predict.predictor import predict
from harness.runtime.device_probe import _worst, world_sizes
from harness.spec.cases import CASES_DIR, load_case
from harness.spec.suite import ROOT

MiB = 2**20
H100 = "nvidia-h100-80gb-hbm3-x1"


def record(platform=H100, count=1, nccl=None, deepspeed=None, after_collective=None, **parts) -> DeviceRecord:
    base = {"cuda_context": 500, "cublas": 70, "attention": 20, "triton": 30, "bitsandbytes": 12}
    base.update(parts)
    return DeviceRecord(
        platform=platform, card="NVIDIA H100 80GB HBM3", device_count=count, vendor="nvidia", driver="580.159.04",
        torch="2.11.0+cu130", cuda="13.0", hip=None, date="2026-11-26", memory_source="NVML (per process)",
        parts={k: Part(bytes=None if v is None else v * MiB, how=PARTS[k], error=None if v is not None else "absent")
               for k, v in base.items()},
        nccl={w: Part(bytes=b * MiB, how="nccl") for w, b in (nccl or {1: 200, 2: 400}).items()},
        deepspeed={w: Part(bytes=b * MiB, how="deepspeed")
                   for w, b in ({1: 150, 2: 450} if deepspeed is None else deepspeed).items()},
        deepspeed_after_collective={w: Part(bytes=b * MiB, how="after a collective")
                                    for w, b in ({1: 250, 2: 600} if after_collective is None
                                                 else after_collective).items()})


@pytest.fixture
def device_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(device_module, "DEVICE_DIR", tmp_path)
    return tmp_path


def test_platform_key_is_the_baselines_folder_name():
    assert platform_key("NVIDIA H100 80GB HBM3", 1) == H100
    assert platform_key("NVIDIA H200", 2) == "nvidia-h200-x2"
    assert (ROOT / "results" / "baselines" / H100).is_dir()


def test_record_round_trips_and_bad_fields_are_named(tmp_path):
    path = tmp_path / f"{H100}.json"
    path.write_text(record().to_json())
    assert DeviceRecord.read(path) == record()
    data = json.loads(path.read_text())
    data["parts"]["cublas"]["bytes"] = -5
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceRecordError, match=r"nvidia-h100-80gb-hbm3-x1.json: parts.cublas.bytes: -5 is not a"):
        DeviceRecord.read(path)
    data["parts"]["cublas"] = {"bytes": None, "how": "x"}
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceRecordError, match=r"parts.cublas.error: a part without bytes says why"):
        DeviceRecord.read(path)
    data["parts"] = {"warp_drive": {"bytes": 1}}
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceRecordError, match=r"parts.warp_drive: not a part this harness knows"):
        DeviceRecord.read(path)
    data["parts"], data["nccl"] = {}, {"two": {"bytes": 1}}
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceRecordError, match=r"nccl.two: the key is a world size"):
        DeviceRecord.read(path)
    data["nccl"], data["deepspeed"] = {}, {"0": {"bytes": 1}}
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceRecordError, match=r"deepspeed.0: the key is a world size"):
        DeviceRecord.read(path)
    data["deepspeed"], data["schema"] = {}, 1  # DeepSpeed measured once, beyond NCCL: measured again
    path.write_text(json.dumps(data))
    with pytest.raises(DeviceRecordError, match=r"schema: 1, this harness reads 2. Measure it again"):
        DeviceRecord.read(path)


def test_nccl_at_a_world_size_never_measured():
    r = record(nccl={1: 100, 2: 300, 4: 500})
    assert r.nccl_for(2) == (300 * MiB, "measured at 2 ranks")
    assert r.nccl_for(8) == (900 * MiB, "linear in the world size through 2 and 4 ranks")  # the two nearest
    assert r.nccl_for(3)[0] == 400 * MiB
    single = record(nccl={2: 300})
    assert single.nccl_for(8) == (300 * MiB, "measured at 2 ranks, used for 8")
    assert record(nccl={1: 100}).nccl_for(8) == (None, "not measured")


def test_record_of_the_same_card_with_another_count(tmp_path):
    (tmp_path / "nvidia-h200-x2.json").write_text(
        record("nvidia-h200-x2", 2, nccl={1: 100, 2: 300}, cuda_context=600).to_json())
    (tmp_path / "nvidia-h200-x8.json").write_text(
        record("nvidia-h200-x8", 8, nccl={8: 900}, cuda_context=650).to_json())
    own, where = record_for("nvidia-h200-x2", tmp_path)
    assert where.endswith("nvidia-h200-x2.json") and own.part("cuda_context") == 600 * MiB
    assert sorted(own.nccl) == [1, 2, 8]  # the other count's NCCL sizes merged in
    other, where = record_for("nvidia-h200-x4", tmp_path)  # the nearest count: two cards, not eight
    assert where.endswith("nvidia-h200-x2.json") and other.part("cuda_context") == 600 * MiB
    assert other.nccl_for(4)[0] == round((300 + (900 - 300) * (4 - 2) / 6) * MiB)
    assert record_for("nvidia-h200-x16", tmp_path)[0].part("cuda_context") == 650 * MiB
    assert record_for("nvidia-h200-x5", tmp_path)[1].endswith("nvidia-h200-x8.json")  # as near: the larger
    assert record_for("nvidia-h100-80gb-hbm3-x1", tmp_path)[0] is None
    assert record_for(None, tmp_path) == (None, "no platform named")


def test_predictor_adds_the_probes_parts_the_config_uses(device_dir):
    (device_dir / f"{H100}.json").write_text(record().to_json())
    qlora = load_case(CASES_DIR / "003-qlora-fix-r16-seq512-gc.yaml")
    p = predict(qlora, platform=H100)
    assert p.device - p.reserved == (500 + 70 + 20 + 12) * MiB  # context, cuBLAS, attention, bitsandbytes
    assert {k: v // MiB for k, v in p.terms.items() if k.startswith("device_")} == {
        "device_cuda_context": 500, "device_cublas": 70, "device_attention": 20, "device_bitsandbytes": 12}
    assert any("the parts the device probe measured on NVIDIA H100 80GB HBM3" in n and "2026-11-26" in n
               for n in p.notes)
    gla = predict(load_case(CASES_DIR / "004-gla-plan-c-1proc.yaml"), platform=H100)
    assert gla.device - gla.reserved == (500 + 70 + 30) * MiB  # Triton, not the attention kernels


def test_deepspeed_jobs_add_the_deepspeed_job_at_their_world_size_not_nccl_on_top(device_dir):
    (device_dir / f"{H100}.json").write_text(record(nccl={1: 200, 2: 400}, deepspeed={1: 150, 2: 450},
                                                    after_collective={1: 250, 2: 600}).to_json())
    case = load_case(CASES_DIR / "001-ladder-rung1-zero2.yaml")  # one rank, ZeRO-2, built from its config
    built = case.model_copy(update={"launch": case.launch.model_copy(update={"model_source": "config"})})
    p = predict(built, platform=H100)
    assert p.device - p.reserved == (500 + 70 + 20 + 150) * MiB  # the job makes its communicators: no NCCL term
    assert "device_nccl" not in p.terms and "DeepSpeed at 1 ranks: measured at 1 ranks" in p.notes
    # loading a checkpoint, the job's ranks have met at a barrier before the engine: two communicators
    loaded = predict(case, platform=H100)
    assert loaded.device - loaded.reserved == (500 + 70 + 20 + 250) * MiB
    assert "DeepSpeed at 1 ranks after a collective on the default process group: measured at 1 ranks" in loaded.notes
    eight = predict(load_case(CASES_DIR / "000-qlora4bit-z2-cutoff512.yaml"), platform=H100)  # 8 ranks, QLoRA
    assert eight.terms["device_deepspeed_after_collective"] == 600 * MiB  # the largest world measured
    assert "DeepSpeed at 8 ranks after a collective on the default process group: measured at 2 ranks, used for 8" \
        in eight.notes


def test_fitted_overhead_where_no_record_or_a_part_is_missing(device_dir):
    loaded = load_case(CASES_DIR / "001-ladder-rung1-zero2.yaml")  # a checkpoint: two communicators
    case = loaded.model_copy(update={"launch": loaded.launch.model_copy(update={"model_source": "config"})})
    cal = calibrate(H100, frozenset())
    base = int(cal.values.get("device_overhead", PRIORS["device_overhead"]))
    fitted = base + int(cal.values.get("device_overhead_deepspeed", PRIORS["device_overhead_deepspeed"]))
    p = predict(case, platform=H100)
    assert p.device - p.reserved == fitted
    said = "device = reserved + the overhead fitted on the baselines (no probe record"
    assert any(n.startswith(said) for n in p.notes)
    # fitted on the DeepSpeed baselines that loaded a checkpoint (guide 000's QLoRA runs)
    after = cal.values["device_overhead_deepspeed_after_collective"]
    assert after > cal.values["device_overhead_deepspeed"]
    p = predict(loaded, platform=H100)
    assert p.device - p.reserved == base + int(after)
    (device_dir / f"{H100}.json").write_text(record(after_collective={}).to_json())  # a record made before it
    p = predict(loaded, platform=H100)
    assert p.device - p.reserved == base + int(after)
    assert any("has no figure for deepspeed_after_collective: the fitted overhead is used" in n for n in p.notes)
    (device_dir / f"{H100}.json").write_text("{not json")
    p = predict(case, platform=H100)
    assert p.device - p.reserved == fitted and any("device probe record unreadable" in n for n in p.notes)


def test_a_platform_without_such_baselines_takes_the_second_communicator_another_probe_measured(device_dir):
    """No baseline of a DeepSpeed job that met at a barrier before its engine (guide 000's QLoRA runs left
    out) and no probe record of the card: the fitted overhead of the other DeepSpeed jobs, plus the second
    communicator as the probe measured it on another card (its NCCL buffers, not the card's)."""
    h200 = "nvidia-h200-x2"
    (device_dir / f"{h200}.json").write_text(record(platform=h200, count=2, deepspeed={1: 150, 2: 450},
                                                    after_collective={1: 250, 2: 600}).to_json())
    case = load_case(CASES_DIR / "001-ladder-rung1-zero2.yaml")  # one rank, loads a checkpoint
    left_out = frozenset({"000-qlora4bit-z2-cutoff256-ga64", "000-qlora4bit-z2-cutoff512"})
    assert "device_overhead_deepspeed_after_collective" not in calibrate(H100, left_out).values
    p = predict(case, platform=H100, exclude=left_out)
    assert p.terms["second_nccl_communicator"] == 100 * MiB
    assert any("the second NCCL communicator the device probe measured on NVIDIA H100 80GB HBM3" in n
               for n in p.notes)


def test_probe_world_sizes_and_worst_rank():
    assert world_sizes(1, None) == [1]
    assert world_sizes(8, None) == [1, 2, 8]
    assert world_sizes(8, 4) == [1, 2, 4]
    ranks = [{"parts": {"nccl": {"bytes": 10, "how": "h"}}}, {"parts": {"nccl": {"bytes": 30, "how": "h"}}}]
    assert _worst(ranks, "nccl", "h").bytes == 30
    ranks[1]["parts"]["nccl"] = {"bytes": None, "how": "h", "error": "NCCL error"}
    assert _worst(ranks, "nccl", "h") == Part(bytes=None, how="h", error="NCCL error")


def test_probe_without_a_gpu_says_so_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.runtime.device_probe", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA or HIP device is visible" in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_probe_on_a_gpu_writes_a_record(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or HIP device")
    cmd = [sys.executable, "-m", "harness.runtime.device_probe", "--out", str(tmp_path), "--ranks", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = tmp_path.glob("*.json")
    r = DeviceRecord.read(path)
    assert path.stem == platform_key(torch.cuda.get_device_name(0), torch.cuda.device_count()) == r.platform
    assert r.part("cuda_context") > 100 * MiB and r.part("cublas") is not None
    assert r.nccl[1].bytes is not None and r.seconds < 120
    if importlib.util.find_spec("deepspeed") is not None:
        assert r.deepspeed and all(p.bytes is not None for p in r.deepspeed.values())
