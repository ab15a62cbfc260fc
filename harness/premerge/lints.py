"""Lints: mistakes in a training config that the guides (or the harness's measurements) paid for, each with
its reason and its fix.

    lint(imported, prediction=None) -> list[Lint]

Each rule reads an `ImportedConfig` (and, where it needs figures, the predictor's `Prediction`) and
returns the findings. Severity `error`: the job fails or runs out of memory as configured; `warning`:
it runs, but not as the config suggests, or it holds memory it need not (the prediction counts it). The
pre-merge check fails on errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

from harness.predict.margin import Margin, fit_verdict
from harness.premerge.importers import ConfigFormat, ImportedConfig
from harness.spec.units import fmt_gib


class PredictionLike(Protocol):
    device: int
    host_ram: int
    margin: Margin


@dataclass(frozen=True)
class Lint:
    code: str  # a short kebab-case id
    severity: Literal["error", "warning"]
    message: str  # what is wrong in this config
    reason: str  # why it matters (from the guides and the libraries' behaviour)
    fix: str  # what to change
    file: str | None = None
    key: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def one_line(self) -> str:
        where = ":".join(p for p in (self.file and Path(self.file).name, self.key) if p)
        return f"{self.severity} [{self.code}] {where + ': ' if where else ''}{self.message}"


Rule = Callable[[ImportedConfig, "PredictionLike | None"], list[Lint]]


def _training_file(c: ImportedConfig) -> str:
    return str(c.training.path)


def zero3_model_before_deepspeed(c: ImportedConfig, p) -> list[Lint]:
    if c.zero_stage != 3 or c.init_order.order != "model_first":
        return []
    return [Lint(
        "zero3-model-before-deepspeed", "error",
        f"the model is built before DeepSpeed is configured ({c.init_order.evidence})",
        "ZeRO-3 partitions parameters as they are created only inside deepspeed.zero.Init, which transformers "
        "enters when a HfDeepSpeedConfig (or TrainingArguments with deepspeed=...) exists when from_pretrained "
        "runs. A model built first is materialised whole on every rank before anything is sharded (guide 002: "
        "'the model immediately takes all the memory').",
        "create TrainingArguments(deepspeed=...) or HfDeepSpeedConfig(ds_config) first and keep a reference to "
        "it, then call from_pretrained",
        str(c.init_order.path or c.training.path),
        "launch.init_order" if c.init_order.path == c.training.path else None,
    )]


def deepspeed_plain_python(c: ImportedConfig, p) -> list[Lint]:
    if c.deepspeed is None or c.deepspeed.stage == 0 or c.launcher != "python" or c.gpus < 2 or c.procs_per_gpu > 1:
        return []
    return [Lint(
        "deepspeed-plain-python", "error",
        f"a ZeRO-{c.deepspeed.stage} job for {c.gpus} GPUs is started with plain python: one process on one GPU",
        f"plain `python train.py` starts one rank, so ZeRO-{c.deepspeed.stage} shards over a world of 1 (nothing is "
        "partitioned) and the other GPUs stay idle; guide 002: 'the wrong way (leads to OOM)'.",
        f"start it with `deepspeed --num_gpus={c.gpus} train.py ...`, `torchrun --nproc_per_node={c.gpus} ...` or "
        f"`accelerate launch --num_processes={c.gpus} ...`",
        _training_file(c), "--launcher" if c.launcher_from == "--launcher" else "launch.launcher",
    )]


def _transformers_major() -> int:
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:  # not installed: the project pins transformers 5
        return 5


def eval_strategy_renamed(c: ImportedConfig, p) -> list[Lint]:
    t = c.training
    if t.evaluation_strategy is None:
        return []
    reason = ("transformers renamed TrainingArguments.evaluation_strategy to eval_strategy in 4.41 and removed "
              "the old name in 5.0; guide 001 sets both 'for compatibility'.")
    if t.eval_strategy is not None and t.eval_strategy != t.evaluation_strategy:
        message = (f"evaluation_strategy '{t.evaluation_strategy}' contradicts eval_strategy '{t.eval_strategy}'")
        severity = "error"
    elif _transformers_major() >= 5:
        message = "evaluation_strategy is not a TrainingArguments field in transformers 5: the job stops at start-up"
        severity = "error"
    else:
        message = "evaluation_strategy is deprecated"
        severity = "warning"
    return [Lint("eval-strategy-renamed", severity, message, reason,
                 f"write eval_strategy: {t.eval_strategy or t.evaluation_strategy} and delete evaluation_strategy",
                 _training_file(c), "evaluation_strategy")]


def fp16_and_bf16(c: ImportedConfig, p) -> list[Lint]:
    t, ds = c.training, c.deepspeed
    found: list[tuple[str, str, str]] = []  # (file, key, message)
    if t.fp16 and t.bf16:
        found.append((str(t.path), "fp16", "fp16 and bf16 are both true"))
    if ds is not None:
        prefix = ds.key_prefix
        if ds.fp16 and ds.bf16:
            found.append((str(ds.path), f"{prefix}fp16.enabled", "the DeepSpeed config enables both fp16 and bf16"))
        elif ds.fp16 and t.bf16 and not t.fp16:
            found.append((str(ds.path), f"{prefix}fp16.enabled",
                          "the DeepSpeed config enables fp16 while the training config asks for bf16"))
        elif ds.bf16 and t.fp16 and not t.bf16:
            found.append((str(ds.path), f"{prefix}bf16.enabled",
                          "the DeepSpeed config enables bf16 while the training config asks for fp16"))
    return [Lint("fp16-and-bf16", "error", message,
                 "one mixed-precision mode per job: transformers refuses fp16 and bf16 together ('At most one of "
                 "fp16 and bf16 can be True'), DeepSpeed refuses both enabled, and the HF integration stops when the "
                 "DeepSpeed values contradict TrainingArguments.",
                 "keep one: bf16 where the card supports it (DCU K100, A100, H100), else fp16; leave the DeepSpeed "
                 "config's fp16/bf16 'enabled' at \"auto\"",
                 file, key) for file, key, message in found]


def checkpointing_no_effect(c: ImportedConfig, p) -> list[Lint]:
    ds = c.deepspeed
    if ds is None or not ds.activation_checkpointing:
        return []
    keys = ", ".join(ds.activation_checkpointing)
    if c.training.gradient_checkpointing:
        message = (f"the DeepSpeed activation_checkpointing block ({keys}) does nothing here: checkpointing comes "
                   "from gradient_checkpointing, and its checkpoints stay on the GPU")
    else:
        message = (f"activation checkpointing is asked for in the DeepSpeed config ({keys}) but gradient_checkpointing "
                   "is off: no activation is recomputed, and the prediction counts them all")
    return [Lint(
        "checkpointing-no-effect", "warning", message,
        "DeepSpeed's activation_checkpointing settings (partition_activations, cpu_checkpointing) only apply to "
        "models that call deepspeed.checkpointing.checkpoint; Hugging Face models checkpoint through "
        "torch.utils.checkpoint when gradient_checkpointing is on. Guide 002's 'CPU checkpointing' is this block.",
        "set gradient_checkpointing: true (TrainingArguments; LLaMA-Factory has it on unless "
        "disable_gradient_checkpointing), and delete the activation_checkpointing block",
        str(ds.path), f"{ds.key_prefix}activation_checkpointing",
    )]


def batch_size_mismatch(c: ImportedConfig, p) -> list[Lint]:
    ds, t = c.deepspeed, c.training
    if ds is None:
        return []
    out: list[Lint] = []
    reason = ("the Hugging Face DeepSpeed integration fills \"auto\" from TrainingArguments and stops at start-up "
              "when a number in the DeepSpeed config disagrees; DeepSpeed itself requires train_batch_size = "
              "micro batch x accumulation x data-parallel ranks.")
    checks = [("train_micro_batch_size_per_gpu", ds.micro_batch, t.micro_batch, "per_device_train_batch_size"),
              ("gradient_accumulation_steps", ds.grad_accum, t.grad_accum, "gradient_accumulation_steps")]
    for key, written, wanted, train_key in checks:
        if written is not None and written != wanted:
            out.append(Lint("batch-size-mismatch", "error",
                            f"{key} is {written} but the training config's {train_key} is {wanted}", reason,
                            f"set {key} to \"auto\" (or to {wanted})", str(ds.path), ds.key_prefix + key))
    if ds.train_batch_size is not None:
        expected = t.micro_batch * t.grad_accum * c.world_size
        if ds.train_batch_size != expected:
            out.append(Lint(
                "batch-size-mismatch", "error",
                f"train_batch_size is {ds.train_batch_size} but {t.micro_batch} (micro batch) x {t.grad_accum} "
                f"(accumulation) x {c.world_size} (ranks) = {expected}", reason,
                f"set train_batch_size to \"auto\" (or to {expected})", str(ds.path),
                ds.key_prefix + "train_batch_size"))
    return out


def offload_pinned_host_ram(c: ImportedConfig, p) -> list[Lint]:
    ds = c.deepspeed
    if ds is None or not ds.offload_pin_memory or c.host_ram is None or p is None:
        return []
    from harness.judge.host_ram import HOST_RAM_FRACTION  # the judge's verdict modules: only where a host is given

    limit = c.host_ram * HOST_RAM_FRACTION
    need = c.node_host_ram(p.host_ram)
    if need <= limit:
        return []
    return [Lint(
        "offload-pinned-host-ram", "error",
        f"offload with pin_memory needs about {fmt_gib(need)} of host RAM (predicted, {c.node_processes} processes "
        f"on the node); "
        f"the host has {fmt_gib(c.host_ram)} ({int(HOST_RAM_FRACTION * 100)}% = {fmt_gib(limit)} usable)",
        "pinned (page-locked) offload buffers cannot be swapped or reclaimed: past the host's free memory the "
        "allocation fails or the kernel's OOM killer ends a rank, and what is left starves the dataloader "
        "workers. Guide 000's fix turns pin_memory off.",
        "set \"pin_memory\": false in offload_optimizer and offload_param (slower host-device copies), run fewer "
        "ranks per node, or use a host with more RAM",
        str(ds.path), f"{ds.key_prefix}zero_optimization.offload_optimizer.pin_memory"
        if ds.offload_optimizer != "none" else f"{ds.key_prefix}zero_optimization.offload_param.pin_memory",
    )]


def qlora_zero3(c: ImportedConfig, p) -> list[Lint]:
    if c.training.quantization_bits != 4 or c.zero_stage != 3:
        return []
    return [Lint(
        "qlora-zero3", "error",
        "4-bit quantized weights with ZeRO-3",
        "bitsandbytes 4-bit weights are packed uint8 tensors with quantization state: ZeRO-3 can only partition "
        "them where the stack stores them in the compute dtype (bnb_4bit_quant_storage) and gathers them per "
        "layer, which not every stack and DeepSpeed version does, and the harness cannot predict; guide 000 pairs "
        "4-bit weights with ZeRO-2 ('better quantization compatibility'). 4-bit weights are small enough to "
        "replicate: a 32B model holds about 17 GiB.",
        "use a ZeRO-2 DeepSpeed config with quantization (e.g. LLaMA-Factory's ds_z2_config.json), or drop the "
        "quantization and keep ZeRO-3 offload",
        str(c.deepspeed.path) if c.deepspeed else None,
        f"{c.deepspeed.key_prefix}zero_optimization.stage" if c.deepspeed else None,
    )]


def procs_per_card_oversubscribed(c: ImportedConfig, p) -> list[Lint]:
    if c.procs_per_gpu < 2 or p is None:
        return []
    fit = fit_verdict(p.device, p.margin, gpu_memory=c.gpu_memory, headroom=c.headroom, procs_per_gpu=c.procs_per_gpu,
                      missing=p.missing)
    if fit.fits or not fit.decided:
        return []
    return [Lint(
        "procs-per-card-oversubscribed", "error",
        f"{c.procs_per_gpu} processes per card x {fmt_gib(p.device)} predicted device peak: {fit.summary()} "
        f"(the card's {fmt_gib(c.gpu_memory)} x {c.headroom:g})",
        "processes sharing a card each keep their own CUDA/HIP context, caching allocator and peak; the card must "
        "hold the sum of their peaks, and whichever asks last runs out of memory (guide 004: two processes per "
        "23.52 GiB card).",
        "run fewer processes per card (guide 004 plan C), or lower each one's peak: batch size, gradient "
        "checkpointing, fewer dataloader workers; expandable_segments only helps fragmentation",
        _training_file(c), "launch.procs_per_card" if c.training.format == ConfigFormat.case else "--procs-per-gpu",
    )]


_REENTRANT_FIX = {
    ConfigFormat.llamafactory: ("use_reentrant_gc", "set use_reentrant_gc: false"),
    ConfigFormat.training_args: ("gradient_checkpointing_kwargs",
                                 'set gradient_checkpointing_kwargs: {"use_reentrant": false}'),
    ConfigFormat.case: ("train.checkpointing_reentrant", "set train.checkpointing_reentrant: false"),
}


def zero3_reentrant_checkpointing(c: ImportedConfig, p) -> list[Lint]:
    t = c.training
    if (c.zero_stage != 3 or t.method not in ("lora", "qlora") or not t.gradient_checkpointing
            or not t.checkpointing_reentrant):
        return []
    key, fix = _REENTRANT_FIX[t.format]
    why = f"{t.checkpointing_reentrant_key}: true" if t.checkpointing_reentrant_key else (
        "use_reentrant_gc: true, LLaMA-Factory's default" if t.format == ConfigFormat.llamafactory
        else "the stack's default")
    layers = c.arch.config.get("num_hidden_layers")
    depth = f"all {layers} layers" if layers else "every layer"
    return [Lint(
        "zero3-reentrant-checkpointing", "warning",
        f"ZeRO-3 with LoRA and reentrant gradient checkpointing ({why}): the gathered weights of {depth} "
        "stay on the GPU until backward",
        "with reentrant checkpointing (torch.utils.checkpoint use_reentrant=True, LLaMA-Factory's default) and "
        "frozen base weights, ZeRO-3 keeps every layer's gathered (unpartitioned) weights on the GPU from its "
        "forward until backward, so the step peak grows with depth up to the whole model's weights. Measured "
        "on two H200s (DeepSpeed 0.19.8, transformers 5.17, peft 0.21): 0.93 GiB per layer on "
        "DeepSeek-R1-Distill-Qwen-32B, about 60 GiB at its 64 layers; the full-depth run of guide 000's config "
        "runs out of memory on a 64 GiB card. With non-reentrant checkpointing the peak stopped growing with "
        "depth (10.22 GiB at 4 layers, 10.24 GiB at 8, 2 ranks).",
        f"{fix} (non-reentrant checkpointing: the measured peak then no longer grows with depth)",
        _training_file(c), t.checkpointing_reentrant_key or key,
    )]


def boolean_written_as_text(c: ImportedConfig, p) -> list[Lint]:
    """A boolean written as text that its stack reads otherwise than it looks (importers.reading)."""
    return [Lint(
        "boolean-written-as-text", "warning",
        f"{r.written!r} is text, not a boolean: {r.stack} reads it as {str(r.read_as).lower()}",
        "the HF Trainer's argument dataclasses (TrainingArguments, LLaMA-Factory's, a script's through "
        "HfArgumentParser.parse_dict or parse_json_file) keep a value as written and test it for truth, and "
        "any non-empty text is true: \"false\" turns the setting on. The check reads it as the job will run.",
        f"write true or false without quotes; as written, the job runs with {str(r.read_as).lower()}",
        str(r.path), r.key,
    ) for r in c.read_as]


RULES: tuple[Rule, ...] = (
    boolean_written_as_text,
    zero3_model_before_deepspeed,
    deepspeed_plain_python,
    eval_strategy_renamed,
    fp16_and_bf16,
    checkpointing_no_effect,
    batch_size_mismatch,
    offload_pinned_host_ram,
    qlora_zero3,
    procs_per_card_oversubscribed,
    zero3_reentrant_checkpointing,
)


def lint(imported: ImportedConfig, prediction: PredictionLike | None = None) -> list[Lint]:
    """Every finding for one imported config, errors first."""
    found = [finding for rule in RULES for finding in rule(imported, prediction)]
    return sorted(found, key=lambda f: (f.severity != "error", f.code))
