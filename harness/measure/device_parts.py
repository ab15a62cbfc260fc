"""What a GPU process holds outside PyTorch's caching allocator, part by part: the device probe's record.

The device's own figure for a training process (NVML, amdsmi) is the allocator's reserved memory
plus what the runtime and the libraries hold beside it. `python -m harness.runtime.device_probe`
measures those parts on one platform and writes them, with the card, the driver, the torch and
CUDA/HIP versions and the date, to `results/device/<platform>.json` (`DeviceRecord`); the predictor
adds the parts a config uses (`harness.predict.predictor`) and falls back to the fitted overhead
(`harness.predict.calibration`) where no record of the platform exists. Standard library only, so the
probe runs on a GPU host that has nothing but torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The parts, each measured as the growth of (device figure - reserved) over one step of the probe,
# in this order in one fresh process (a library's kernels load lazily, so each step counts its own).
PARTS: dict[str, str] = {
    "cuda_context": "the CUDA/HIP context of a process that has put one tensor on the device",
    "cublas": "cuBLAS handles, workspaces and kernel images after bf16 and fp32 matmuls, forward and backward",
    "attention": "scaled-dot-product attention kernels (flash, memory-efficient, cuDNN), bf16 forward and backward",
    "triton": "the Triton runtime and a compiled kernel's image, after one launch",
    "bitsandbytes": "bitsandbytes' 4-bit (nf4) Linear4bit forward and backward",
}
NCCL = "per rank: the NCCL communicator, its buffers and channels after all-reduce, all-gather and reduce-scatter"
# A DeepSpeed job is measured whole, in processes of its own: whether and how NCCL's communicators are
# made is DeepSpeed's to decide (one rank of ZeRO-2 holds less than NCCL's own probe at one rank).
DEEPSPEED = ("per rank: a DeepSpeed job from deepspeed.initialize (NCCL's communicators included) through one "
             "ZeRO-2 step of a small model, in fresh processes whose context and cuBLAS were loaded first")
# The same job where the process group has already run a collective before deepspeed.initialize: the default
# group's communicator is then made first, and the engine's data-parallel group makes one more (a job that loads
# a checkpoint: the harness's ranks wait at a barrier while rank 0 writes the random-weight checkpoint, and a
# Trainer's while its main process prepares the data, `main_process_first`).
DEEPSPEED_AFTER_COLLECTIVE = ("per rank: the DeepSpeed job above, with a barrier on the default process group before "
                              "deepspeed.initialize (two NCCL communicators: the default group's and the engine's)")
RECORD_SCHEMA = 2  # 2: DeepSpeed by world size, NCCL's communicators included (1: one figure beyond NCCL)


class DeviceRecordError(ValueError):
    """A device record that cannot be read: names the file, the field and the fix."""

    def __init__(self, path: Path | str, key: str, problem: str):
        super().__init__(f"{path}: {key}: {problem}. Measure it again with `python -m harness.runtime.device_probe` "
                         "on that platform, or delete the file to use the fitted overhead")


def platform_key(device_name: str, device_count: int) -> str:
    """The platform's name, as results/ spells it: the card's name in lower-case words and its count
    ('NVIDIA H100 80GB HBM3', 1 -> 'nvidia-h100-80gb-hbm3-x1')."""
    name = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return f"{name}-x{device_count}"


_COUNT_SUFFIX = re.compile(r"-x(\d+)$")  # what `platform_key` appends: the card count


def card_of(platform: str) -> str:
    """The card part of a platform key ('nvidia-h200-x2' -> 'nvidia-h200')."""
    return _COUNT_SUFFIX.sub("", platform)


def _count_of(platform: str) -> int:
    """The card count of a platform key ('nvidia-h200-x2' -> 2; 1 where it names none)."""
    m = _COUNT_SUFFIX.search(platform)
    return int(m.group(1)) if m else 1


@dataclass(frozen=True)
class Part:
    """One part: the bytes it holds outside the allocator (None: not measured, `error` says why)."""

    bytes: int | None
    how: str
    # what the same step added to the allocator's reserved memory, the blocks of the probe's own tensors
    # cached there included: shown for reference, never added (reserved is predicted on its own)
    in_allocator: int = 0
    error: str | None = None


@dataclass(frozen=True)
class DeviceRecord:
    platform: str
    card: str
    device_count: int
    vendor: str  # nvidia, amd (Hygon DCUs run HIP too)
    driver: str | None
    torch: str
    cuda: str | None
    hip: str | None
    date: str  # ISO day of the measurement
    memory_source: str  # how the device figure was read (NVML per process, nvidia-smi, the card's used memory)
    parts: dict[str, Part]
    nccl: dict[int, Part] = field(default_factory=dict)  # by world size, per rank
    deepspeed: dict[int, Part] = field(default_factory=dict)  # by world size, per rank (DEEPSPEED)
    # by world size, per rank (DEEPSPEED_AFTER_COLLECTIVE); empty in records made before it was measured
    deepspeed_after_collective: dict[int, Part] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)  # the libraries whose parts were measured
    seconds: float = 0.0
    schema: int = RECORD_SCHEMA

    def to_json(self) -> str:
        data = asdict(self)
        for name in WORLD_TABLES:
            data[name] = {str(k): v for k, v in data[name].items()}
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: Path | str) -> DeviceRecord:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DeviceRecordError(path, "(file)", f"not readable as JSON ({exc})") from None
        if not isinstance(data, dict):
            raise DeviceRecordError(path, "(top level)", "not a JSON object")
        if data.get("schema") != RECORD_SCHEMA:
            raise DeviceRecordError(path, "schema", f"{data.get('schema')!r}, this harness reads {RECORD_SCHEMA}")
        for key in ("platform", "card", "torch", "date", "memory_source"):
            if not isinstance(data.get(key), str):
                raise DeviceRecordError(path, key, "missing, or not text")
        if not isinstance(data.get("device_count"), int) or data["device_count"] < 1:
            raise DeviceRecordError(path, "device_count", "missing, or not a count of at least 1")
        parts = {k: _part(path, f"parts.{k}", v) for k, v in _mapping(path, "parts", data.get("parts")).items()}
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise DeviceRecordError(path, f"parts.{unknown[0]}", f"not a part this harness knows ({', '.join(PARTS)})")
        by_world = {}
        for name in WORLD_TABLES:
            by_world[name] = {}
            for k, v in _mapping(path, name, data.get(name, {})).items():
                if not str(k).isdigit() or int(k) < 1:
                    raise DeviceRecordError(path, f"{name}.{k}",
                                            "the key is a world size, a whole number of at least 1")
                by_world[name][int(k)] = _part(path, f"{name}.{k}", v)
        return cls(platform=data["platform"], card=data["card"], device_count=data["device_count"],
                   vendor=str(data.get("vendor", "nvidia")), driver=data.get("driver"), torch=data["torch"],
                   cuda=data.get("cuda"), hip=data.get("hip"), date=data["date"], memory_source=data["memory_source"],
                   parts=parts, **by_world,
                   versions=dict(data.get("versions") or {}), seconds=float(data.get("seconds") or 0.0))

    def part(self, name: str) -> int | None:
        p = self.parts.get(name)
        return None if p is None else p.bytes

    def nccl_for(self, ranks: int) -> tuple[int | None, str]:
        """NCCL's bytes per rank at `ranks` ranks, and how (`at_world_size`)."""
        return at_world_size(self.nccl, ranks)

    def deepspeed_for(self, ranks: int, after_collective: bool = False) -> tuple[int | None, str]:
        """A DeepSpeed job's bytes per rank at `ranks` ranks, NCCL's included, and how (`at_world_size`);
        `after_collective`: the job whose process group ran a collective before the engine was made."""
        return at_world_size(self.deepspeed_after_collective if after_collective else self.deepspeed, ranks)


WORLD_TABLES = ("nccl", "deepspeed", "deepspeed_after_collective")  # the record's parts measured by world size


def at_world_size(table: dict[int, Part], ranks: int) -> tuple[int | None, str]:
    """A part measured by world size, at `ranks` ranks, and how: measured at that world size, else linear in
    the world size through the two nearest measured sizes of several ranks, else the one measured."""
    measured = {w: p.bytes for w, p in table.items() if p.bytes is not None}
    if ranks in measured:
        return measured[ranks], f"measured at {ranks} ranks"
    several = sorted(w for w in measured if w > 1) if ranks > 1 else sorted(measured)
    if not several:
        return None, "not measured"
    if len(several) == 1:
        w = several[0]
        return measured[w], f"measured at {w} ranks, used for {ranks}"
    a, b = sorted(several, key=lambda w: (abs(w - ranks), w))[:2]
    a, b = min(a, b), max(a, b)
    value = measured[a] + (measured[b] - measured[a]) * (ranks - a) / (b - a)
    return max(0, round(value)), f"linear in the world size through {a} and {b} ranks"


def _mapping(path, key, value) -> dict:
    if not isinstance(value, dict):
        raise DeviceRecordError(path, key, "missing, or not a mapping")
    return value


def _part(path, key, value) -> Part:
    if not isinstance(value, dict):
        raise DeviceRecordError(path, key, "not a mapping of bytes, how, in_allocator, error")
    b = value.get("bytes")
    if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
        raise DeviceRecordError(path, f"{key}.bytes", f"{b!r} is not a byte count (a whole number >= 0, or null)")
    if b is None and not value.get("error"):
        raise DeviceRecordError(path, f"{key}.error", "a part without bytes says why it was not measured")
    return Part(bytes=b, how=str(value.get("how", "")), in_allocator=int(value.get("in_allocator") or 0),
                error=value.get("error"))


def record_for(platform: str | None, folder: Path) -> tuple[DeviceRecord | None, str]:
    """The probe record of a platform, and where it came from: `<folder>/<platform>.json`, else the record
    of the same card whose count is nearest the platform's (the larger of two as near), the host most like
    it; its NCCL and DeepSpeed sizes merged from every record of that card."""
    if platform is None:
        return None, "no platform named"
    folder = Path(folder)
    own = folder / f"{platform}.json"
    same_card = sorted(p for p in folder.glob(f"{card_of(platform)}-x*.json") if card_of(p.stem) == card_of(platform))
    if not own.is_file() and not same_card:
        return None, f"no probe record {own}"
    records = {p: DeviceRecord.read(p) for p in same_card}
    count = _count_of(platform)
    main = records.get(own) or min(records.values(), key=lambda r: (abs(r.device_count - count), -r.device_count))
    tables: dict[str, dict[int, Part]] = {name: {} for name in WORLD_TABLES}
    for r in sorted(records.values(), key=lambda r: r.platform != main.platform):  # the platform's own first
        for name, table in tables.items():
            for w, p in getattr(r, name).items():
                table.setdefault(w, p)
    where = own if own in records else folder / f"{main.platform}.json"
    merged = DeviceRecord(**{**{f: getattr(main, f) for f in main.__dataclass_fields__}, **tables})
    return merged, str(where)
