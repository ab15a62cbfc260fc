"""The shape a case runs at, per fidelity.

real: the case as written. tiny: the same case shrunk so every case of the suite runs on a 2-core
CPU in seconds, keeping what the relative claims depend on:
* sequence length scaled by 1/16 (so 1024 vs 512 stays 2:1), at least 16 tokens;
* micro batch as written (it sets activation memory, and is small already);
* gradient accumulation capped at 2 (memory does not grow with it past 2: the gradient buffer exists
  from the second micro step on);
* ranks capped at `TINY_MAX_RANKS` (2 by default: ZeRO partitions and gathers exactly as at 8);
* DeepSpeed element-count buckets and thresholds scaled with the parameter size (hidden size squared).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness.models.registry import tiny_config
from harness.models.source import load_model
from harness.spec.schema import Case, Stack

TINY_SEQ_DIVISOR = 16
TINY_MIN_SEQ = 16
TINY_MAX_GRAD_ACCUM = 2
TINY_STEPS = 4
REAL_STEPS = 6


def harness_model_source(case: Case) -> str:
    """How the harness's runs build the case's model (`launch.model_source`): from a random-weight
    checkpoint through from_pretrained where the case trains through a framework (LLaMA-Factory, the
    HF Trainer: `harness.runtime.stacks`) or is QLoRA (bitsandbytes quantizes it as it loads); every
    other from its config on the device (harness.runtime.build)."""
    if case.method.kind == "qlora" or (case.stack in (Stack.llamafactory, Stack.hf_trainer)
                                       and case.launch.runtime == "framework"):
        return "checkpoint"
    return "config"


def tiny_max_ranks() -> int:
    return int(os.environ.get("HARNESS_TINY_RANKS", "2"))


@dataclass(frozen=True)
class RunShape:
    fidelity: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    ranks: int
    steps: int  # optimizer steps; the first is warm-up
    ds_size_scale: float
    hidden_size: int

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum


def run_shape(case: Case, fidelity: str, steps: int | None = None) -> RunShape:
    arch = load_model(case.model)
    full_hidden = int(arch.config["hidden_size"])
    if fidelity == "tiny":
        seq = max(TINY_MIN_SEQ, case.train.seq_len // TINY_SEQ_DIVISOR)
        hidden = int(tiny_config(arch, seq)["hidden_size"])
        return RunShape(
            fidelity=fidelity,
            seq_len=seq,
            micro_batch=case.train.micro_batch,
            grad_accum=min(case.train.grad_accum, TINY_MAX_GRAD_ACCUM),
            ranks=min(case.launch.ranks, tiny_max_ranks()),
            steps=steps or TINY_STEPS,
            ds_size_scale=(hidden / full_hidden) ** 2,
            hidden_size=hidden,
        )
    return RunShape(
        fidelity=fidelity,
        seq_len=case.train.seq_len,
        micro_batch=case.train.micro_batch,
        grad_accum=case.train.grad_accum,
        ranks=case.launch.ranks,
        steps=steps or REAL_STEPS,
        ds_size_scale=1.0,
        hidden_size=full_hidden,
    )
