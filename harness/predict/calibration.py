"""Calibrated constants of the predictor, fitted at run time from the GPU baselines in results/.

Only what no closed form or trace can give is fitted, and only from measured figures (so fitting
needs no prediction and costs milliseconds):

* ``reserved_over_allocated``: the caching allocator's reserved / allocated ratio at the step
  peak (fragmentation, rounding to 2 MiB / 20 MiB segments, blocks cached from the load). Median
  of reserved_peak / allocated_peak over baselines whose run finished (an OOM stops at the cap).
  ZeRO-3 runs are left out of it (next constant).
* ``zero3_cached_gathers``: ZeRO-3 only: reserved beyond allocated x that ratio, in units of the
  largest parameter gathered whole (`largest_gather_bytes`: the embedding / head). The all-gather
  buffers of the largest parameters are freed and reallocated every micro-step; the caching
  allocator keeps their blocks (about two of them on guide 000's 32B). Median over finished
  ZeRO-3 runs; on two cards fitted on two models (guide 000's 32B, guide 002's Gemma-3 27B). What the
  predictor adds from DeepSpeed's code is taken out first: under ZeRO-3 with optimizer offload, the
  reduce stream's pool of a full fine-tune (harness.predict.zero3.step.reduce_stream_reserve over its
  largest parameter, `reduce_pool_bytes`: 3.95 GiB of guide 002's 20.4 GiB, which leaves it 1.6-1.9
  units beside guide 000's 1.7-2.6; a LoRA run's is a few MiB and is left in). The optimizer step's
  fp32 gradient segment without offload is not subtracted: none of the bundled guides' ZeRO-3 runs
  adds it (their sub-groups are LoRA adapters, or the optimizer is offloaded). A full fine-tune with its
  parameters on the device does not use it: its gather stream's pool is replayed
  (harness.predict.zero3.coordinator.gather_pool).
* ``device_overhead``: device (NVML, per process) minus reserved: the CUDA context, cuBLAS/cuDNN
  handles and module images outside the allocator. Median over baselines without DeepSpeed,
  OOM outcomes included (the overhead does not depend on where the run stopped), runs on a cold
  Triton cache left out (compiling kernels holds GiBs more for a while; harness.runtime.compile_cache).
* ``device_overhead_deepspeed``: what a DeepSpeed process adds on top (NCCL communicator and
  buffers, DeepSpeed's extensions). Median of (device - reserved - device_overhead) over
  DeepSpeed baselines whose engine made the job's first communicator (built from the config).
* ``device_overhead_deepspeed_after_collective``: the same over DeepSpeed baselines whose process group
  ran a collective before the engine (loaded from a checkpoint: two communicators,
  `harness.predict.device.collective_before_engine`); where none was measured, the one above stands in.
* ``triton_cold_overhead``: what compiling and autotuning Triton kernels adds outside the allocator
  in a process that starts on an empty cache (harness.runtime.compile_cache). Median of (device - reserved
  - device_overhead) over runs recorded as cold. Only added for a case that asks for a cold cache
  (`launch.triton_cache: cold`); where no cold run was measured it is left out, and the notes say so.

Per platform (the baseline folder, e.g. ``nvidia-h100-80gb-hbm3-x1``): a constant uses that
platform's baselines; where it has none, every platform's, and the notes say so. ``exclude``
removes case ids (leave-one-out). A baseline measured on a variant (fewer ranks / layers) counts
as its case id. Fitted on medians, so one outlier does not move the others. The mistakes the harness
must detect (expect: detected) are left out: their figures are the mistake's.

What fitting reads of the baselines and their cases is cached on disk beside the traces
(`HARNESS_PREDICT_CACHE`), keyed by the content of the baselines, the case files, the architecture
registry and this module, so a warm `check` reads no case file.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import harness.baselines.store as store
import harness.predict.device as device
import harness.spec.schema as schema
import harness.spec.shape as shape
from harness.baselines.store import read_baselines
from harness.models.registry import ARCH_DIR
from harness.models.source import load_model
from harness.predict.allocator.allocator import AllocatorConf, AllocConfError
from harness.predict.constants import PRIORS
from harness.predict.device import collective_before_engine
from harness.predict.zero3.step import reduce_stream_reserve
from harness.spec.cases import load_case
from harness.spec.files import write_atomic
from harness.spec.suite import BASELINES_DIR as RESULTS_DIR
from harness.spec.suite import CASES_DIR

FITTED = ("reserved_over_allocated", "zero3_cached_gathers", "device_overhead", "device_overhead_deepspeed")
# no prior: left out where nothing was measured
OPTIONAL = ("triton_cold_overhead", "device_overhead_deepspeed_after_collective")


@dataclass
class Calibration:
    platform: str
    values: dict[str, float]
    used: dict[str, list[str]]  # constant -> case ids it was fitted on
    notes: list[str] = field(default_factory=list)

    @property
    def calibrated_on(self) -> list[str]:
        return sorted({c for ids in self.used.values() for c in ids})


@dataclass(frozen=True)
class _Obs:
    case_id: str
    platform: str
    ok: bool
    allocated: int | None
    reserved: int | None
    device: int | None  # per process
    deepspeed: bool
    zero3: bool = False
    gather_bytes: int = 0  # ZeRO-3: bytes of the largest parameter gathered whole (largest_gather_bytes)
    reduce_pool: int = 0  # ZeRO-3 full fine-tune with optimizer offload: the reduce stream's pool (reduce_pool_bytes)
    cold_triton: bool = False  # measured while compiling Triton kernels (harness.runtime.compile_cache)
    # DeepSpeed: the process group ran a collective before the engine (harness.predict.device.collective_before_engine)
    collective_first: bool = False


@lru_cache(maxsize=4)
def _observations(root: str, case_dir: str) -> tuple[_Obs, ...]:
    """The baselines' figures with what fitting needs of their cases, from the on-disk cache where
    the baselines, the case files, the architecture registry and this code are unchanged (reading 60
    baselines and their cases costs most of a warm `check`), else read and cached."""
    key = _inputs_key(Path(root), Path(case_dir))
    cached = _load_cached(key)
    if cached is None:
        cached = _read_observations(root, case_dir)
        _store_cached(key, cached)
    observations, warnings = cached
    for line in warnings:
        print(f"oom-harness: warning: {line}", file=sys.stderr)
    return observations


def _read_observations(root: str, case_dir: str) -> tuple[tuple[_Obs, ...], list[str]]:

    baselines, warnings = read_baselines(Path(root))
    cases = {}
    out = []
    for b in baselines:
        if b.case_id not in cases:
            try:
                cases[b.case_id] = load_case(Path(case_dir) / f"{b.case_id}.yaml")
            except Exception:  # a baseline of a case that no longer exists
                cases[b.case_id] = None
        case = cases[b.case_id]
        if case is None:
            continue
        if case.expect.outcome == "detected":
            # a mistake's figures are the mistake's (guide 002's model materialised before DeepSpeed
            # leaves its blocks cached: reserved 2.9 times allocated): not the allocator's habits
            continue
        procs = case.launch.procs_per_card
        zero3 = case.deepspeed is not None and case.deepspeed.stage == 3
        gather = largest_gather_bytes(case) if zero3 else 0
        measured = b.case_as_measured(case)
        pool = reduce_pool_bytes(measured) if zero3 else 0
        collective = case.deepspeed is not None and collective_before_engine(measured)
        for r in b.runs:
            device = None if r.per_card_peak is None else r.per_card_peak // procs
            out.append(_Obs(case_id=b.case_id, platform=b.platform.key, ok=r.outcome == "ok",
                            allocated=r.allocated_peak, reserved=r.reserved_peak, device=device,
                            deepspeed=case.deepspeed is not None, zero3=zero3, gather_bytes=gather, reduce_pool=pool,
                            cold_triton=r.triton_cache == "cold", collective_first=collective))
    return tuple(out), warnings


def _inputs_key(root: Path, case_dir: Path) -> str:

    h = hashlib.sha256(Path(__file__).read_bytes())
    # the code that decides what an observation is (a baseline's case as measured, its DeepSpeed collective)
    for module in (store, device, shape, schema):
        h.update(Path(module.__file__).read_bytes())
    files = sorted(root.glob("*/*.json")) + sorted(case_dir.glob("*.yaml"))
    files += sorted((p for p in ARCH_DIR.iterdir() if p.name.endswith(".json")), key=lambda p: p.name)
    for p in files:
        try:
            h.update(str(p).encode() + b"\0" + p.read_bytes() + b"\0")
        except OSError:
            h.update(str(p).encode() + b"\0unreadable\0")
    return h.hexdigest()[:32]


def _cache_file(key: str) -> Path | None:
    from harness.predict.trace.trace import _cache_dir  # the predictor's cache folder (HARNESS_PREDICT_CACHE)

    folder = _cache_dir()
    return None if folder is None else folder / f"calibration-{key}.json"


def _load_cached(key: str) -> tuple[tuple[_Obs, ...], list[str]] | None:
    path = _cache_file(key)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        return tuple(_Obs(**o) for o in data["observations"]), list(data["warnings"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _store_cached(key: str, cached: tuple[tuple[_Obs, ...], list[str]]) -> None:
    path = _cache_file(key)
    if path is None:
        return
    observations, warnings = cached
    try:
        write_atomic(path, json.dumps({"observations": [asdict(o) for o in observations], "warnings": warnings}))
    except OSError:  # a read-only home: read every call instead
        pass


def largest_gather_bytes(case) -> int:
    """Bytes of the largest single parameter a ZeRO-3 rank gathers whole: the embedding / output
    head (vocab x hidden) or an MLP matrix (intermediate x hidden), in the half dtype. From the
    architecture's config (a closed form, not a trace), so fitting stays cheap."""

    cfg = load_model(case.model).config
    hidden = int(cfg.get("hidden_size", 0))
    inter = int(cfg.get("intermediate_size") or 0)
    half = 4 if case.precision.value == "fp32" else 2
    return max(int(cfg.get("vocab_size", 0)), inter) * hidden * half


def reduce_pool_bytes(case) -> int:
    """ZeRO-3 full fine-tune with optimizer offload: what DeepSpeed's reduce stream reserves, replayed
    over the largest parameter (`largest_gather_bytes`' elements, partitioned over the ranks), which
    sets it where that parameter's copy, norm and cast need the most; 0 for other cases. A closed form
    of the config, so fitting stays cheap."""

    if case.method.kind != "full":
        return 0
    half = 4 if case.precision.value == "fp32" else 2
    largest = largest_gather_bytes(case) // half
    try:
        conf = AllocatorConf.parse(case.launch.env.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    except AllocConfError:
        conf = AllocatorConf()
    return reduce_stream_reserve(case, [-(-largest // case.launch.ranks)], conf) or 0


def platforms(root: Path = RESULTS_DIR, case_dir: Path = CASES_DIR) -> list[str]:
    return sorted({o.platform for o in _observations(str(root), str(case_dir))})


def _fit(obs: list[_Obs], select, value) -> tuple[float | None, list[str]]:
    pts = [(o.case_id, value(o)) for o in obs if select(o)]
    pts = [(c, v) for c, v in pts if v is not None]
    if not pts:
        return None, []
    return statistics.median(v for _, v in pts), sorted({c for c, _ in pts})


def calibrate(platform: str | None = None, exclude=frozenset(), root: Path = RESULTS_DIR,
              case_dir: Path = CASES_DIR) -> Calibration:
    """The constants fitted on the baselines in `root` of the cases in `case_dir` (default: the
    bundled suite's, which the predictor's accuracy is measured on)."""
    every = [o for o in _observations(str(root), str(case_dir)) if o.case_id not in exclude]
    label = platform or "pooled"
    notes = []
    if platform is None:
        notes.append("no platform named: constants pooled over every platform in results/baselines")
    values: dict[str, float] = {}
    used: dict[str, list[str]] = {}

    def fit(name, select, value):
        own = [o for o in every if platform is None or o.platform == platform]
        v, ids = _fit(own, select, value)
        if v is None and platform is not None:
            v, ids = _fit(every, select, value)
            if v is not None:
                notes.append(f"{name}: no baseline on {platform}; pooled over every platform")
        if v is None:
            return None
        values[name] = v
        used[name] = ids
        return v

    ratio = fit("reserved_over_allocated", lambda o: o.ok and o.allocated and o.reserved and not o.zero3,
                lambda o: o.reserved / o.allocated)
    if ratio is None:
        ratio = PRIORS["reserved_over_allocated"]
    fit("zero3_cached_gathers", lambda o: o.ok and o.zero3 and o.allocated and o.reserved and o.gather_bytes,
        lambda o: max(0.0, o.reserved - o.allocated * ratio - o.reduce_pool) / o.gather_bytes)
    base = fit("device_overhead", lambda o: not o.deepspeed and not o.cold_triton and o.device and o.reserved,
               lambda o: o.device - o.reserved)
    if base is not None:
        fit("device_overhead_deepspeed", lambda o: o.deepspeed and not o.collective_first and o.device and o.reserved,
            lambda o: max(0, o.device - o.reserved - base))
        fit("device_overhead_deepspeed_after_collective",
            lambda o: o.deepspeed and o.collective_first and o.device and o.reserved,
            lambda o: max(0, o.device - o.reserved - base))
        fit("triton_cold_overhead", lambda o: not o.deepspeed and o.cold_triton and o.device and o.reserved,
            lambda o: max(0, o.device - o.reserved - base))
    for name in FITTED:
        if name not in values:
            notes.append(f"{name}: no baseline to fit it on; prior used")
    return Calibration(platform=label, values=values, used=used, notes=notes)
