"""One traced training micro-step: what of a case changes it (the spec), and what tracing it gives.

Shared by the tracer (`harness.predict.trace.fake`, which runs the model code) and its caches
(`harness.predict.trace.trace`), so neither imports the other's half.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from harness.models.registry import Architecture
from harness.spec.schema import Case, Offload, Precision, Stack


@dataclass(frozen=True)
class TraceSpec:
    """Everything of a case that changes the traced step (hashable, the cache key)."""

    config_json: str  # full-width architecture config
    seq_len: int
    micro_batch: int
    kind: str  # lora, qlora, full
    stack: str
    dtype: str
    lora_r: int | None
    lora_targets: tuple[str, ...] | str | None
    lora_dropout: float
    checkpointing: bool
    reentrant: bool
    deepspeed: bool
    accumulated_grads: bool  # earlier micro-steps' gradients are live (no DeepSpeed, GA > 1)
    engine_casts: bool = False  # the DeepSpeed engine casts the module to the half dtype (not a ZeRO-Init model)
    attn_implementation: str | None = None  # the case's `train.attn_implementation`; None: transformers' default
    # ZeRO-3: DeepSpeed replaces torch.nn.functional.linear with LinearFunctionForZeroStage3 (zero_linear)
    zero3_linear: bool = False
    # ZeRO-3 without overlap_comm, the parameters on the host: the 2-layer trace records where DeepSpeed's
    # hooks fire (`TraceResult.hooks`), which that config's one-pool reserve places the gathers by
    zero3_hook_positions: bool = False
    # LLaMA-Factory's full fine-tune without DeepSpeed: trainable parameters in fp32 (init_adapter's upcast),
    # the step under the HF Trainer's bf16/fp16 autocast (`fp32_trainable_parameters`)
    fp32_trainable: bool = False
    # Liger's fused linear cross-entropy in place of the output head and the loss (`liger_applies`)
    liger: bool = False
    # the forward under the HF Trainer's mixed-precision autocast (`trainer_autocast`)
    autocast: bool = False
    # the training loop keeps the loss alone before backward (the HF Trainer's `compute_loss`): the model's
    # outputs, its logits with them, are freed when the forward returns (`framework_trains`)
    loss_only: bool = False

    @classmethod
    def of(cls, case: Case, arch: Architecture) -> TraceSpec:
        lora = case.method.lora
        targets = None
        if lora is not None:
            targets = "all" if lora.targets == "all" else tuple(lora.targets)
        gc = case.train.gradient_checkpointing
        reentrant = gc and reentrant_checkpointing(case)
        ds = case.deepspeed
        return cls(
            config_json=json.dumps(arch.config, sort_keys=True),
            seq_len=case.train.seq_len,
            micro_batch=case.train.micro_batch,
            kind=case.method.kind,
            stack=case.stack.value,
            dtype=case.precision.value,
            lora_r=lora.r if lora else None,
            lora_targets=targets,
            lora_dropout=lora.dropout if lora else 0.0,
            checkpointing=gc,
            reentrant=reentrant,
            deepspeed=ds is not None,
            accumulated_grads=ds is None and case.train.grad_accum > 1,
            engine_casts=ds is not None and not zero_init(case),
            attn_implementation=case.train.attn_implementation,
            zero3_linear=ds is not None and ds.stage == 3,
            zero3_hook_positions=(ds is not None and ds.stage == 3 and not ds.overlap_comm
                                  and ds.offload_param != Offload.none),
            fp32_trainable=ds is None and case.method.kind == "full" and fp32_trainable_parameters(case),
            liger=liger_applies(case, arch.model_type),
            autocast=trainer_autocast(case),
            loss_only=framework_trains(case),
        )


def trainer_autocast(case: Case) -> bool:
    """Whether the forward runs under autocast in the half dtype: the HF Trainer's mixed precision (bf16 or
    fp16 in its arguments, through accelerate) wherever no DeepSpeed engine handles precision itself. Under
    it an fp32 LoRA adapter's input, which peft casts to fp32, is cast back to the half dtype for the
    adapter's matmul and kept so. LLaMA-Factory's pure_bf16 trains without it. A 4-bit model on LLaMA-Factory's
    path trains under it too: three such QLoRA configs (docs/stacks.md) reserve what the trace under autocast
    predicts, within 0.3% on two of them. One prepared by peft's `prepare_model_for_kbit_training` (the HF
    Trainer's recipe: its head and norms upcast to fp32) is traced without it: no such run through the
    Trainer has been measured, and under autocast its trace holds about 1.3 GiB more on a 7B model."""
    return (framework_trains(case) and case.deepspeed is None and case.precision != Precision.fp32
            and not case.train.pure_bf16 and not (case.method.kind == "qlora" and case.stack.kbit_prepared))


# The model types LLaMA-Factory applies Liger's kernels to (model/model_utils/liger_kernel.py,
# apply_liger_kernel, 0.9.5), text models only; for any other it warns and trains without them. The HF
# Trainer's use_liger_kernel applies Liger's own table, which holds these too.
LIGER_MODEL_TYPES = frozenset({
    "gemma", "gemma2", "gemma3", "gemma3_text", "glm", "glm4", "granite", "llama", "mistral", "mixtral", "olmo2",
    "phi3", "qwen2", "qwen3", "qwen3_moe", "qwen3_next",
})


def liger_applies(case: Case, model_type: str) -> bool:
    """Whether the case's stack applies Liger's kernels to this model (`train.liger_kernel`)."""
    return case.train.liger_kernel and framework_trains(case) and model_type in LIGER_MODEL_TYPES


def framework_trains(case: Case) -> bool:
    """Whether a framework trains the case (LLaMA-Factory, the HF Trainer: `harness.runtime.stacks`), not the
    harness's own loop (`launch.runtime`, which baselines measured before the frameworks ran keep).

    The Trainer's `training_step` calls `compute_loss` (transformers 5.6 and 5.17, trainer.py), which takes
    the loss out of the model's outputs and returns it alone, and LLaMA-Factory's trainers keep that
    (train/sft/trainer.py, 0.9.5): the outputs, the half-precision logits among them, are freed before
    `accelerator.backward`. The harness's own loop holds them until its backward has returned."""
    return case.stack in (Stack.llamafactory, Stack.hf_trainer) and case.launch.runtime == "framework"


def fused_adamw(case: Case) -> bool:
    """Whether the optimizer steps with torch's fused AdamW (one kernel over every parameter, no temporary
    list): the HF Trainer's default `optim` with torch >= 2.8 (transformers' training_args.py), which
    LLaMA-Factory keeps. The harness's own loop runs torch's AdamW (foreach); a DeepSpeed engine its own."""
    return (framework_trains(case) and case.deepspeed is None
            and (case.train.optim or "adamw_torch_fused") == "adamw_torch_fused")


def fp32_trainable_parameters(case: Case) -> bool:
    """Whether the case's stack holds its trainable parameters in fp32 while the model loads in the half
    dtype. LLaMA-Factory's `init_adapter` (model/adapter.py, 0.9.5) casts every trainable parameter to
    fp32 unless `pure_bf16` (or BAdam), or under ZeRO-3 without quantization; the HF Trainer then trains
    under autocast. A DeepSpeed engine of stage 1 or 2 casts the module back to the half dtype."""
    if (case.stack != Stack.llamafactory or not framework_trains(case) or case.train.pure_bf16
            or case.precision == Precision.fp32):
        return False
    ds = case.deepspeed
    return not (case.method.kind != "qlora" and ds is not None and ds.stage == 3)


def reentrant_checkpointing(case: Case) -> bool:
    """torch.utils.checkpoint's use_reentrant as the case's stack sets it (harness.runtime.build): the
    case's `train.checkpointing_reentrant` when given, else reentrant for QLoRA (peft's k-bit
    preparation) and for LLaMA-Factory (use_reentrant_gc: true), non-reentrant otherwise."""
    if case.train.checkpointing_reentrant is not None:
        return case.train.checkpointing_reentrant
    return case.method.kind == "qlora" or case.stack == Stack.llamafactory


def zero_init(case: Case) -> bool:
    """ZeRO-3 with the model built under zero.Init (init_order deepspeed_first). DeepSpeed's engine
    then leaves parameter dtypes alone (`_cast_module_mixed_precision` skips a ZeRO-Init model), so
    peft's fp32 LoRA adapters stay fp32 and every adapter casts its input to fp32 (saved for
    backward); any other DeepSpeed engine casts the module, adapters included, to the half dtype."""
    ds = case.deepspeed
    return ds is not None and ds.stage == 3 and case.launch.init_order == "deepspeed_first"


@dataclass
class ParamInfo:
    """Parameters of a truncated model, by kind (element counts)."""

    quantizable: int = 0  # linear weights a 4-bit load quantizes (every Linear but the head)
    trainable: int = 0  # LoRA adapters, or everything for full fine-tuning
    other: int = 0  # embeddings, head, norms, biases, non-quantized rest
    sizes: list[int] = field(default_factory=list)  # numel of every base parameter (ZeRO-3 terms)
    head: int = 0  # output head (or tied embedding) elements
    tied_head: bool = False  # the head is the input embedding (tie_word_embeddings)
    largest_layer_module: int = 0  # largest leaf module's parameter count inside a layer
    bytes_total: int = 0  # bytes of every parameter as the stack holds it (before ZeRO)


LAYER_PRE, LAYER_POST = -1, 1 << 20  # an event or parameter before the first decoder layer, after the last
FORWARD, BACKWARD = 0, 1  # the pass an event of the step falls in


@dataclass
class TraceResult:
    layers: int
    peak: int  # highest live bytes above the step's starting states, during forward + backward
    held_after_forward: int  # bytes a forward leaves alive for backward (activations, logits, loss)
    logits: int  # bytes of the logits tensor the model returns
    params: ParamInfo
    seconds: float
    cached: bool = False
    # the step's allocations and frees in order, [op, id, bytes, phase, layer]
    # (harness.predict.trace.fake.AllocationLog)
    events: list[list[int]] = field(default_factory=list)
    # every parameter in load order, [elements, bytes per element, quantized, trainable, layer, adapter]
    layout: list[list[int]] = field(default_factory=list)
    # ids of `events`' allocations handed to a trainable parameter's AccumulateGrad: with a gradient
    # already there (the trace's accumulation) each is added and freed; with none, the parameter keeps it
    grads: list[int] = field(default_factory=list)
    # per phase (forward, backward), how many of `events` precede the first matmul's workspace: each
    # phase's first cuBLAS call takes its thread's handle, whose workspace follows that matmul's output
    # (-1: none seen)
    matmuls: list[int] = field(default_factory=list)
    # at 2 layers where `TraceSpec.zero3_hook_positions`: where DeepSpeed's hooks fire among `events`, [events
    # logged before it, in backward, event, module name] (harness.predict.zero3.hook_calls.positions; the events
    # as harness.predict.zero3.order numbers them)
    hooks: list[list] = field(default_factory=list)
    attention: str = ""  # the attention implementation the traced model dispatched through
    attention_note: str = ""  # how it came to, where the local transformers refused the case's


def extrapolate(a1: float, a2: float, layers: int) -> float:
    return a1 + (a2 - a1) * (layers - 1)
