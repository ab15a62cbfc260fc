"""The knobs `fit` turns, their values, and a case with a set of them applied.

Knobs that keep the training the same: the micro-batch (with gradient accumulation keeping the global
batch), gradient checkpointing and whether it is reentrant, Liger's kernels (where the stack applies them
to the model: `harness.predict.step.liger_applies`), the ZeRO stage (of a job that already runs
DeepSpeed), optimizer and parameter offload, pinned offload buffers, DeepSpeed's buckets and live-set
limits (`LEAN_BUCKETS`, the guide 000 fix's values), and the dataloader workers. A one-GPU job without
DeepSpeed, on a stack that reads `deepspeed`, may also take ZeRO-2 with the optimizer offloaded or ZeRO-3
with the optimizer and the parameters offloaded (`harness.fit.zero_offload`). Knobs that change
what is trained, only when allowed (`--allow`): 4-bit base weights (`quantization`), a shorter cutoff
(`cutoff`), a lower LoRA rank (`rank`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from harness.fit.zero_offload import NewDeepSpeed, offload_block
from harness.predict.step import reentrant_checkpointing
from harness.spec.schema import Case, DeepSpeed, Lora, Method, Offload, Quantization, Stack

ALLOWABLE = ("quantization", "cutoff", "rank")
# DeepSpeed settings of guide 000's "aggressive" fix: smaller gradient buckets, prefetch and
# persistence, a capped live set and optimizer sub-groups. Elements, as DeepSpeed counts them.
LEAN_BUCKETS = {"reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
                "stage3_prefetch_bucket_size": 10_000_000, "stage3_param_persistence_threshold": 10_000,
                "stage3_max_live_parameters": 100_000_000, "sub_group_size": 100_000_000}
STAGE3_ONLY = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
               "stage3_max_reuse_distance")
MAX_MICRO_BATCH = 64
MIN_CUTOFF = 256
MIN_RANK = 4
FEW_WORKERS = 2  # dataloader workers a job sharing its host keeps (guide 004's plans)


@dataclass(frozen=True)
class Knobs:
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    reentrant: bool  # torch.utils.checkpoint's use_reentrant (meaningful with checkpointing)
    stage: int | None  # None: no DeepSpeed
    offload_optimizer: bool
    offload_param: bool
    pin_memory: bool
    lean_buckets: bool
    workers: int
    seq_len: int
    lora_r: int | None
    four_bit: bool
    liger: bool = False

    def trace_key(self) -> tuple:
        """What of these knobs changes the traced step (harness.predict.step.TraceSpec), but the micro-batch."""
        return (self.checkpointing, self.checkpointing and self.reentrant, self.stage is None, self.stage == 3,
                self.seq_len, self.lora_r, self.four_bit, self.liger, self.stage is None and self.grad_accum > 1)

    def family(self) -> tuple:
        """Candidates that differ only in the micro-batch: a bigger one never needs less memory."""
        return (self.trace_key()[:-1], self.stage, self.offload_optimizer, self.offload_param, self.pin_memory,
                self.lean_buckets, self.workers)


def knobs_of(case: Case) -> Knobs:
    ds = case.deepspeed
    lean = ds is not None and all(getattr(ds, k, None) == v for k, v in LEAN_BUCKETS.items()
                                  if hasattr(ds, k) and (ds.stage == 3 or k not in STAGE3_ONLY))
    return Knobs(
        micro_batch=case.train.micro_batch, grad_accum=case.train.grad_accum,
        checkpointing=case.train.gradient_checkpointing, reentrant=reentrant_checkpointing(case),
        stage=None if ds is None else ds.stage,
        offload_optimizer=ds is not None and ds.offload_optimizer == Offload.cpu,
        offload_param=ds is not None and ds.offload_param == Offload.cpu,
        pin_memory=ds.pin_memory if ds is not None else True, lean_buckets=lean,
        workers=case.train.dataloader_workers, seq_len=case.train.seq_len,
        lora_r=case.method.lora.r if case.method.lora else None, four_bit=case.method.kind == "qlora",
        liger=case.train.liger_kernel,
    )


def apply(case: Case, k: Knobs, new_deepspeed: NewDeepSpeed | None = None) -> Case:
    """`case` with the knobs `k` set (nothing validated twice: the knobs' values are valid by construction).
    A case without DeepSpeed given a ZeRO stage takes the block `harness.fit.zero_offload` writes, sized for
    `new_deepspeed`'s model; DeepSpeed's AdamW then replaces the Trainer's optimizer, as the importer reads it."""
    train = case.train.model_copy(update={
        "micro_batch": k.micro_batch, "grad_accum": k.grad_accum, "gradient_checkpointing": k.checkpointing,
        "checkpointing_reentrant": k.reentrant if k.checkpointing else None,
        "dataloader_workers": k.workers, "seq_len": k.seq_len, "liger_kernel": k.liger})
    method, stack = case.method, case.stack
    if method.lora is not None and k.lora_r is not None and k.lora_r != method.lora.r:
        alpha = method.lora.alpha * k.lora_r / method.lora.r  # the same scaling alpha / r
        method = method.model_copy(update={"lora": Lora(r=k.lora_r, alpha=alpha, dropout=method.lora.dropout,
                                                         targets=method.lora.targets)})
    if k.four_bit and method.kind == "lora":
        compute = case.precision if case.precision.value != "fp32" else "bf16"
        method = Method(kind="qlora", lora=method.lora, quantization=Quantization(compute_dtype=compute))
        if stack == Stack.plain:
            stack = Stack.peft  # a TrainingArguments script loads 4-bit weights through peft's k-bit preparation
    ds, launch = case.deepspeed, case.launch
    if ds is None and k.stage is not None:
        if new_deepspeed is None:
            raise ValueError("a ZeRO stage for a case without DeepSpeed needs the model's hidden size (NewDeepSpeed)")
        ds = DeepSpeed.model_validate(offload_block(k.stage, k.pin_memory, LEAN_BUCKETS if k.lean_buckets else None,
                                                    new_deepspeed.hidden_size))
        train = train.model_copy(update={"optim": None})
        launch = launch.model_copy(update={
            "init_order": new_deepspeed.init_order if k.stage == 3 else "deepspeed_first"})
    elif ds is not None and k.stage is not None:
        data = ds.model_dump()
        data.update(stage=k.stage, offload_optimizer=Offload.cpu if k.offload_optimizer else Offload.none,
                    offload_param=Offload.cpu if k.offload_param else Offload.none, pin_memory=k.pin_memory)
        if k.lean_buckets:
            data.update(LEAN_BUCKETS)
        if k.stage != 3:
            data.update({key: None for key in STAGE3_ONLY})
        ds = DeepSpeed.model_validate(data)
    return case.model_copy(update={"train": train, "method": method, "stack": stack, "deepspeed": ds,
                                   "launch": launch})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, MAX_MICRO_BATCH) + 1) if n % d == 0]


def _halvings(value: int, floor: int) -> list[int]:
    out, v = [value], value // 2
    while v >= floor and len(out) < 3:
        out.append(v)
        v //= 2
    return out


def _deepspeed_options(base: Knobs, offload: bool = False) -> list[tuple[int | None, bool, bool, bool, bool]]:
    """(stage, offload optimizer, offload parameters, pinned, lean buckets) of a job on DeepSpeed. A job
    without it keeps running without it, and where `offload` (a one-GPU job whose stack reads `deepspeed`:
    `harness.fit.zero_offload.why_not`) may also take ZeRO-2 with the optimizer offloaded or ZeRO-3 with
    the optimizer and the parameters offloaded: on one card ZeRO shards nothing, so stages without
    offload, and ZeRO-3 keeping the parameters on the card, hold no less than the job without DeepSpeed."""
    if base.stage is None:
        none = [(None, False, False, base.pin_memory, False)]
        if not offload:
            return none
        return none + [(stage, True, stage == 3, pin, lean)
                       for stage, pin, lean in itertools.product((2, 3), (True, False), (False, True))]
    out = [(0, False, False, base.pin_memory, False)]
    stages = sorted({2, 3, base.stage} - {0})
    for stage in stages:
        offloads = [(False, False), (True, False)] + ([(True, True)] if stage == 3 else [])
        for (opt, par), lean in itertools.product(offloads, (False, True)):
            pins = (True, False) if opt or par else (base.pin_memory,)
            out += [(stage, opt, par, pin, lean) for pin in pins]
    return out


def space(base: Knobs, allow: frozenset[str], kind: str, liger: bool = False, offload: bool = False) -> Iterator[Knobs]:
    """Every combination of knob values to consider, the global batch kept. `kind`: the method
    (lora, qlora, full); 4-bit weights only for LoRA, and not under ZeRO-3 (not modelled). `liger`: the
    stack can apply Liger's kernels to this model (they change no training result, only kernels).
    `offload`: a job without DeepSpeed may take ZeRO offload (`_deepspeed_options`)."""
    per_rank = base.micro_batch * base.grad_accum
    checkpointing = [(False, base.reentrant), (True, True), (True, False)]
    workers = sorted({base.workers, min(base.workers, FEW_WORKERS)}, reverse=True)
    seqs = _halvings(base.seq_len, MIN_CUTOFF) if "cutoff" in allow else [base.seq_len]
    ranks = _halvings(base.lora_r, MIN_RANK) if "rank" in allow and base.lora_r else [base.lora_r]
    bits = [base.four_bit] + ([True] if "quantization" in allow and kind == "lora" else [])
    ligers = sorted({base.liger, liger or base.liger}, reverse=True)
    for mb, (gc, reentrant), ds, w, seq, r, four, lig in itertools.product(
            _divisors(per_rank), checkpointing, _deepspeed_options(base, offload), workers, seqs, ranks, bits, ligers):
        stage, opt, par, pin, lean = ds
        if four and stage == 3:
            continue
        yield replace(base, micro_batch=mb, grad_accum=per_rank // mb, checkpointing=gc, reentrant=reentrant,
                      stage=stage, offload_optimizer=opt, offload_param=par, pin_memory=pin, lean_buckets=lean,
                      workers=w, seq_len=seq, lora_r=r, four_bit=four, liger=lig)
