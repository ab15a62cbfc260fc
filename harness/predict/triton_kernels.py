"""The per-thread local memory of every Triton kernel (and autotune candidate) a training step launches.

On a cold Triton cache the autotuner launches every candidate config of each autotuned kernel, spilling
ones included; the CUDA driver sizes the context's local memory for the largest per-thread need it has
launched, times every thread the card keeps resident, and keeps it (`harness.predict.local_memory`). This
module finds that need without a GPU:

1. It makes Triton (and flash-linear-attention, whose candidate lists are chosen at import from the
   device) believe they run on the target card: a stand-in Triton driver reporting its compute capability,
   shared memory and SM count, and torch.cuda's name and capability queries answering as it does.
2. It builds the case's model at full width with one layer (every layer launches the same kernels) and
   runs one training step (forward, loss, backward) on CPU tensors with every Triton launch intercepted:
   a plain kernel's arguments are bound and specialized by Triton's own binder; an autotuned kernel's every
   config the autotuner would benchmark (after its own pruning) is bound the same way. Nothing runs, so
   tensors hold garbage; shapes, dtypes, strides and every constexpr are the ones the GPU run sees.
3. Each distinct (kernel, specialization, config) is compiled for the target with the imported Triton (its
   PTX and its bundled ptxas) and the bundled cuobjdump reads its REG / STACK / SHARED / LOCAL.

It changes Triton's active driver and torch.cuda's queries for the whole process, so the predictor runs it
in a child process (`python -m harness.predict.triton_kernels`), which prints a `Survey` as JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from harness.spec.cases import load_case
from harness.spec.schema import Case

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")
_USAGE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")
_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")


@dataclass(frozen=True)
class Target:
    """The card the kernels are compiled for, as Triton and fla query it."""

    sm: int  # compute capability x 10 (90: Hopper)
    sms: int  # streaming multiprocessors
    shared_per_block: int  # bytes, opt-in maximum
    name: str  # what torch.cuda.get_device_name answers (fla picks its backend from it)


# --- reading the compiler's output ----------------------------------------------------------------


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


def config_label(constexprs: dict, tuned: dict, num_warps: int, num_stages: int) -> str:
    """A short config text: the autotuned constexprs (else the block sizes) with warps and stages."""
    tuned = {k: v for k, v in tuned.items() if k not in LAUNCH_OPTIONS}
    shown = tuned or {k: v for k, v in constexprs.items() if k.startswith("B")}
    parts = [f"{k}={v}" for k, v in sorted(shown.items())]
    return " ".join([*parts, f"w{num_warps}", f"s{num_stages}"])


# --- a stand-in card for Triton and fla ----------------------------------------------------------


def pretend(target: Target):
    """Make Triton's active driver and torch.cuda's queries answer as `target` (call before fla is
    imported: its candidate lists are chosen at import). Returns a function that puts them back."""
    # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": target.shared_per_block, "multiprocessor_count": target.sms,
                    "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                    "mem_bus_width": 5120}

    class _Card:
        utils = _Utils()

        def get_current_target(self):
            return GPUTarget("cuda", target.sm, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    saved_driver = driver._active
    saved_cuda = {name: getattr(torch.cuda, name)
                  for name in ("get_device_name", "get_device_capability", "device_count")}
    driver.set_active(_Card())
    torch.cuda.get_device_name = lambda device=None: target.name
    torch.cuda.get_device_capability = lambda device=None: divmod(target.sm, 10)
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
    """Replaces JITFunction.run and every Autotuner.run with recorders that bind but never launch.

    Triton has no public "what would this call compile" API; its binder and `_pack_args` are what
    `JITFunction.run` itself calls, so the specializations are Triton's own, not re-derived."""

    def __init__(self):
        self.launches: dict[str, Launch] = {}
        self._tuning: dict | None = None
        self._saved: list = []

    def _record_jit(self, fn, args, kwargs):
        # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
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
                        attrs=dict(attrs.items()), options=dict(options.__dict__),
                        tuned=tuned, candidates=self._tuning["candidates"] if self._tuning else 1, fn=fn,
                        compile_args=(signature, constexprs, attrs, options))
        self.launches.setdefault(launch.key(), launch)

    def install(self) -> None:
        # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
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
    # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
    from fla.modules.fused_cross_entropy import ops

    def forward(self, input, target):
        loss, _ = ops.cross_entropy_loss(
            logits=input, target=target, label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
            lse_square_scale=self.lse_square_scale, logit_softcapping=self.logit_softcapping,
            ignore_index=self.ignore_index, inplace_backward=self.inplace_backward, process_group=self.process_group)
        return loss.sum() / (target != self.ignore_index).sum() if self.reduction == "mean" else loss.sum()

    ops.FusedCrossEntropyLoss.forward = forward


def step_launches(case, batch: int, layers: int = 1) -> tuple[list[Launch], dict]:
    """Every Triton launch of one training step of the case's model (full width, `layers` layers, LoRA as
    the case sets it) on CPU tensors, intercepted; with what was built. Call under `pretend`."""
    # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
    import torch
    from transformers import AutoModelForCausalLM

    from harness.models.registry import hf_config  # with the model libraries above
    from harness.runtime.build import lora_model, model_config_dict, set_checkpointing

    allow_cpu_cross_entropy()
    seq_len = case.train.seq_len
    config = model_config_dict(case, "real", seq_len, layers=layers)
    interceptor = Interceptor()
    interceptor.install()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.bfloat16)
        if case.method.kind in ("lora", "qlora"):
            model = lora_model(case, model)
        model.train()
        set_checkpointing(model, bool(case.train.gradient_checkpointing))
        ids = torch.randint(0, config["vocab_size"], (batch, seq_len))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        interceptor.remove()
    step = {"case": case.id, "model": case.model, "seq_len": seq_len, "batch": batch, "layers": layers}
    return list(interceptor.launches.values()), step


# --- compiling ----------------------------------------------------------------------------------


def cuobjdump() -> str:
    # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_usage(launch: Launch, folder: str, sm: int) -> dict[str, int]:
    """Compile one launch for the target and read its resource usage from the cubin."""
    # in the survey's process only: the predictor imports this module for `Survey` without torch or Triton
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = launch.compile_args
    src = ASTSource(launch.fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options=options.__dict__)
    path = os.path.join(folder, f"{launch.kernel}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    text = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                          check=True).stdout
    usage = parse_resource_usage(text)
    if not usage:
        raise RuntimeError(f"cuobjdump printed no function for {launch.kernel}:\n{text}")
    return next(iter(usage.values()))


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def compile_all(launches: list[Launch], sm: int, progress=None) -> list[dict]:
    """One row per launch: its config and REG / STACK / LOCAL / SHARED, or the compiler's error."""
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
                usage = compile_usage(launch, folder, sm)
            except Exception as exc:  # a candidate the compiler rejects is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            else:
                row.update(reg=usage.get("REG"), stack=usage.get("STACK"), local=usage.get("LOCAL"),
                           shared=usage.get("SHARED"), bytes_per_thread=local_bytes_per_thread(usage))
            row["compile_s"] = round(time.time() - t0, 2)
            if progress is not None:
                result = row.get("error") or f"REG {row['reg']} STACK {row['stack']} LOCAL {row['local']}"
                progress(f"[{i}/{len(launches)}] {launch.kernel} {label}: {result}")
            rows.append(row)
    return rows


# --- the survey ---------------------------------------------------------------------------------


@dataclass
class Survey:
    """What one step's kernels need per thread, compiled for one target with one Triton release."""

    triton: str
    fla: str | None
    sm: int
    step: dict
    max_bytes_per_thread: int  # the most local memory a launched candidate needs per thread
    kernel: str | None  # the kernel and config of that candidate
    config: str | None
    kernels: int
    specializations: int
    failed: int  # candidates the compiler rejected (Triton skips them on the card too)
    per_kernel: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[dict], step: dict, sm: int) -> Survey:
        # in the survey's process only: the predictor imports this module for `Survey` without Triton
        import triton

        fla = installed_version("fla-core")
        ok = [r for r in rows if "error" not in r]
        top = max(ok, key=lambda r: r["bytes_per_thread"], default=None)
        return cls(triton=triton.__version__, fla=fla, sm=sm, step=step,
                   max_bytes_per_thread=top["bytes_per_thread"] if top else 0,
                   kernel=top["kernel"] if top else None, config=top["config"] if top else None,
                   kernels=len({r["kernel"] for r in rows}), specializations=len(rows),
                   failed=len(rows) - len(ok), per_kernel=per_kernel(rows))


def installed_version(package: str) -> str | None:
    """The installed release of `package`, or None."""
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def per_kernel(rows: list[dict]) -> dict[str, dict]:
    """Each kernel's fewest and most bytes per thread over its compiled specializations, largest first. On
    a cold cache the autotuner runs every candidate, so the driver keeps the most; on a warm one, only the
    winner's."""
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
            k.update(max_bytes_per_thread=r["bytes_per_thread"], max_config=r["config"], max_reg=r["reg"])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["max_bytes_per_thread"]))


def survey(case, batch: int, target: Target, progress=None) -> tuple[Survey, list[dict]]:
    """Intercept the case's step as run on `target`, compile every launch, and sum up. Changes Triton's
    driver for the rest of the process (see the module's docstring)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the older releases' default
    pretend(target)
    launches, step = step_launches(case, batch)
    if progress is not None:
        progress(f"{len(launches)} Triton kernel specializations to compile for sm_{target.sm}")
    rows = compile_all(launches, target.sm, progress)
    return Survey.of(rows, step, target.sm), rows


def main(argv=None) -> int:
    """`python -m harness.predict.triton_kernels CASE.yaml --batch N --sm 90 ...`: print the Survey as JSON."""
    parser = argparse.ArgumentParser(description="Compile a case's Triton kernels for a card and read their "
                                                 "per-thread local memory")
    parser.add_argument("case", help="a case file: YAML, or the JSON of a validated case")
    parser.add_argument("--batch", type=int, required=True, help="sequences per micro-step")
    parser.add_argument("--sm", type=int, required=True, help="compute capability x 10 (90 for Hopper)")
    parser.add_argument("--sms", type=int, required=True, help="the card's streaming multiprocessors")
    parser.add_argument("--shared", type=int, required=True, help="shared memory per block, bytes (opt-in)")
    parser.add_argument("--name", required=True, help="the card's name as CUDA reports it")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    if args.case.endswith(".json"):
        with open(args.case, encoding="utf-8") as f:
            case = Case.model_validate_json(f.read())
    else:
        case = load_case(args.case)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    result, _ = survey(case, args.batch, Target(args.sm, args.sms, args.shared, args.name), progress)
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
