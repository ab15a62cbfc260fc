"""Closed-form model-state terms: what fake tensors cannot see.

Per GPU process (worst rank) and per node, in bytes, from the parameter inventory of the traced
model (`harness.predict.trace.trace.ParamInfo`, extrapolated to the case's depth) and the case:

* weights: the parameters as the stack holds them (bf16/fp16; peft's k-bit preparation makes
  non-4-bit parameters fp32; LoRA adapters fp32 (peft's `autocast_adapter_dtype`), cast to the half
  dtype by a DeepSpeed engine). 4-bit (bitsandbytes nf4/fp4): 0.5 B per element plus the
  quantization state: one absmax per 64-element block, uint8 with double quantization (plus one
  fp32 absmax per 256 blocks), fp32 without.
* trainable gradients and AdamW state without DeepSpeed: gradients in the parameter dtype, two
  moments in the parameter dtype (torch AdamW keeps state like its parameter).
* DeepSpeed ZeRO-1/2/3 over W ranks: fp32 master + two fp32 moments (12 B per trainable element)
  / W, on the device or, with optimizer offload, in host memory (with the fp32 gradient partition);
  half gradient partitions (ZeRO-2 with optimizer offload: one buffer of the largest trainable
  parameter instead, `zero2_offload_grad_buffer`); the reduce buckets (contiguous gradients: one bucket, two with
  overlap_comm); ZeRO-3 parameters / W (host with parameter offload), parameters under the
  persistence threshold kept whole on every rank, and the gathered parameters: what DeepSpeed's own
  coordinator, replayed over the step (`harness.predict.zero3.coordinator`), holds when backward starts and at
  most (prefetch, reuse distance, live-parameter limit, recomputation under checkpointing, offload
  staging); for a full fine-tune with parameter offload (`harness.predict.predictor`), or without
  DeepSpeed installed, the closed form (the largest of the output head and one layer's largest
  module plus the prefetch bucket, capped by stage3_max_live_parameters, and
  `zero3_reentrant_retention`).
* cuBLAS workspaces allocated through the caching allocator (torch's default size on Hopper for
  the forward and the autograd threads): an assumption, not fitted.

None of this is fitted; the fitted constants are in `harness.predict.calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.predict.constants import (
    BNB_BLOCKSIZE,
    BNB_NESTED_BLOCKSIZE,
    CUBLAS_WORKSPACES_STATES,
    DS_DEFAULTS,
    FP32_BYTES,
    HALF_BYTES,
    GiB,
)
from harness.predict.step import fp32_trainable_parameters, fused_adamw, reentrant_checkpointing, zero_init
from harness.predict.zero3.coordinator import Gathered
from harness.spec.dsconfig import auto_sizes
from harness.spec.schema import Case, Offload


@dataclass
class Inventory:
    """Element counts of the model at the case's depth."""

    quantizable: int  # linear weights (not the head)
    other: int  # everything else of the base model
    trainable: int  # adapters, or every parameter for full fine-tuning
    head: int
    largest_layer_module: int
    small_params: dict[int, int] = field(default_factory=dict)  # threshold -> elements of params <= it
    sizes: list[int] = field(default_factory=list)  # element counts of every base parameter
    layer_sizes: list[int] = field(default_factory=list)  # element counts of one decoder layer's base parameters
    layers: int = 0  # decoder layers at the case's depth
    largest_trainable: int = 0  # element count of the largest trainable parameter (adapter or base)
    trainable_sizes: list[int] = field(default_factory=list)  # element counts of every trainable parameter

    @property
    def total(self) -> int:
        return self.quantizable + self.other


@dataclass
class States:
    device: dict[str, int]  # per process
    host: dict[str, int]  # per process
    resident: int  # device bytes alive before a micro-step starts (states only)
    optimizer_step_extra: int  # transient of the optimizer step above `resident`
    notes: list[str]
    step_only: dict[str, int] = field(default_factory=dict)  # device bytes alive only during forward + backward


def quant_bytes(numel: int, double_quant: bool) -> int:
    blocks = numel / BNB_BLOCKSIZE
    absmax = blocks * 1 + blocks / BNB_NESTED_BLOCKSIZE * FP32_BYTES if double_quant else blocks * FP32_BYTES
    return int(numel / 2 + absmax)


def _host_partition(sizes: list[int], world: int, half: int, pinned: bool) -> int:
    """Host bytes of one rank's offloaded parameter partitions. Pinned (pin_memory), every
    partition is its own page-locked block from torch's pinned host allocator, which rounds each
    request up to a power of two (guide 000's 32B: ~1.83x the plain partition, a per-rank RSS slope
    of 0.83 GiB per layer against 0.85 measured with pin_memory and 0.45 without)."""
    total = 0
    for n in sizes:
        b = -(-n // world) * half
        total += (1 << (b - 1).bit_length()) if pinned and b > 0 else b
    return total


def ds_value(case: Case, name: str, hidden: int, default: int | None) -> int | None:
    ds = case.deepspeed
    value = getattr(ds, name, None)
    if value is not None:
        return value
    return auto_sizes(hidden).get(name, default)


def model_states(case: Case, inv: Inventory, hidden: int, gathered: Gathered | None = None) -> States:
    half = HALF_BYTES[case.precision.value]
    ds = case.deepspeed
    dev: dict[str, int] = {}
    host: dict[str, int] = {}
    notes: list[str] = []
    upcast = ds is None and case.method.kind == "full" and fp32_trainable_parameters(case)
    _base_weights(case, inv, hidden, half, upcast, dev, host, notes)
    # --- trainable parameters, gradients, optimizer ---
    step_only: dict[str, int] = {}
    if ds is None:
        step_extra = _plain_optimizer(case, inv, half, upcast, dev, notes)
    else:
        step_extra = _deepspeed_optimizer(case, inv, hidden, half, gathered, dev, host)
        if ds.stage == 3:
            _zero3_gathered(case, inv, hidden, half, gathered, dev, step_only, notes)
        if ds.offload_param == Offload.cpu or ds.offload_optimizer == Offload.cpu:
            notes.append("offloaded state is counted in host_ram, pinned or not")
    dev["cublas_workspaces"] = CUBLAS_WORKSPACES_STATES
    resident = sum(dev.values())
    return States(device=dev, host=host, resident=resident, optimizer_step_extra=step_extra, notes=notes,
                  step_only=step_only)


def _base_weights(case: Case, inv: Inventory, hidden: int, half: int, upcast: bool, dev: dict[str, int],
                  host: dict[str, int], notes: list[str]) -> None:
    """The base model's weights as the stack holds them: 4-bit storage with its quantization state, fp32
    upcasts, ZeRO-3 partitions and persistent parameters."""
    kind, ds, W, T = case.method.kind, case.deepspeed, case.launch.ranks, inv.trainable
    if kind == "qlora":
        q = case.method.quantization
        dev["weights_4bit"] = quant_bytes(inv.quantizable, q.double_quant)
        other_bytes = 4 if case.stack.kbit_prepared else half
        if case.stack.kbit_prepared:
            notes.append("peft prepare_model_for_kbit_training: embeddings, head, norms, biases in fp32")
        dev["weights_other"] = inv.other * other_bytes
        return
    # full or LoRA: the base weights in the half dtype, partitioned alike under ZeRO-3
    base = inv.total * half
    if upcast:  # LLaMA-Factory's full fine-tune: every trainable parameter (all of them) in fp32
        base = (inv.total - T) * half + T * 4
        notes.append("LLaMA-Factory's init_adapter: trainable parameters upcast to fp32, trained under autocast")
    if ds is not None and ds.stage == 3:
        thr = ds_value(case, "stage3_param_persistence_threshold", hidden, DS_DEFAULTS["persistence"])
        persistent = sum(n for n in inv.sizes if n <= thr) * half
        part = base // W
        if ds.offload_param == Offload.cpu:
            host["zero3_param_partition"] = _host_partition(inv.sizes, W, half, ds.pin_memory) or part
        else:
            dev["zero3_param_partition"] = part
        dev["zero3_persistent_params"] = persistent
    else:
        dev["weights"] = base


def _plain_optimizer(case: Case, inv: Inventory, half: int, upcast: bool, dev: dict[str, int],
                     notes: list[str]) -> int:
    """Without DeepSpeed: adapters, gradients and AdamW's moments in the parameters' dtype (peft's adapters
    fp32); the optimizer step's transient returned."""
    kind, T = case.method.kind, inv.trainable
    pbytes = 4 if kind in ("lora", "qlora") or upcast else half  # peft adapters fp32
    if kind in ("lora", "qlora"):
        dev["lora_params"] = T * pbytes
    dev["grads"] = T * pbytes
    dev["adam_states"] = 2 * T * pbytes
    if case.train.grad_accum == 1:
        notes.append("GA 1: gradients exist only from backward to the optimizer step")
    # foreach AdamW: one temporary list the size of the parameters; the Trainer's fused AdamW: none
    return 0 if fused_adamw(case) else T * pbytes


def _deepspeed_optimizer(case: Case, inv: Inventory, hidden: int, half: int, gathered: Gathered | None,
                         dev: dict[str, int], host: dict[str, int]) -> int:
    """Under DeepSpeed: the adapters, the fp32 master and moments and gradient partitions (on the device or
    the host), the reduce buckets; the optimizer step's transient returned."""
    kind, ds, W, T = case.method.kind, case.deepspeed, case.launch.ranks, inv.trainable
    step_extra = 0
    # adapters: cast to the half dtype by the engine, except in a ZeRO-Init model (peft's fp32)
    tbytes = 4 if (kind in ("lora", "qlora") and zero_init(case)) else half
    if kind in ("lora", "qlora") and ds.stage == 3 and gathered is not None and inv.trainable_sizes:
        # ZeRO-3 keeps whole only the adapters at or below the persistence threshold; the others are
        # partitioned like the base weights (on the host with parameter offload) and, gathered, counted
        # in the replayed gathered set. Guide 000's recorded 4-layer peak holds 6.0 MiB of persistent
        # parameters (the optimizer step's `_allgather_params_coalesced`) against 16 MiB of adapters.
        thr = ds_value(case, "stage3_param_persistence_threshold", hidden, DS_DEFAULTS["persistence"])
        kept = sum(n for n in inv.trainable_sizes if n <= thr)
        if ds.offload_param != Offload.cpu:
            kept += sum(-(-n // W) for n in inv.trainable_sizes if n > thr)
        dev["lora_params"] = kept * tbytes
    elif kind in ("lora", "qlora"):
        dev["lora_params"] = T * tbytes  # small; under ZeRO-3 mostly below the persistence threshold
    shard = W if ds.stage >= 1 else 1
    opt = 3 * FP32_BYTES * T // shard  # the fp32 master and Adam's two moments
    if ds.offload_optimizer == Offload.cpu:
        host["optimizer_fp32_master_adam"] = opt
        host["fp32_grad_partition"] = 4 * T // shard
    else:
        dev["optimizer_fp32_master_adam"] = opt
        step_extra = 4 * T // shard  # fp32 gradient partition built at the step
    if ds.stage == 3 and ds.offload_optimizer == Offload.cpu:
        # ZeRO-3 puts its gradient partitions in a buffer on the optimizer's device: the host
        # (DeepSpeed 0.19 stage3.py, grad_partitions_flat_buffer on self.device), counted above.
        # Guide 002's full fine-tune on 2 H200s shows it: allocated 11.15 GiB at 6 and 12 layers.
        pass
    elif ds.stage == 2 and ds.offload_optimizer == Offload.cpu:
        dev["zero2_offload_grad_buffer"] = zero2_offload_grad_buffer(inv, tbytes)
    elif ds.stage >= 2:
        dev["grad_partition"] = tbytes * T // shard
    else:
        dev["grads"] = tbytes * T
    bucket = ds_value(case, "reduce_bucket_size", hidden, DS_DEFAULTS["reduce_bucket_size"])
    n_buckets = 2 if (ds.overlap_comm and ds.stage in (1, 2)) else 1
    if ds.stage == 3 and ds.contiguous_gradients:
        # stage3.py (_setup_for_real_optimizer): one IPG buffer of the whole bucket per communication
        # dtype, the engine's half dtype whatever the adapters' (guide 000's LoRA: 50 MiB at 4 layers)
        dev["reduce_buckets"] = bucket * half
    elif ds.contiguous_gradients:
        dev["reduce_buckets"] = n_buckets * min(bucket, max(T, 1)) * tbytes
    return step_extra


def _zero3_gathered(case: Case, inv: Inventory, hidden: int, half: int, gathered: Gathered | None,
                    dev: dict[str, int], step_only: dict[str, int], notes: list[str]) -> None:
    """ZeRO-3's gathered parameters: DeepSpeed's coordinator replayed over the step where it could be, else
    the closed form (and the reentrant retention of frozen weights)."""
    ds, W = case.deepspeed, case.launch.ranks
    if gathered is not None:
        # DeepSpeed's coordinator replayed over the step (harness.predict.zero3.coordinator): what is gathered
        # when backward starts is resident through the step's transient peak; the most gathered at
        # once, anywhere in the step, is a second candidate for the peak (the predictor takes the larger)
        dev["zero3_gathered_params"] = gathered.backward_start_bytes
        step_only["zero3_gathered_above_backward_start"] = max(0, gathered.peak_bytes - gathered.backward_start_bytes)
        notes.append(gathered.describe())
        return
    prefetch = ds_value(case, "stage3_prefetch_bucket_size", hidden, DS_DEFAULTS["prefetch"])
    max_live = ds.stage3_max_live_parameters or DS_DEFAULTS["max_live"]
    # without DeepSpeed to replay: a module's parameters are gathered whole whatever the limits
    # (the head included); stage3_max_live_parameters caps only what prefetching adds on top
    live = max(inv.head, min(max_live, inv.largest_layer_module + prefetch))
    dev["zero3_gathered_params"] = live * half
    if ds.offload_param == Offload.cpu:  # the partition is copied to the device before the all-gather
        dev["zero3_offload_staging"] = max(inv.head, inv.largest_layer_module) * half // W
    notes.append("ZeRO-3 gathered live set (closed form): max(output head, a layer's largest module + "
                 "prefetch bucket capped by stage3_max_live_parameters), without what DeepSpeed keeps "
                 "for reuse")
    retained = zero3_reentrant_retention(case, inv, hidden)
    if retained:
        step_only["zero3_reentrant_retained_weights"] = retained
        notes.append("ZeRO-3 + reentrant checkpointing + frozen weights: every layer's gathered frozen "
                     f"weights held at once ({retained / GiB:.2f} GiB at {inv.layers} layers); "
                     "non-reentrant checkpointing (use_reentrant_gc: false) avoids it")


def zero2_offload_grad_buffer(inv: Inventory, tbytes: int) -> int:
    """Device bytes ZeRO-2 with optimizer offload keeps for gradients between micro-steps, in place of
    a gradient partition: DeepSpeed 0.19.8's `DeepSpeedZeroOptimizer.__init__`
    (runtime/zero/stage_1_and_2.py), under `cpu_offload`, allocates `temp_grad_buffer_for_gpu_offload`,
    `largest_param_numel` elements of the trainable dtype on the device (the largest parameter of its
    bit16 groups, which hold the trainable parameters only), and keeps the fp32 gradient partition on
    the host (`single_partition_of_fp32_groups[i].grad`). Each reduced gradient is copied there
    (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`, or through the pinned
    `accumulated_grads_in_cpu` under gradient accumulation, staged through that device buffer by
    `async_accumulate_grad_in_cpu_via_gpu`) and its device gradient cleared (`clear_grad_attribute`):
    no gradient partition stays on the device."""
    return max(inv.largest_trainable, 0) * tbytes


def zero3_reentrant_retention(case: Case, inv: Inventory, hidden: int) -> int:
    """Bytes of gathered frozen weights ZeRO-3 keeps on the device through the forward when the
    layers are checkpointed reentrantly; 0 where it does not apply. Used only by the closed form
    (DeepSpeed not installed): the replay of DeepSpeed's coordinator (`harness.predict.zero3.coordinator`) finds
    the same retention from DeepSpeed's own rule, which ties the frozen weights fetched by a
    recomputed forward to the newest module in backward, under reentrant checkpointing the root,
    released only when backward ends.

    Applies only when all of these hold: ZeRO-3; gradient checkpointing on; reentrant
    (`train.checkpointing_reentrant`, else the stack's default: LLaMA-Factory's use_reentrant_gc:
    true, peft's k-bit preparation); frozen parameters exist (LoRA/QLoRA: the base weights). Then
    the gathered frozen parameters of every layer, at full size (not 1/world), are resident at
    once: the term is one layer's frozen parameters above the persistence threshold (the
    persistent ones are counted already) x half bytes x layers. The predicted peak is then
    max(the usual forward/backward peak, states + gathered live set + offload staging + this
    term) (harness.predict.predictor): the retained weights coincide with the next parameter gather, not
    with the loss and logits.

    Why: DeepSpeed's module hooks gather a parameter before its module's forward and release it
    (swap its data for an empty tensor) after; the reentrant checkpoint re-runs each layer's
    forward in backward and keeps references to the gathered tensors, so the release frees
    nothing, and frozen weights have no gradient hook that would return them to their partition
    earlier. This matches the DeepSpeed discussions of ZeRO-3 with activation checkpointing and
    frozen (requires_grad=False) parameters, where gathered frozen parameters were found held.
    With non-reentrant checkpointing (saved-tensor hooks) the releases take effect.

    Evidence (guide 000, DeepSeek-R1-Distill-Qwen-32B, LoRA r8 all linear, ZeRO-3 with optimizer
    and parameter offload, 2 ranks on two H200s; results/baselines/nvidia-h200-x2/, raw per-rank
    reports in results/runs/2026-11-26-h200x2-000-*.json):
    * reentrant (LLaMA-Factory's default): the step peak grows 0.93 GiB per layer between 4 and 8
      layers (one whole layer's bf16 weights: 487.6 M elements, 0.91 GiB, not 1/world), and the
      full-depth run OOMed at 65.16 GiB on the 64 GiB emulated card with 60.0 GiB allocated (about
      the whole 32B in bf16), trying to allocate 744 MiB: one rank's partition of the 152064 x 5120
      embedding / head being staged for its all-gather (000-lora-z3-offload-cutoff1024-ga16@2r2ga;
      -lora-reentrant-depths, -failing-full-depth). The aggressive buckets and thresholds of
      000-lora-z3-offload-aggressive-cutoff512-ga32 do not change the slope, and the peak hardly
      depends on the sequence length (intercepts 2.44 GiB at 512 tokens, 2.60 at 1024), so the
      retained weights do not coincide with the loss. The forward probe (bytes a forward adds,
      `probes.activation_bytes`) is 3.19 GiB at 4 layers and 3.23 at 8 in both the reentrant and
      the non-reentrant runs: the weights are not what a forward adds; they accumulate in the
      backward's recomputation and are still held when the next micro-step gathers.
    * non-reentrant (000-lora-z3-offload-cutoff1024-ga16-nonreentrant): flat, 10.22 GiB at 4 layers,
      10.24 at 8 (-nonreentrant-repeats, -checkpointing-experiment);
    * without checkpointing (-checkpointing-experiment, case ids ending -nogc): 13.09 -> 14.48 GiB,
      the activations' slope only.
    Nothing here is fitted to those figures: the term is structural and the benchmark
    (benchmarks/bench_predictor.py) checks it against them.
    """
    ds = case.deepspeed
    if ds is None or ds.stage != 3 or not case.train.gradient_checkpointing:
        return 0
    if not reentrant_checkpointing(case) or case.method.kind not in ("lora", "qlora"):
        return 0
    thr = ds_value(case, "stage3_param_persistence_threshold", hidden, DS_DEFAULTS["persistence"])
    per_layer = sum(n for n in inv.layer_sizes if n > thr)
    return per_layer * HALF_BYTES[case.precision.value] * inv.layers
