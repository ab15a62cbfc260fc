"""Fake-tensor tracing of one training micro-step: activations, logits and the transient peak.

The real model code (transformers / fla model classes, peft's LoRA layers, Hugging Face
checkpointing) runs on fake tensors: the model is built on `meta` at full width with 1 and 2
layers, moved to fake `cpu` storage inside `FakeTensorMode`, and one forward + backward runs under
`harness.measure.trackers.LiveTensorTracker`, which counts the bytes of live storages. Parameters (and, for
accumulation, the gradients of earlier micro-steps) are registered before the step, so the traced
figures are what the step adds on top of the model's states. Depth is extrapolated affinely:
``x(L) = x(1) + (x(2) - x(1)) * (L - 1)``.

What the stack changes, and how it is reproduced here (see harness/runtime/build.py):
* QLoRA: every `nn.Linear` but the output head stands for a bitsandbytes `Linear4bit`. Its matmul
  (`_Fake4bitMatmul`) keeps what bitsandbytes' `MatMul4Bit` keeps: no input is saved, the weight is
  dequantized into a transient in forward and again in backward; inputs are cast to the compute
  dtype and outputs back to the input dtype, as `Linear4bit.forward` does.
* peft stack: `prepare_model_for_kbit_training` makes every non-4-bit parameter fp32, so the residual
  stream runs in fp32; reentrant checkpointing with input grads enabled.
* LLaMA-Factory: parameters stay bf16; reentrant checkpointing.
* LoRA adapters through peft itself (fp32 adapters, `autocast_adapter_dtype`, so each adapter saves
  an fp32 copy of its input); under DeepSpeed the engine casts the whole model to the half dtype,
  adapters included, except for a ZeRO-Init model (ZeRO-3, init_order deepspeed_first), which it
  leaves as built (`zero_init`). Guide 000's measurements agree: without checkpointing, 0.52 GiB
  per layer of activations at 1024 tokens (results/runs/2026-11-26-h200x2-000-checkpointing-
  experiment.json, -nogc), of which 0.22 GiB are those fp32 input copies.
* Checkpointing reentrant or not as the case's stack sets it (`reentrant_checkpointing`, the
  rule of harness.runtime.build; `train.checkpointing_reentrant` overrides it).
* Training dropout (0 < p < 1) runs as CUDA's fused kernel: `native_dropout`, a boolean mask allocated
  before the output and kept for backward (`_cuda_dropout`), not the CPU path's noise tensor.
* ZeRO-3: DeepSpeed's `LinearFunctionForZeroStage3` stands in for `torch.nn.functional.linear`
  (`_Zero3Linear`): every linear layer whose inputs need a gradient keeps its input, frozen ones too.
* DeepSpeed moves each gradient into its buckets as soon as it is produced: gradients are dropped by
  a post-accumulate hook (the buckets are closed-form terms in `harness.predict.states`). Without
  DeepSpeed, gradients stay; with accumulation the previous micro-step's gradients exist already.
* Attention: the kernel the case names (`train.attn_implementation`), else the installed
  transformers' default for the model. Where that transformers refuses the case's kernel for the
  architecture (5.24: SDPA for Gemma-2), it is set on the built model's config and the attention
  dispatches through it anyway (a prediction note says so); flash_attention_2 runs as a stand-in that
  keeps what flash-attn's kernels keep (`harness.predict.trace.fake._FakeFlashAttention`).
* GLA (flash-linear-attention): fla's Triton kernels have no CPU or fake implementation; the CPU
  reference path (`harness.models.fla_cpu`) stands in, with fused-kernel emulations that save what the
  Triton kernels save (`_fla_fake_kernels`).

Each trace also logs the step's allocations and frees in order, tagged with phase and decoder layer,
and the parameters in load order (`TraceResult.events`, `.layout`): the input from which
`harness.predict.allocator.stream` builds the run's allocation stream for the allocator model.

Nothing here reads measurements. The model code runs in `harness.predict.trace.fake` (torch, transformers,
peft); this module holds the spec, the results and their caches (in-process, and on disk keyed by
the spec, this code and the library versions), and the cache of the allocator model's result over
the built stream (`simulated_run`), so a cached prediction imports none of them and replays nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata as md
import json
import os
from pathlib import Path

from harness.predict.allocator.allocator import AllocatorConf
from harness.predict.allocator.stream import Simulated, simulate_run
from harness.predict.step import ParamInfo, TraceResult, TraceSpec, extrapolate, reentrant_checkpointing, zero_init
from harness.spec.files import write_atomic

__all__ = ["ParamInfo", "TraceResult", "TraceSpec", "extrapolate", "keep_pair", "reentrant_checkpointing",
           "simulated_run", "trace_pair", "zero_init"]


# --- the on-disk cache ------------------------------------------------------------------------------
# A trace is a pure function of its spec, of the code here and in harness.predict.trace.fake, and of the
# library versions that run the model code; the cache key holds all of them. Set
# HARNESS_PREDICT_CACHE to a folder to move it, or to "off" to disable it.

# harness/predict/: the modules whose code a cached result is keyed by are named by their path below it
PREDICT = Path(__file__).resolve().parents[1]
_LIBS = ("torch", "transformers", "peft", "flash-linear-attention", "fla-core")


def _cache_dir() -> Path | None:
    value = os.environ.get("HARNESS_PREDICT_CACHE", "")
    if value.lower() in ("off", "0", "no", "false"):
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "oom-harness" / "predict-trace"


@functools.lru_cache(maxsize=1)
def _code_key() -> str:

    h = hashlib.sha256()
    for name in ("step.py", "trace/trace.py", "trace/fake.py", "zero3/hook_calls.py", "constants.py"):
        h.update((PREDICT / name).read_bytes())
    for lib in _LIBS:
        try:
            h.update(f"{lib}={md.version(lib)};".encode())
        except md.PackageNotFoundError:
            h.update(f"{lib}=none;".encode())
    return h.hexdigest()


def _key(spec: TraceSpec) -> str:
    return hashlib.sha256((_code_key()
                           + json.dumps(dataclasses.asdict(spec), sort_keys=True)).encode()).hexdigest()[:32]


def _from_dict(d: dict) -> TraceResult:
    d = dict(d)
    d["params"] = ParamInfo(**d["params"])
    return TraceResult(**d)


def _load(spec: TraceSpec) -> tuple[TraceResult, TraceResult] | None:
    folder = _cache_dir()
    if folder is None:
        return None
    path = folder / f"{_key(spec)}.json"
    try:
        a, b = json.loads(path.read_text())
        return _from_dict(a), _from_dict(b)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _store(spec: TraceSpec, pair) -> None:
    folder = _cache_dir()
    if folder is None:
        return
    try:
        write_atomic(folder / f"{_key(spec)}.json", json.dumps([dataclasses.asdict(r) for r in pair]))
    except OSError:  # a read-only home: the in-process cache still holds
        pass


_SENT: dict = {}  # TraceSpec -> a pair traced in another process, until trace_pair takes it


def keep_pair(spec: TraceSpec, pair: tuple[TraceResult, TraceResult]) -> None:
    """A pair traced in another process (harness.predict.predictor's forked trace), for `trace_pair` to
    return the first time it is asked for `spec`."""
    _SENT[spec] = pair


@functools.lru_cache(maxsize=64)
def trace_pair(spec: TraceSpec) -> tuple[TraceResult, TraceResult]:
    """Traces at 1 and 2 layers: from the in-process cache, else one another process traced (`keep_pair`),
    else the on-disk cache, else traced (harness.predict.trace.fake, which imports torch, transformers and peft)."""
    sent = _SENT.pop(spec, None)
    if sent is not None:
        return sent
    cached = _load(spec)
    if cached is not None:
        for r in cached:
            r.cached = True
        return cached
    # heavy: torch and transformers, imported only where a step is traced
    from harness.predict.trace.fake import trace

    pair = (trace(spec, 1), trace(spec, 2))
    _store(spec, pair)
    return pair


@functools.lru_cache(maxsize=8)
def _files_key(names: tuple[str, ...]) -> str:
    """A digest of these modules of harness.predict (paths below its folder), in order."""
    return hashlib.sha256(b"".join((PREDICT / name).read_bytes() for name in names)).hexdigest()


def cached_on_disk(prefix: str, spec: TraceSpec, shape, code: tuple[str, ...], make, load):
    """`make()`, a dataclass computed from the traces of `spec` and the dataclass `shape`, kept on disk
    beside the traces under `prefix`, keyed by both and by the modules `code` of harness.predict that
    compute it; `load(dict)` reads it back. What cannot be read is made again; what cannot be written
    is not kept."""
    folder = _cache_dir()
    key = hashlib.sha256((_key(spec) + _files_key(code)
                          + json.dumps(dataclasses.asdict(shape), sort_keys=True)).encode()).hexdigest()[:32]
    path = folder / f"{prefix}-{key}.json" if folder is not None else None
    if path is not None:
        try:
            return load(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
    result = make()
    if path is not None:
        try:
            write_atomic(path, json.dumps(dataclasses.asdict(result)))
        except OSError:
            pass
    return result


@functools.lru_cache(maxsize=64)
def simulated_run(spec: TraceSpec, shape):
    """The allocator model's figures over the run `shape` (a `harness.predict.allocator.stream.RunShape`) builds
    from the traces of `spec`: cached in-process and on disk beside the traces (keyed by both, and by
    the code of the stream and the allocator model), so a warm prediction replays nothing."""

    def make():
        conf = AllocatorConf.parse(shape.alloc_conf, "launch.env.PYTORCH_CUDA_ALLOC_CONF")
        return simulate_run(*trace_pair(spec), shape, conf)

    return cached_on_disk("sim", spec, shape, ("allocator/stream.py", "allocator/allocator.py", "constants.py"), make,
                          lambda d: Simulated(**d))
