"""The device probe: measures what a GPU process holds outside PyTorch's allocator, part by part.

    python -m harness.runtime.device_probe [--out results/device] [--ranks 2] [--timeout 90]

Runs on a GPU host with nothing but torch (the libraries it finds are measured too: Triton,
bitsandbytes, DeepSpeed) and writes `<out>/<platform>.json` (`harness.measure.device_parts.DeviceRecord`):
the card, the driver, the torch and CUDA/HIP versions, the date and every part with how it was
measured. The predictor reads it (`harness.predict.predictor`). Run it on an idle host: each
part is a difference of the device's figure for the process, and another process on the card
moves the card-wide fallback.

How: one fresh process measures the single-process parts in order (`PARTS`: the context, then
cuBLAS, attention, Triton, bitsandbytes; each is the growth of device figure minus reserved over
its step, so a library's lazily loaded kernels count to it). Then, for each world size (1, 2 and
every visible GPU, at most `--ranks`), fresh processes, one per GPU, measure NCCL (init, all-reduce,
all-gather, reduce-scatter), and other fresh ones a DeepSpeed job (deepspeed.initialize, which makes
the process group, and one ZeRO-2 step of a small model; NCCL's communicators are the job's to make,
and one rank of it holds less than NCCL's own probe at one rank), and the same job once more after a
barrier on the default process group (whose communicator is then made first, the engine's own
data-parallel group making a second one, as in a job that loads a checkpoint). A part that
fails or is missing its library is recorded with the reason, never a failed probe; a step past
`--timeout` ends its processes. On CPU only, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.measure.device_parts import (
    DEEPSPEED,
    DEEPSPEED_AFTER_COLLECTIVE,
    NCCL,
    PARTS,
    WORLD_TABLES,
    DeviceRecord,
    Part,
    platform_key,
)

DEFAULT_OUT = Path("results") / "device"
EXIT_NO_GPU = 2
MiB = 2**20


# --- the device's figure for this process ----------------------------------------------------------


class _ProcessMemory:
    """The device's figure for this process: NVML (or amdsmi) per process, else nvidia-smi's per-process
    list, else the card's used memory (cudaMemGetInfo) less what was in use before this process."""

    def __init__(self, index: int):
        import torch

        self.index = index
        self.reader = None
        self.source = "the card's used memory (cudaMemGetInfo), less the card's use before the probe"
        try:
            from harness.measure.trackers import device_memory_reader

            reader = device_memory_reader(torch.device("cuda", index))
        except Exception:  # the tracker module needs nothing but torch; NVML may still be missing
            reader = None
        if reader is not None and getattr(reader, "per_process", False):
            self.reader, self.source = reader, f"{type(reader).__name__.strip('_')} (per process)"
        elif _smi_process_used(os.getpid()) is not None or shutil.which("nvidia-smi"):
            self.source = "nvidia-smi --query-compute-apps (per process)"
        self.card_before = _smi_card_used(index)  # before this process made a context

    def read(self) -> int:
        import torch

        torch.cuda.synchronize(self.index)
        if self.reader is not None:
            value = self.reader.read()
            if value is not None and getattr(self.reader, "per_process", False):
                return int(value)
            self.reader = None  # NVML does not list this process (a container hides its PID)
        if self.source.startswith("nvidia-smi"):
            value = _smi_process_used(os.getpid())
            if value is not None:
                return value
        self.source = "the card's used memory (cudaMemGetInfo), less the card's use before the probe"
        free, total = torch.cuda.mem_get_info(self.index)
        return total - free - (self.card_before or 0)


def _smi(args: list[str]) -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _smi_process_used(pid: int) -> int | None:
    out = _smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]) or ""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0] == str(pid) and cells[1].isdigit():
            return int(cells[1]) * MiB
    return None


def _smi_card_used(index: int) -> int | None:
    out = _smi(["--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]) or ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    physical = ids[index] if index < len(ids) else str(index)
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0] == physical and cells[1].isdigit():
            return int(cells[1]) * MiB
    return None


class _Steps:
    """Measures each step as the growth of (device figure - reserved) over it."""

    def __init__(self, index: int):
        import torch

        self.torch = torch
        self.index = index
        self.memory = _ProcessMemory(index)
        self.parts: dict[str, dict] = {}

    def outside(self) -> tuple[int, int]:
        reserved = self.torch.cuda.memory_reserved(self.index)
        return self.memory.read() - reserved, reserved

    def measure(self, name: str, how: str, step) -> None:
        try:
            out0, res0 = self.outside()
            step()
            out1, res1 = self.outside()
            self.parts[name] = {"bytes": max(0, out1 - out0), "how": how, "in_allocator": max(0, res1 - res0)}
        except Exception as exc:  # a missing library or a kernel the card lacks: recorded, not fatal
            self.parts[name] = {"bytes": None, "how": how, "error": f"{type(exc).__name__}: {exc}"[:300]}


# --- the single-process parts ---------------------------------------------------------------------


def _cublas(torch) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
        (a @ b).float().sum().backward()
        x = torch.randn(8, 512, 4096, device="cuda", dtype=dtype, requires_grad=True)  # a batched linear
        torch.nn.functional.linear(x, b).float().sum().backward()
    torch.cuda.synchronize()


def _attention(torch) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ran = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
            ran.append(backend.name)
        except RuntimeError:  # a backend this card or build lacks
            continue
    torch.cuda.synchronize()
    if not ran:
        raise RuntimeError("no scaled-dot-product attention backend ran")


def _triton(torch) -> None:
    from harness.runtime.probe_triton import launch

    launch(torch)


def _bitsandbytes(torch) -> None:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(4096, 4096, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4").cuda()
    x = torch.randn(4, 512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    torch.cuda.synchronize()


def single_process(queue) -> None:
    """Child: the context and the libraries' parts on GPU 0, with the platform's identity."""
    import torch

    steps = _Steps(0)
    torch.cuda.set_device(0)
    steps.measure("cuda_context", PARTS["cuda_context"], lambda: torch.zeros(1, device="cuda"))
    steps.parts["cuda_context"]["bytes"] = steps.outside()[0]  # the whole of it: nothing was there before
    for name, fn in (("cublas", _cublas), ("attention", _attention), ("triton", _triton),
                     ("bitsandbytes", _bitsandbytes)):
        steps.measure(name, PARTS[name], lambda fn=fn: fn(torch))
    queue.put({"parts": steps.parts, "identity": _identity(torch), "memory_source": steps.memory.source})


def _identity(torch) -> dict:
    import importlib.metadata as md

    versions = {}
    for lib in ("triton", "bitsandbytes", "deepspeed", "nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            versions[lib] = md.version(lib)
        except md.PackageNotFoundError:
            pass
    try:
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL (ROCm builds have RCCL under the same name)
        pass
    props = torch.cuda.get_device_properties(0)
    driver = (_smi(["--query-gpu=driver_version", "--format=csv,noheader"]) or "").strip().splitlines()
    return {"card": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
            "driver": driver[0] if driver else None, "versions": versions,
            "vendor": "amd" if torch.version.hip else "nvidia"}


# --- NCCL and DeepSpeed, one process per GPU -------------------------------------------------------


def ranked(rank: int, world: int, port: int, job: str, queue) -> None:
    """Child: rank `rank` of `world` on GPU `rank`: NCCL's part (`job` "nccl"), or a DeepSpeed job's
    (`job` "deepspeed": DeepSpeed makes the process group and its communicators as a training job's does;
    "deepspeed_after_collective": the same after a barrier on the default group, `DEEPSPEED_AFTER_COLLECTIVE`)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    torch.zeros(1, device="cuda")
    if job != "nccl":
        _cublas(torch)  # the engine's step runs matmuls: cuBLAS is a part of its own
    steps = _Steps(rank)
    if job == "deepspeed":
        steps.measure(job, DEEPSPEED, lambda: _deepspeed(torch))
    elif job == "deepspeed_after_collective":
        steps.measure(job, DEEPSPEED_AFTER_COLLECTIVE, lambda: _deepspeed(torch, collective_first=True))
    else:
        steps.measure("nccl", NCCL, lambda: _nccl(torch, rank, world))
    queue.put({"rank": rank, "parts": steps.parts})
    if dist.is_initialized():
        dist.destroy_process_group()


def _nccl(torch, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    t = torch.ones(16 * MiB // 4, device="cuda")
    dist.all_reduce(t)
    gathered = torch.empty(world * t.numel(), device="cuda")
    dist.all_gather_into_tensor(gathered, t)
    dist.reduce_scatter_tensor(t, gathered)
    dist.barrier()


def _deepspeed(torch, collective_first: bool = False) -> None:
    import io
    from contextlib import redirect_stdout

    import deepspeed

    if collective_first:  # the process group made as a training job's launcher makes it, then one barrier on it
        import torch.distributed as dist

        deepspeed.init_distributed(verbose=False)
        dist.barrier()

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    with redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
        x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
        engine.backward(engine(x).float().sum())
        engine.step()
    torch.cuda.synchronize()


# --- the parent: runs the children, writes the record ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(targets: list[tuple], timeout: float) -> tuple[list[dict], str | None]:
    """Start one spawned process per (function, args); collect what each puts on the queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, queue)) for fn, args in targets]  # not daemons: libraries fork
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=0.5))
        except Exception:  # queue.Empty: see whether a child died without answering
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    problem = None
    if len(results) < len(procs):
        codes = [p.exitcode for p in procs]
        problem = (f"timed out after {timeout:.0f} s" if time.monotonic() >= deadline
                   else f"a process ended without a result (exit codes {codes})")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return results, problem


def world_sizes(gpus: int, limit: int | None) -> list[int]:
    """The world sizes to measure NCCL at: 1, 2 and every GPU, within `limit`."""
    top = min(gpus, limit or gpus)
    return sorted({w for w in (1, 2, top) if 1 <= w <= top})


def probe(out: Path, ranks: int | None = None, timeout: float = 90.0) -> Path:
    import torch

    from harness.runtime import device_probe as this  # by its module name, so spawned children can import it

    t0 = time.monotonic()
    found, problem = _run([(this.single_process, ())], timeout)
    if problem or not found:
        raise RuntimeError(f"the single-process probe failed: {problem}")
    single = found[0]
    ident = single["identity"]
    gpus = torch.cuda.device_count()
    parts = {k: Part(**v) for k, v in single["parts"].items()}
    jobs = {"nccl": (NCCL, {}), "deepspeed": (DEEPSPEED, {}),
            "deepspeed_after_collective": (DEEPSPEED_AFTER_COLLECTIVE, {})}
    for world in world_sizes(gpus, ranks):
        for job, (how, table) in jobs.items():
            if job != "nccl" and importlib.util.find_spec("deepspeed") is None:
                table[world] = Part(bytes=None, how=how, error="deepspeed is not installed")
                continue
            port = _free_port()
            results, problem = _run([(this.ranked, (r, world, port, job)) for r in range(world)], timeout)
            if problem or len(results) < world:
                table[world] = Part(bytes=None, how=how, error=problem or "a rank gave no result")
            else:
                table[world] = _worst(results, job, how)
    record = DeviceRecord(
        platform=platform_key(ident["card"], gpus), card=ident["card"], device_count=gpus, vendor=ident["vendor"],
        driver=ident["driver"], torch=ident["torch"], cuda=ident["cuda"], hip=ident["hip"],
        date=dt.date.today().isoformat(), memory_source=single["memory_source"], parts=parts,
        **{job: table for job, (_, table) in jobs.items()},
        versions=ident["versions"], seconds=round(time.monotonic() - t0, 1))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{record.platform}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(record.to_json(), encoding="utf-8")
    tmp.replace(path)
    return path


def _worst(results: list[dict], name: str, how: str) -> Part:
    """The part over the ranks: the largest (the per-card limit is the worst rank's)."""
    found = [r["parts"].get(name) for r in results]
    if any(f is None for f in found):
        return Part(bytes=None, how=how, error="not measured on every rank")
    errors = [f["error"] for f in found if f.get("error")]
    if errors:
        return Part(bytes=None, how=how, error=errors[0])
    worst = max(found, key=lambda f: f["bytes"])
    return Part(bytes=worst["bytes"], how=how, in_allocator=worst.get("in_allocator", 0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.runtime.device_probe",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the record (default results/device)")
    parser.add_argument("--ranks", type=int, help="the largest world size to measure NCCL at (default: every GPU)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds one step may take (default 90)")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("device probe: torch is not installed; run it where the training jobs run", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print("device probe: no CUDA or HIP device is visible; run it on the GPU host whose platform it measures",
              file=sys.stderr)
        return EXIT_NO_GPU
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: it is not what training jobs use here
    path = probe(args.out, args.ranks, args.timeout)
    record = DeviceRecord.read(path)
    print(f"{path}: {record.card} x{record.device_count}, torch {record.torch}, CUDA {record.cuda or record.hip}, "
          f"driver {record.driver}, {record.seconds:.0f} s; device figure from {record.memory_source}")
    by_world = [(f"{job} at {w} ranks", p) for job in WORLD_TABLES for w, p in sorted(getattr(record, job).items())]
    for name, part in [*record.parts.items(), *by_world]:
        value = f"{part.bytes / MiB:8.1f} MiB" if part.bytes is not None else f"not measured: {part.error}"
        kept = f" (+{part.in_allocator / MiB:.1f} MiB reserved)" if part.in_allocator else ""
        print(f"  {name:40s} {value}{kept}")
    print(json.dumps({"record": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
