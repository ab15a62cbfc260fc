"""The per-thread stack of every Triton kernel (and autotune candidate) a GLA training step launches, for sm_90.

Guide 004's GLA case holds ~3.5 GiB per process outside PyTorch's allocator on a cold Triton cache (H100
and H200, any batch) and not on a warm one (flash-linear-attention caches its autotune results). One
explanation is CUDA local memory: when a kernel whose threads need N bytes of local memory (stack frame,
register spills) is launched, the driver sizes the context's local memory for N bytes x every thread the
card can hold resident (132 SMs x 2048 threads = 270,336 on both cards) and keeps it. On a cold cache
the autotuner launches every candidate config, spilling ones included; on a warm cache only the winner
runs. 3.55 GiB / 270,336 threads would be ~14,100 bytes per thread. NVIDIA's description of the
driver's figure adds a 512-byte syscall stack per thread and rounds up to 128 or 256 bytes; the table
gives both the bare product and that one.

This script looks for that number in the kernels themselves, without a GPU. It makes Triton and
flash-linear-attention believe they run on an H100 (a stand-in Triton driver reporting sm_90 with
Hopper's shared memory and SM count, before fla is imported, so fla's import-time config lists are
Hopper's), builds the case's model at full width with one layer (every layer launches the same
kernels) and runs one LoRA training step (forward, loss, backward) on CPU tensors with every Triton
launch intercepted instead of run: for a plain kernel the arguments are bound and specialized by
Triton's own binder; for an autotuned one, every config the autotuner would benchmark (after its
pruning) is bound the same way. Each distinct (kernel, specialization, config) is then compiled for
GPUTarget("cuda", 90, 32) and cuobjdump reads its REG / STACK / LOCAL. Outputs are never computed
(the kernels do not run), so tensors hold garbage; shapes, dtypes, strides and every constexpr
are the ones the GPU run sees.

    python benchmarks/triton_autotune_stack.py --out stack.json

Which candidate wins each autotuning is decided by timing on the GPU and is not known here. The
compiler is the Triton that is imported (its PTX and its bundled ptxas); another release allocates
registers and spills differently, and fla prunes some candidates by Triton version. To compile with
the GPU hosts' release, install it into a folder and put that first on the path:

    pip install --no-deps --target /tmp/triton-3.6 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6 python benchmarks/triton_autotune_stack.py --out stack-3.6.json

The JSON's summary names the Triton release, the largest stack and each kernel's smallest and largest.
Exit codes: 0 measured, 1 a compile or the step failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.predict.constants import SMS, THREADS_PER_SM  # noqa: E402  (an H100 SXM's and an H200's)
from harness.spec.units import GIB  # noqa: E402

DEFAULT_CASE = str(ROOT / "cases" / "004-gla-plan-c-1proc.yaml")
RESIDENT_THREADS = SMS * THREADS_PER_SM  # 270,336
SYSCALL_STACK = 512  # bytes per thread the driver adds to a kernel's local size (NVIDIA developer forum)
LMEM_GRANULE = 256
HOPPER_SHARED_MEM = 232448  # bytes per block, opt-in (fla's Backend.HOPPER)
HOPPER_NAME = "NVIDIA H100 80GB HBM3"

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")
_USAGE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")
_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")


# --- pure parts -------------------------------------------------------------------------------------


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """cuobjdump --dump-resource-usage output as {function: {"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..}}."""
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = m.group(1)
            usage[current] = {}
            continue
        if current is not None and _USAGE.search(line):
            usage[current].update({k: int(v) for k, v in _USAGE.findall(line)})
            current = None
    return usage


def local_bytes_per_thread(usage: dict[str, int]) -> int:
    """The local memory one thread of the kernel needs: its stack frame, or its LOCAL figure if larger."""
    return max(usage.get("STACK", 0), usage.get("LOCAL", 0))


def resident_gib(bytes_per_thread: int, threads: int = RESIDENT_THREADS) -> float:
    """What the driver reserves for `bytes_per_thread` of local memory on every resident thread, in GiB."""
    return bytes_per_thread * threads / GIB


def driver_gib(bytes_per_thread: int, threads: int = RESIDENT_THREADS, syscall: int = SYSCALL_STACK,
               granule: int = LMEM_GRANULE) -> float:
    """The same with the driver's own additions as NVIDIA describes them: a syscall stack of 512 bytes per
    thread and the sum rounded up to 128 or 256 bytes (here 256, the larger) before x resident threads."""
    per_thread = -(-(bytes_per_thread + syscall) // granule) * granule
    return per_thread * threads / GIB


def bytes_per_thread_for(gib: float, threads: int = RESIDENT_THREADS) -> float:
    """The per-thread local memory that would account for `gib` GiB over `threads` threads."""
    return gib * GIB / threads


def config_label(constexprs: dict, tuned: dict, num_warps: int, num_stages: int) -> str:
    """A short config text: the autotuned constexprs (else the block sizes) with warps and stages."""
    tuned = {k: v for k, v in tuned.items() if k not in LAUNCH_OPTIONS}
    shown = tuned or {k: v for k, v in constexprs.items() if k.startswith("B")}
    parts = [f"{k}={v}" for k, v in sorted(shown.items())]
    return " ".join([*parts, f"w{num_warps}", f"s{num_stages}"])


# --- a stand-in Hopper for Triton and fla --------------------------------------------------------


def pretend_hopper():
    """Make Triton's active driver and torch.cuda's queries answer as an H100 (call before fla is imported).
    Returns a function that puts them back."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": HOPPER_SHARED_MEM, "multiprocessor_count": SMS, "max_num_regs": 65536,
                    "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}

    class _Hopper:
        utils = _Utils()

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    saved_driver = driver._active
    saved_cuda = {name: getattr(torch.cuda, name)
                  for name in ("get_device_name", "get_device_capability", "device_count")}
    driver.set_active(_Hopper())
    torch.cuda.get_device_name = lambda device=None: HOPPER_NAME
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.device_count = lambda: 1

    def undo():
        driver._active = saved_driver
        for name, value in saved_cuda.items():
            setattr(torch.cuda, name, value)

    return undo


# --- intercepting launches -----------------------------------------------------------------------


@dataclass
class Launch:
    """One kernel specialization as Triton would compile it."""

    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    tuned: dict = field(default_factory=dict)  # the autotune config's values; empty for a plain kernel
    candidates: int = 1  # configs the autotuner benchmarks for this call (after pruning)
    fn: object = None  # the JITFunction
    compile_args: tuple = ()  # (signature, constexprs, attrs, options) as JITFunction._pack_args gives them

    def key(self) -> str:
        return repr((self.kernel, sorted(self.signature.items()), sorted(map(repr, self.constexprs.items())),
                     sorted(map(repr, self.attrs.items())), self.options.get("num_warps"),
                     self.options.get("num_stages")))


class Interceptor:
    """Replaces JITFunction.run and every Autotuner.run with recorders that bind but never launch."""

    def __init__(self):
        self.launches: dict[str, Launch] = {}
        self._tuning: dict | None = None
        self._saved: list = []

    def _record_jit(self, fn, args, kwargs):
        from triton import knobs

        kwargs = dict(kwargs)  # the options JITFunction.run adds before binding
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # the second one from Triton 3.7
            if hasattr(knobs.compilation, knob):
                kwargs[knob] = getattr(knobs.compilation, knob)
        _, _, _, backend, binder = fn.device_caches[0]
        bound_args, specialization, _ = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, None)
        tuned = dict(self._tuning["config"]) if self._tuning else {}
        launch = Launch(kernel=fn.__name__, signature=signature,
                        constexprs={".".join([fn.arg_names[k[0]], *map(str, k[1:])]): v
                                    for k, v in constexprs.items()},
                        attrs={k: v for k, v in attrs.items()}, options=dict(options.__dict__),
                        tuned=tuned, candidates=self._tuning["candidates"] if self._tuning else 1, fn=fn,
                        compile_args=(signature, constexprs, attrs, options))
        self.launches.setdefault(launch.key(), launch)

    def install(self) -> None:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        me = self

        def jit_run(fn, *args, grid, warmup, **kwargs):
            me._record_jit(fn, args, kwargs)
            return None

        def autotuner_run(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args, strict=False))
            configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
            for config in configs:
                me._tuning = {"config": config.all_kwargs(), "candidates": len(configs)}
                try:
                    tuner.fn.run(*args, **kwargs, **config.all_kwargs())
                finally:
                    me._tuning = None
            tuner.nargs = None
            return None

        self._saved.append((JITFunction, "run", JITFunction.run))
        JITFunction.run = jit_run
        classes = [Autotuner]
        while classes:
            cls = classes.pop()
            classes.extend(cls.__subclasses__())
            if "run" in cls.__dict__:
                self._saved.append((cls, "run", cls.__dict__["run"]))
                cls.run = autotuner_run

    def remove(self) -> None:
        for cls, name, value in reversed(self._saved):
            setattr(cls, name, value)
        self._saved.clear()


def allow_cpu_cross_entropy() -> None:
    """fla's FusedCrossEntropyLoss refuses CPU tensors by an assert; call its kernels' wrapper the same way."""
    from fla.modules.fused_cross_entropy import ops

    def forward(self, input, target):
        loss, _ = ops.cross_entropy_loss(
            logits=input, target=target, label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
            lse_square_scale=self.lse_square_scale, logit_softcapping=self.logit_softcapping,
            ignore_index=self.ignore_index, inplace_backward=self.inplace_backward, process_group=self.process_group)
        return loss.sum() / (target != self.ignore_index).sum() if self.reduction == "mean" else loss.sum()

    ops.FusedCrossEntropyLoss.forward = forward


# --- the step -----------------------------------------------------------------------------------


def gla_step(case_path: str, batch: int, layers: int) -> dict:
    """One LoRA training step of the case's model (full width, `layers` layers) on CPU, launches intercepted."""
    import torch

    from harness.models.registry import hf_config
    from harness.runtime.build import lora_model, model_config_dict, set_checkpointing
    from harness.spec.cases import load_case

    allow_cpu_cross_entropy()
    case = load_case(case_path)
    seq_len = case.train.seq_len
    config = model_config_dict(case, "real", seq_len, layers=layers)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.bfloat16)
    if case.method.kind == "lora":
        model = lora_model(case, model)
    model.train()
    set_checkpointing(model, bool(case.train.gradient_checkpointing))
    ids = torch.randint(0, config["vocab_size"], (batch, seq_len))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {"case": case.id, "model": case.model, "seq_len": seq_len, "batch": batch, "layers": layers,
            "hidden_size": config["hidden_size"], "num_heads": config["num_heads"],
            "head_k_dim": int(config["hidden_size"] * config["expand_k"]) // config["num_heads"],
            "head_v_dim": int(config["hidden_size"] * config["expand_v"]) // config["num_heads"]}


# --- compiling ----------------------------------------------------------------------------------


def cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_usage(launch: Launch, folder: str) -> dict[str, int]:
    """Compile one launch for sm_90 and read its resource usage from the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = launch.compile_args
    src = ASTSource(launch.fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options.__dict__)
    path = os.path.join(folder, f"{launch.kernel}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    text = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                          check=True).stdout
    usage = parse_resource_usage(text)
    if not usage:
        raise RuntimeError(f"cuobjdump printed no function for {launch.kernel}:\n{text}")
    return next(iter(usage.values()))


def measure(launches: list[Launch]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i, launch in enumerate(launches, 1):
            label = config_label(launch.constexprs, launch.tuned, launch.options["num_warps"],
                                 launch.options["num_stages"])
            row = {"kernel": launch.kernel, "config": label, "tuned": launch.tuned,
                   "autotuned": bool(launch.tuned), "candidates": launch.candidates,
                   "num_warps": launch.options["num_warps"], "num_stages": launch.options["num_stages"],
                   "constexprs": {k: v for k, v in launch.constexprs.items() if _jsonable(v)},
                   "signature": {k: v for k, v in launch.signature.items() if v != "constexpr"}}
            t0 = time.time()
            try:
                usage = compile_usage(launch, folder)
            except Exception as exc:  # a candidate the compiler rejects is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            else:
                per_thread = local_bytes_per_thread(usage)
                row.update(reg=usage.get("REG"), stack=usage.get("STACK"), local=usage.get("LOCAL"),
                           shared=usage.get("SHARED"), bytes_per_thread=per_thread,
                           resident_gib=round(resident_gib(per_thread), 4),
                           driver_gib=round(driver_gib(per_thread), 4))
            row["compile_s"] = round(time.time() - t0, 2)
            result = row.get("error") or f"REG {row['reg']} STACK {row['stack']} LOCAL {row['local']}"
            print(f"[{i}/{len(launches)}] {launch.kernel} {label}: {result}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def per_kernel(rows: list[dict]) -> dict[str, dict]:
    """Each kernel's fewest and most bytes per thread over its compiled specializations. On a cold cache
    the autotuner runs every candidate, so the driver keeps the most; on a warm one, only the winner's."""
    out: dict[str, dict] = {}
    for r in rows:
        if "error" in r:
            continue
        k = out.setdefault(r["kernel"], {"specializations": 0, "autotuned": r["autotuned"],
                                         "min_bytes_per_thread": r["bytes_per_thread"],
                                         "max_bytes_per_thread": -1})
        k["specializations"] += 1
        k["min_bytes_per_thread"] = min(k["min_bytes_per_thread"], r["bytes_per_thread"])
        if r["bytes_per_thread"] > k["max_bytes_per_thread"]:
            k.update(max_bytes_per_thread=r["bytes_per_thread"], max_config=r["config"], max_reg=r["reg"],
                     max_resident_gib=r["resident_gib"], max_driver_gib=r["driver_gib"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["max_bytes_per_thread"]))


def table(rows: list[dict]) -> str:
    head = (f"{'kernel':46} {'config':40} {'REG':>4} {'STACK':>6} {'LOCAL':>6} {'x 270,336 GiB':>14} "
            f"{'+512, GiB':>9}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (-(r.get("bytes_per_thread") or 0), r["kernel"], r["config"])):
        if "error" in r:
            lines.append(f"{r['kernel']:46} {r['config']:40} compile failed: {r['error']}")
            continue
        lines.append(f"{r['kernel']:46} {r['config']:40} {r['reg']:>4} {r['stack']:>6} {r['local']:>6} "
                     f"{r['resident_gib']:>14.3f} {r['driver_gib']:>9.3f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--case", default=DEFAULT_CASE,
                        help="a GLA case file (default: guide 004's plan C, cases/004-gla-plan-c-1proc)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--layers", type=int, default=1,
                        help="model layers to build (default 1: every layer launches the same kernels)")
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="compile only the kernels whose name matches this regular expression (default: all)")
    parser.add_argument("--observed-gib", type=float, default=None,
                        help="the memory outside the allocator to compare with (default: what the recorded cold "
                             "runs of guide 004 hold beyond the warm ones, per process: `cold_extra_from_baselines`)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.layers < 1:
        parser.error("--batch and --layers take a positive count")
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as exc:
            parser.error(f"--only {args.only!r}: not a regular expression ({exc})")
    if not Path(args.case).is_file():
        parser.error(f"--case {args.case}: no such file; give a case YAML such as {DEFAULT_CASE}")
    return args


def cold_extra_from_baselines(baselines: Path = ROOT / "results" / "baselines") -> float | None:
    """GiB per process that the recorded runs of guide 004's GLA cases hold outside the allocator on a cold
    Triton cache beyond a warm one: the mean over finished runs of (card peak / processes - reserved), cold
    less warm. None where either kind of run is missing."""
    from harness.spec.cases import load_case

    outside: dict[str, list[float]] = {"cold": [], "warm": []}
    for path in sorted(baselines.glob("*/004-gla-*.json")):
        data = json.loads(path.read_text())
        case_file = ROOT / "cases" / f"{data['case_id']}.yaml"
        if not case_file.is_file():  # a fitted config's baseline: its processes are in its own case file
            continue
        procs = load_case(case_file).launch.procs_per_card
        for run in data.get("runs", []):
            if run.get("outcome") == "ok" and run.get("triton_cache") in outside and run.get("per_card_peak"):
                outside[run["triton_cache"]].append(run["per_card_peak"] / procs - run["reserved_peak"])
    if not outside["cold"] or not outside["warm"]:
        return None
    return (sum(outside["cold"]) / len(outside["cold"]) - sum(outside["warm"]) / len(outside["warm"])) / 2**30


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.observed_gib is None:
        args.observed_gib = round(cold_extra_from_baselines() or 0.0, 3)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the older releases' default
    pretend_hopper()  # for the whole process: fla's import-time choices depend on it
    import triton

    interceptor = Interceptor()
    interceptor.install()
    try:
        step = gla_step(args.case, args.batch, args.layers)
    finally:
        interceptor.remove()
    launches = [x for x in interceptor.launches.values() if args.only is None or re.search(args.only, x.kernel)]
    print(f"{len(launches)} kernel specializations to compile", file=sys.stderr, flush=True)
    rows = measure(launches)
    print(table(rows))
    measured = [r for r in rows if "error" not in r]
    top = max(measured, key=lambda r: r["bytes_per_thread"], default=None)
    summary = {
        "triton": triton.__version__, "target": "cuda sm_90", "resident_threads": RESIDENT_THREADS,
        "observed_gib": args.observed_gib,
        "observed_bytes_per_thread": round(bytes_per_thread_for(args.observed_gib)),
        "max": None if top is None else {k: top[k] for k in ("kernel", "config", "reg", "stack", "local",
                                                             "bytes_per_thread", "resident_gib", "driver_gib")},
        "kernels": len({r["kernel"] for r in rows}), "specializations": len(rows),
        "failed": sum("error" in r for r in rows),
        "per_kernel": per_kernel(rows),
    }
    print(f"\n{'kernel':46} {'specs':>5} {'min B/thr':>9} {'max B/thr':>9}  max GiB  config of the max")
    for name, k in summary["per_kernel"].items():
        print(f"{name:46} {k['specializations']:>5} {k['min_bytes_per_thread']:>9} {k['max_bytes_per_thread']:>9} "
              f"{k['max_resident_gib']:>8.3f}  {k['max_config']}")
    if top is not None:
        print(f"\nmax: {top['kernel']} [{top['config']}] {top['bytes_per_thread']} B/thread "
              f"x {RESIDENT_THREADS:,} = {top['resident_gib']:.3f} GiB "
              f"({top['driver_gib']:.3f} GiB with the driver's 512 B syscall stack) "
              f"(observed {args.observed_gib} GiB = {summary['observed_bytes_per_thread']:,} B/thread)")
    Path(args.out).write_text(json.dumps({"step": step, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
