"""What a cold Triton cache holds on the device outside PyTorch's allocator, kernel by kernel.

Guide 004's GLA case (flash-linear-attention's Triton kernels) held 7.72 GiB of device memory on a cold
Triton cache against 3.45 GiB reserved by PyTorch, and ~4.0 GiB against 3.28 GiB on a warm one: the
first step of a cold run adds ~3.5 GiB outside the caching allocator. To predict it we must know what
it is. The candidates: CUDA local memory (the per-thread stack the driver grows, never shrinks, when a
kernel that spills is launched: stack bytes x SMs x threads per SM), the modules (cubins) of every
autotune candidate, the autotuner's benchmark buffer and argument clones (these would show in torch's
reserved figure), or something else.

This script trains the case's model a few steps the harness's way (fidelity "real") with Triton's
launch path wrapped: at each kernel's first launch it reads the device memory of this process (NVML,
else the card's used memory), torch's reserved bytes and the driver's stack-size limit before the
compile, after the module load and after the launch, and the kernel's registers, spills, local and
shared bytes; each multi-config autotuning is recorded as a whole too. Run it twice with one cache
folder, cold then warm, and compare the two JSON files:

    python benchmarks/triton_cold_memory.py --out cold.json --triton-cache /tmp/tcm-cache
    python benchmarks/triton_cold_memory.py --out warm.json --triton-cache /tmp/tcm-cache

(the folder is emptied only when it is not given: a fresh temporary one, a cold cache.) Exit codes:
0 measured, 1 the run failed (the JSON holds the error and what was measured before it), 2 bad input.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_CASE = str(ROOT / "cases" / "004-gla-plan-c-1proc.yaml")
CU_LIMIT_STACK_SIZE = 0
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
TOP = 10


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--triton-cache", default=None,
                        help="TRITON_CACHE_DIR for the run (default: a fresh empty temporary folder, a cold cache)")
    parser.add_argument("--case", default=DEFAULT_CASE,
                        help="a single-process case file (default: guide 004's plan C, cases/004-gla-plan-c-1proc)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1 step")
    return args


def prepare_cache(path: str | None) -> tuple[Path, int]:
    """The Triton cache folder (created; a fresh temporary one when none is given) and its files at the start."""
    folder = Path(path).expanduser().resolve() if path else Path(tempfile.mkdtemp(prefix="triton-cold-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder, sum(1 for p in folder.rglob("*") if p.is_file())


def deltas(before: dict, after: dict) -> dict:
    """after - before for each figure both snapshots hold (None where either lacks it)."""
    keys = ("device", "reserved", "outside", "stack", "card_used")
    return {k: after[k] - before[k] if isinstance(before.get(k), int) and isinstance(after.get(k), int) else None
            for k in keys}


def config_label(kwargs: dict) -> str:
    """The scalar keyword arguments of a launch (an autotune config's block sizes, warps and stages among them)."""
    return ",".join(f"{k}={v}" for k, v in sorted(kwargs.items())
                    if k not in ("grid", "warmup") and isinstance(v, (bool, int, float, str)))


def fn_name(obj) -> str:
    for o in (getattr(obj, "base_fn", None), obj, getattr(obj, "fn", None)):
        name = getattr(o, "__name__", None) if o is not None else None
        if isinstance(name, str) and name not in ("JITFunction", "Autotuner", "Heuristics"):
            return name
    return type(obj).__name__


def _outside(record: dict) -> int:
    return (record.get("jump") or {}).get("outside") or 0


def summarize(timeline: list[dict], kernels: list[dict], tunes: list[dict], props: dict) -> dict:
    """The figures that decide between the hypotheses (module docstring)."""
    at = {p["phase"]: p for p in timeline}

    def growth(a: str, b: str) -> int | None:
        return deltas(at[a], at[b])["outside"] if a in at and b in at else None

    stack_end = timeline[-1].get("stack") if timeline else None
    sms, threads = props.get("multi_processor_count"), props.get("max_threads_per_multi_processor")
    locals_ = [k["local_bytes"] for k in kernels if isinstance(k.get("local_bytes"), int)]
    return {
        "outside_growth_first_step": growth("step 1 start", "step 1 end"),
        "outside_growth_whole_run": growth("cuda init", "end"),
        "sum_kernel_outside_jumps": sum(_outside(k) for k in kernels),
        "sum_load_outside_jumps": sum((k.get("load_jump") or {}).get("outside") or 0 for k in kernels),
        "sum_launch_outside_jumps": sum((k.get("launch_jump") or {}).get("outside") or 0 for k in kernels),
        "sum_autotune_reserved_jumps": sum((t.get("jump") or {}).get("reserved") or 0 for t in tunes),
        "new_kernels": len(kernels),
        "autotunings": len(tunes),
        "configs_benchmarked": sum(t.get("benchmarked", 0) for t in tunes),
        "kernels_spilling": sum(1 for k in kernels if (k.get("n_spills") or 0) > 0),
        "max_local_bytes_per_thread": max(locals_, default=None),
        "cubin_bytes_total": sum(k.get("cubin_bytes") or 0 for k in kernels),
        "stack_limit": {"start": timeline[0].get("stack") if timeline else None, "end": stack_end},
        "local_memory_for_end_stack": stack_end * sms * threads if all(isinstance(v, int)
                                                                      for v in (stack_end, sms, threads)) else None,
        "largest_jumps": [{k: r.get(k) for k in ("name", "kernel", "config", "n_regs", "n_spills", "local_bytes",
                                                 "shared", "jump", "load_jump", "launch_jump")}
                          for r in sorted(kernels, key=_outside, reverse=True)[:TOP]],
    }


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


class Probe:
    """Reads this process's device memory, torch's reserved bytes and the driver's stack-size limit."""

    def __init__(self, device):
        self.device, self.t0, self.errors, self.reader, self.cuda = device, time.perf_counter(), {}, None, None
        try:
            from harness.measure.trackers import device_memory_reader
            self.reader = device_memory_reader(device)
            if self.reader is None:
                self.errors["nvml"] = "no NVML: the card's used memory (cudaMemGetInfo) stands in"
        except Exception as exc:  # no NVML: the card's used memory stands in
            self.errors["nvml"] = repr(exc)
        try:
            self.cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            self.errors["libcuda"] = repr(exc)

    def _driver(self, call: str, out, *args) -> int | None:
        if self.cuda is None:
            return None
        try:
            rc = getattr(self.cuda, call)(ctypes.byref(out), *args)
        except Exception as exc:  # a driver without the entry point: the figure stays unknown
            self.errors[call] = repr(exc)
            return None
        if rc != 0:
            self.errors[call] = f"CUresult {rc}"
            return None
        return int(out.value)

    def stack(self) -> int | None:  # the primary context torch made current on this thread
        return self._driver("cuCtxGetLimit", ctypes.c_size_t(), ctypes.c_int(CU_LIMIT_STACK_SIZE))

    def local_bytes(self, function) -> int | None:
        return self._driver("cuFuncGetAttribute", ctypes.c_int(), ctypes.c_int(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                            ctypes.c_void_p(function)) if function else None

    def snap(self, phase: str | None = None) -> dict:
        import torch

        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        try:
            nvml = self.reader.read() if self.reader is not None else None
        except Exception as exc:  # the card's used memory stands in
            nvml, self.errors["nvml read"] = None, repr(exc)
        per_process = nvml is not None and self.reader.per_process
        out = {"t": round(time.perf_counter() - self.t0, 4), "device": nvml if per_process else total - free,
               "device_source": "nvml process" if per_process else "card used", "card_used": total - free,
               "reserved": torch.cuda.memory_reserved(self.device),
               "allocated": torch.cuda.memory_allocated(self.device), "stack": self.stack()}
        out["outside"] = out["device"] - out["reserved"]
        return {"phase": phase, **out} if phase else out


class Hooks:
    """Wraps Triton's launch path (JITFunction.run, its compile, CompiledKernel's module load, the autotuner)."""

    def __init__(self, probe):
        self.probe, self.kernels, self.tunes, self.status, self.benched = probe, [], [], {}, 0
        self._call: dict | None = None
        self._tuning: dict | None = None  # the autotuning under way, if any
        self._undo: list = []

    def snap(self) -> dict:
        try:
            return self.probe.snap()
        except Exception as exc:  # a failed reading never stops the run
            return {"error": repr(exc)}

    def install(self, jit_cls, compiled_cls, autotuner_cls) -> dict:
        for cls, name, make in ((jit_cls, "run", self._run), (jit_cls, "_do_compile", self._compile),
                                (compiled_cls, "_init_handles", self._load), (autotuner_cls, "run", self._tune),
                                (autotuner_cls, "_bench", self._bench)):
            key = f"{getattr(cls, '__name__', cls)}.{name}"
            orig = getattr(cls, name, None) if cls is not None else None
            if not callable(orig):
                self.status[key] = "missing"
                continue
            setattr(cls, name, functools.wraps(orig)(make(orig)))
            self._undo.append((cls, name, orig))
            self.status[key] = "hooked"
        return self.status

    def uninstall(self) -> None:
        for cls, name, orig in reversed(self._undo):
            setattr(cls, name, orig)
        self._undo.clear()

    def kernel_info(self, kernel) -> dict:
        info = {"kernel": getattr(kernel, "name", None), "hash": getattr(kernel, "hash", None)}
        for attr in ("n_regs", "n_spills", "n_max_threads"):
            info[attr] = getattr(kernel, attr, None)
        md = getattr(kernel, "metadata", None)
        for attr in ("shared", "num_warps", "num_stages"):
            info[attr] = getattr(md, attr, None)
        try:
            info["cubin_bytes"] = len(kernel.asm["cubin"])
        except Exception:  # not a CUDA kernel, or asm not kept: the size stays unknown
            info["cubin_bytes"] = None
        try:
            info["local_bytes"] = self.probe.local_bytes(getattr(kernel, "function", None))
        except Exception as exc:
            info["local_bytes_error"] = repr(exc)
        return info

    def _finish(self, call: dict) -> None:
        call["after"] = self.snap()
        first = call.get("before") or call.get("before_load") or {}
        call["jump"] = deltas(first, call["after"])
        if "after_load" in call:
            call["load_jump"] = deltas(call["before_load"], call["after_load"])
            call["launch_jump"] = deltas(call["after_load"], call["after"])
        self.kernels.append(call)
        say(f"kernel {len(self.kernels)} {call.get('name')} {call.get('config') or ''}: compile "
            f"{call.get('compile_s', 0)} s, outside the allocator {_mib(call['after'], first)}, stack "
            f"{call['after'].get('stack')}")

    def _run(self, orig):
        def run(fn, *args, **kwargs):
            outer, call = self._call, {"name": fn_name(fn), "config": config_label(kwargs)}
            self._call = call
            try:
                return orig(fn, *args, **kwargs)
            except BaseException as exc:
                call["error"] = repr(exc)[:500]
                raise
            finally:
                self._call = outer
                if "before" in call or "before_load" in call:
                    self._finish(call)
        return run

    def _compile(self, orig):
        def do_compile(fn, *args, **kwargs):
            call = self._call if self._call is not None else {}
            call["before"] = self.snap()
            t = time.perf_counter()
            kernel = orig(fn, *args, **kwargs)
            call["compile_s"] = round(time.perf_counter() - t, 3)
            return kernel
        return do_compile

    def _load(self, orig):
        def init_handles(kernel, *args, **kwargs):
            if getattr(kernel, "module", None) is not None:
                return orig(kernel, *args, **kwargs)
            alone = self._call is None  # a kernel launched without JITFunction.run: recorded on its own
            call = {"name": getattr(kernel, "name", None), "config": None} if alone else self._call
            call["before_load"] = self.snap()
            try:
                return orig(kernel, *args, **kwargs)
            finally:
                call["after_load"] = self.snap()
                call.update(self.kernel_info(kernel))
                if alone:
                    self._finish(call)
        return init_handles

    def _tune(self, orig):
        # A multi-config autotuner's `run` is every launch of its kernel; it benchmarks (and compiles the
        # candidates) only on a key it has not tuned. The reading before is taken at the first benchmark,
        # so the launches of tuned keys cost nothing here (a reading synchronises and asks NVML).
        def run(tuner, *args, **kwargs):
            if len(getattr(tuner, "configs", ()) or ()) <= 1:
                return orig(tuner, *args, **kwargs)
            outer, tuning = self._tuning, {"before": None, "benched": self.benched, "new": len(self.kernels)}
            self._tuning = tuning
            try:
                return orig(tuner, *args, **kwargs)
            finally:
                self._tuning = outer
                if tuning["before"] is not None:
                    after = self.snap()
                    self.tunes.append({"name": fn_name(tuner), "configs": len(tuner.configs),
                                       "benchmarked": self.benched - tuning["benched"],
                                       "new_kernels": len(self.kernels) - tuning["new"],
                                       "best": str(getattr(tuner, "best_config", None)),
                                       "bench_s": getattr(tuner, "bench_time", None), "before": tuning["before"],
                                       "after": after, "jump": deltas(tuning["before"], after)})
                    say(f"tuned {fn_name(tuner)}: {self.benched - tuning['benched']} of {len(tuner.configs)} "
                        f"configs, outside the allocator {_mib(after, tuning['before'])}")
        return run

    def _bench(self, orig):
        def bench(tuner, *args, **kwargs):
            self.benched += 1
            if self._tuning is not None and self._tuning["before"] is None:
                self._tuning["before"] = self.snap()
            return orig(tuner, *args, **kwargs)
        return bench


def _mib(after: dict, before: dict) -> str:
    try:
        return f"{(after['outside'] - before['outside']) / 2**20:+.0f} MiB"
    except (KeyError, TypeError):
        return "unknown"


def say(line: str) -> None:
    """Progress on stderr, at once: a cold first step compiles for minutes."""
    print(f"[triton_cold_memory {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def versions() -> dict:
    """The worker's record (torch, transformers, peft, flash-linear-attention, CUDA, the driver), with Triton's."""
    import importlib.metadata as md

    from harness.runtime.worker import _versions

    out = _versions()
    for name in ("triton", "fla-core", "nvidia-ml-py"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def measure(case, shape, result: dict) -> None:
    import torch

    from harness.runtime.build import build_model, prepare_checkpoint
    from harness.runtime.data import loader
    from harness.runtime.engine import start_engine

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # the primary context, current on this thread
    probe = Probe(device)
    hooks = Hooks(probe)
    classes = {}
    for key, module, name in (("jit", "triton.runtime.jit", "JITFunction"),
                              ("compiled", "triton.compiler.compiler", "CompiledKernel"),
                              ("autotuner", "triton.runtime.autotuner", "Autotuner")):
        try:
            classes[key] = getattr(__import__(module, fromlist=[name]), name)
        except Exception as exc:  # a hook point this Triton lacks: recorded, the rest still measured
            classes[key] = None
            result["errors"][f"import {module}.{name}"] = repr(exc)
    result["hooks"] = hooks.install(classes["jit"], classes["compiled"], classes["autotuner"])
    p = torch.cuda.get_device_properties(device)
    result["device"] = {k: getattr(p, k, None) for k in ("name", "total_memory", "multi_processor_count",
                                                         "max_threads_per_multi_processor")}
    result["versions"] = versions()
    timeline = result["timeline"]
    try:
        timeline.append(probe.snap("cuda init"))
        layers = case.layers
        checkpoint = prepare_checkpoint(case, "real", device, shape.seq_len, layers)
        built = build_model(case, "real", device, None, shape.seq_len, layers, checkpoint)
        timeline.append(probe.snap("loaded"))
        trainer = start_engine(case, built.model, None)
        vocab = int(built.config_dict["vocab_size"])
        batches = iter(loader(case, shape, vocab, False, shape.steps * shape.grad_accum))
        say(f"loaded; training {shape.steps} steps of {shape.grad_accum} micro-batches")
        for step in range(1, shape.steps + 1):
            timeline.append({**probe.snap(f"step {step} start"), "new_kernels": len(hooks.kernels)})
            say(f"step {step} starts")
            for _ in range(shape.grad_accum):
                batch = next(batches).to(device, non_blocking=True)
                loss = trainer.runner(input_ids=batch, labels=batch).loss
                (loss / shape.grad_accum).backward()
                result["losses"].append(float(loss.detach()))
                del loss
            torch.nn.utils.clip_grad_norm_([q for q in built.model.parameters() if q.requires_grad], 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            timeline.append({**probe.snap(f"step {step} end"), "new_kernels": len(hooks.kernels)})
    finally:
        hooks.uninstall()
        try:
            timeline.append(probe.snap("end"))
            result["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        except Exception as exc:  # after a CUDA error: keep what was measured
            result["errors"]["end"] = repr(exc)
        result["errors"].update(probe.errors)
        result["autotunings"] = hooks.tunes
        result["kernels"] = sorted(hooks.kernels, key=_outside, reverse=True)
        result["summary"] = summarize(timeline, hooks.kernels, hooks.tunes, result["device"])


def main(argv=None) -> int:
    args = parse_args(argv)
    cache, files = prepare_cache(args.triton_cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # before triton or fla is imported
    from harness.models.inputs import InputError
    from harness.runtime.stacks import through_trainer
    from harness.spec.cases import load_case
    from harness.spec.dsconfig import deepspeed_config
    from harness.spec.shape import run_shape

    try:
        case = load_case(args.case)
        shape = run_shape(case, "real", args.steps)
    except (InputError, OSError) as exc:
        print(f"triton_cold_memory: {exc}", file=sys.stderr)
        return 2
    if case.launch.ranks != 1 or case.launch.procs_per_card != 1 or through_trainer(case) or deepspeed_config(
            case, 1, shape.grad_accum, shape.hidden_size, False, shape.ds_size_scale) is not None:
        print(f"triton_cold_memory: {args.case}: give a case of one process on one card, trained by the harness's own "
              f"loop (stack: plain or peft) without DeepSpeed (this one has launch.ranks {case.launch.ranks}, "
              f"launch.procs_per_card {case.launch.procs_per_card}, stack {case.stack.value})", file=sys.stderr)
        return 2
    os.environ.update(case.launch.env)  # as the launcher does: PYTORCH_CUDA_ALLOC_CONF before CUDA starts
    if case.method.kind != "qlora":
        sys.modules.setdefault("bitsandbytes", None)  # as the worker does: never imported unless quantizing
    import torch

    if not torch.cuda.is_available() or torch.version.hip:
        print("triton_cold_memory: needs an NVIDIA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
        return 2
    env_keys = ("TRITON_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_MODULE_LOADING", "TRITON_CACHE_AUTOTUNING",
                "FLA_CACHE_RESULTS", "FLA_CACHE_MODE")
    result = {"case": case.id, "case_file": args.case, "steps": shape.steps, "seq_len": shape.seq_len,
              "micro_batch": shape.micro_batch, "triton_cache": str(cache), "cache_files_at_start": files,
              "cache": "cold" if files == 0 else "warm", "env": {k: os.environ.get(k) for k in env_keys},
              "timeline": [], "losses": [], "errors": {}}
    code = 0

    def stopped(signum, frame):  # `timeout` sends SIGTERM: stop as an exception, so the JSON is still written
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stopped)
    try:
        measure(case, shape, result)
    except BaseException as exc:  # the JSON still says what was measured up to the failure
        result["error"] = "".join(traceback.format_exception(exc))[-4000:]
        code = 1
    finally:
        result["cache_files_at_end"] = prepare_cache(str(cache))[1]
        write_json(Path(args.out), result)
    s = result.get("summary") or {}
    print(f"{result['cache']} cache {cache}: outside-allocator growth in step 1 {s.get('outside_growth_first_step')} "
          f"B, {s.get('new_kernels')} new kernels, stack limit {s.get('stack_limit')}; wrote {args.out}"
          + ("" if args.triton_cache else f"; run again with --triton-cache {cache} for a warm cache"))
    return code


if __name__ == "__main__":
    sys.exit(main())
