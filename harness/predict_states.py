"""Closed-form model-state terms: what fake tensors cannot see.

Per GPU process (worst rank) and per node, in bytes, from the parameter inventory of the traced
model (`harness.predict_trace.ParamInfo`, extrapolated to the case's depth) and the case:

* weights: the parameters as the stack holds them (bf16/fp16; peft's k-bit preparation makes
  non-4-bit parameters fp32; LoRA adapters fp32 (peft's `autocast_adapter_dtype`), cast to the half
  dtype by a DeepSpeed engine). 4-bit (bitsandbytes nf4/fp4): 0.5 B per element plus the
  quantization state: one absmax per 64-element block, uint8 with double quantization (plus one
  fp32 absmax per 256 blocks), fp32 without.
* trainable gradients and AdamW state without DeepSpeed: gradients in the parameter dtype, two
  moments in the parameter dtype (torch AdamW keeps state like its parameter).
* DeepSpeed ZeRO-1/2/3 over W ranks: fp32 master + two fp32 moments (12 B per trainable element)
  / W, on the device or, with optimizer offload, in host memory (with the fp32 gradient partition);
  half gradient partitions; the reduce buckets (contiguous gradients: one bucket, two with
  overlap_comm); ZeRO-3 parameters / W (host with parameter offload), parameters under the
  persistence threshold kept whole on every rank, and the gathered live set (the largest of the
  output head and one layer's largest module plus the prefetch bucket, capped by
  stage3_max_live_parameters).
* cuBLAS workspaces allocated through the caching allocator (torch's default size on Hopper for
  the forward and the autograd threads): an assumption, not fitted.

None of this is fitted; the fitted constants are in `harness.calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.dsconfig import auto_sizes
from harness.schema import Case, Offload, Precision, Stack

GiB = 2**30
CUBLAS_WORKSPACE = 2 * (32 * 2**20 + 128 * 2**10)  # two handles (forward, autograd thread)
HALF = {Precision.bf16: 2, Precision.fp16: 2, Precision.fp32: 4}
DS_DEFAULT_MAX_LIVE = 1_000_000_000
DS_DEFAULT_PERSISTENCE = 100_000
DS_DEFAULT_PREFETCH = 50_000_000


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


def quant_bytes(numel: int, double_quant: bool) -> int:
    blocks = numel / 64
    absmax = blocks * 1 + blocks / 256 * 4 if double_quant else blocks * 4
    return int(numel / 2 + absmax)


def ds_value(case: Case, name: str, hidden: int, default: int | None) -> int | None:
    ds = case.deepspeed
    value = getattr(ds, name, None)
    if value is not None:
        return value
    return auto_sizes(hidden).get(name, default)


def model_states(case: Case, inv: Inventory, hidden: int) -> States:
    half = HALF[case.precision]
    kind = case.method.kind
    ds = case.deepspeed
    W = case.launch.ranks
    dev: dict[str, int] = {}
    host: dict[str, int] = {}
    notes: list[str] = []
    T = inv.trainable

    # --- base weights ---
    if kind == "qlora":
        q = case.method.quantization
        dev["weights_4bit"] = quant_bytes(inv.quantizable, q.double_quant)
        other_bytes = 4 if case.stack == Stack.peft else half
        if case.stack == Stack.peft:
            notes.append("peft prepare_model_for_kbit_training: embeddings, head, norms, biases in fp32")
        dev["weights_other"] = inv.other * other_bytes
    elif kind == "full":
        base = inv.total * half
        if ds is not None and ds.stage == 3:
            thr = ds_value(case, "stage3_param_persistence_threshold", hidden, DS_DEFAULT_PERSISTENCE)
            persistent = sum(n for n in inv.sizes if n <= thr) * half
            part = base // W
            if ds.offload_param == Offload.cpu:
                host["zero3_param_partition"] = part
                dev["zero3_persistent_params"] = persistent
            else:
                dev["zero3_param_partition"] = part
                dev["zero3_persistent_params"] = persistent
        else:
            dev["weights"] = base
    else:  # lora
        base = inv.total * half
        if ds is not None and ds.stage == 3:
            thr = ds_value(case, "stage3_param_persistence_threshold", hidden, DS_DEFAULT_PERSISTENCE)
            persistent = sum(n for n in inv.sizes if n <= thr) * half
            part = base // W
            (host if ds.offload_param == Offload.cpu else dev)["zero3_param_partition"] = part
            dev["zero3_persistent_params"] = persistent
        else:
            dev["weights"] = base

    # --- trainable parameters, gradients, optimizer ---
    step_extra = 0
    if ds is None:
        pbytes = 4 if kind in ("lora", "qlora") else half  # peft adapters fp32
        if kind in ("lora", "qlora"):
            dev["lora_params"] = T * pbytes
        dev["grads"] = T * pbytes
        dev["adam_states"] = 2 * T * pbytes
        step_extra = T * pbytes  # foreach AdamW: one temporary list the size of the parameters
        if case.train.grad_accum == 1:
            notes.append("GA 1: gradients exist only from backward to the optimizer step")
    else:
        if kind in ("lora", "qlora"):
            if ds.stage == 3:
                dev["lora_params"] = T * half  # adapters are small: below the persistence threshold
            else:
                dev["lora_params"] = T * half
        shard = W if ds.stage >= 1 else 1
        opt = 12 * T // shard
        if ds.offload_optimizer == Offload.cpu:
            host["optimizer_fp32_master_adam"] = opt
            host["fp32_grad_partition"] = 4 * T // shard
        else:
            dev["optimizer_fp32_master_adam"] = opt
            step_extra = 4 * T // shard  # fp32 gradient partition built at the step
        if ds.stage >= 2:
            dev["grad_partition"] = half * T // shard
        else:
            dev["grads"] = half * T
        bucket = ds_value(case, "reduce_bucket_size", hidden, 500_000_000)
        n_buckets = 2 if (ds.overlap_comm and ds.stage in (1, 2)) else 1
        if ds.contiguous_gradients or ds.stage == 3:
            dev["reduce_buckets"] = n_buckets * min(bucket, max(T, 1)) * half
        if ds.stage == 3:
            prefetch = ds_value(case, "stage3_prefetch_bucket_size", hidden, DS_DEFAULT_PREFETCH)
            max_live = ds.stage3_max_live_parameters or DS_DEFAULT_MAX_LIVE
            live = min(max_live, max(inv.head, inv.largest_layer_module + prefetch))
            dev["zero3_gathered_params"] = live * half
            notes.append("ZeRO-3 gathered live set: max(output head, a layer's largest module + prefetch bucket)")
        if ds.offload_param == Offload.cpu or ds.offload_optimizer == Offload.cpu:
            notes.append("offloaded state is counted in host_ram, pinned or not")
    dev["cublas_workspaces"] = CUBLAS_WORKSPACE
    resident = sum(dev.values())
    return States(device=dev, host=host, resident=resident, optimizer_step_extra=step_extra, notes=notes)
