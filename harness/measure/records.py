"""What a worker writes (one JSON per rank) and what the launcher makes of a whole case run."""

from __future__ import annotations

import math
import statistics
from enum import Enum

from pydantic import BaseModel, Field, NonNegativeInt, field_validator

from harness.spec.files import FileName, FileNameOrEmpty

Bytes = NonNegativeInt  # a measured size: a negative one is an edited or corrupt record


class Memory(BaseModel):
    """Peak (or footprint) of one phase, bytes. allocated: live tensors; reserved: the caching
    allocator's segments; device: what the device reports for the process (NVML / amdsmi);
    host_rss: host memory of the process and its dataloader workers (resident set); host_anon: its
    anonymous and shared-memory part, without the file pages the kernel can reclaim (Linux)."""

    allocated: Bytes
    reserved: Bytes | None = None
    device: Bytes | None = None
    host_rss: Bytes | None = None
    host_anon: Bytes | None = None
    resident: Bytes | None = None  # allocated bytes still live at the end of the phase

    def limiting(self) -> int:
        """The figure that decides an OOM: the device's own where known, else reserved, else allocated."""
        for value in (self.device, self.reserved, self.allocated):
            if value is not None:
                return value
        return self.allocated


class Weights(BaseModel):
    params_total: int  # logical parameter count of the model (unpartitioned, unquantized)
    params_trainable: int
    param_bytes_local: int  # bytes of parameter storage this rank holds
    quantized_linear_bytes: int | None = None  # 4-bit linear weights + their quantization state
    quantized_linear_bf16_bytes: int | None = None  # the same weights at 2 bytes each


class Zero(BaseModel):
    stage: int
    zero_init: bool  # parameters were partitioned as they were created (zero.Init)
    local_param_numel: int  # parameter elements this rank holds after engine init
    total_param_numel: int
    materialised_param_bytes_before_engine: int  # bytes of parameters alive before deepspeed.initialize


class Offload(BaseModel):
    optimizer_class: str
    device_state_bytes: int  # optimizer state (fp32 master, moments) on the accelerator
    host_state_bytes: int  # optimizer state DeepSpeed keeps in host memory


class Probes(BaseModel):
    """Ablations measured inside the worker on the same model, so relative claims are checkable."""

    activation_bytes: int | None = None  # held by a training forward for backward, as configured
    activation_bytes_without_checkpointing: int | None = None
    checkpointing_effective: bool | None = None
    eval_peak_bytes: int | None = None  # an evaluation forward with logits_to_keep as configured
    eval_peak_bytes_all_logits: int | None = None
    eval_logits_bytes: int | None = None
    eval_logits_bytes_all: int | None = None
    train_logits_bytes: int | None = None
    # seconds of timed training forwards and backwards with checkpointing as configured and without it
    # (cases that claim its speed cost; harness.runtime.probe._timed_passes)
    pass_s_with_checkpointing: list[float] | None = None
    pass_s_without_checkpointing: list[float] | None = None
    # probe -> the first line of its out-of-memory error, for the probes that did not fit the card
    # (the run still counts: harness.runtime.probe.run_probes)
    did_not_fit: dict[str, str] = Field(default_factory=dict)
    window: tuple[float, float] | None = None  # wall-clock start and end of the probes (time.time())


class Clocks(BaseModel):
    """The card's SM clock while the steps were timed, sampled with its memory (harness.measure.clocks)."""

    samples: int  # those whose utilization window saw a kernel run; the clock figures are theirs
    # the mean of NVML's utilization over all samples (0-1): the share of the time kernels ran;
    # None in runs from before it was read (2026-11-26), whose `idle` (the GpuIdle bit) never fired
    utilization: float | None = None
    sm_mhz_median: int
    sm_mhz_min: int
    sm_mhz_max: int  # the card's maximum SM clock
    power_limit_w: float | None = None  # the enforced board power limit
    slowed: dict[str, float] = Field(default_factory=dict)  # slowdown reason -> share of the samples


# free memory this far below an emulated card is rounding (the ballast's last block, a context's
# pages), not another process
CARD_SLACK = 64 * 2**20


def short_of(free: int | None, card: int | None) -> bool:
    """Whether `free` bytes at a run's start fall short of an emulated card of `card` bytes."""
    return free is not None and bool(card) and free < card - CARD_SLACK


class Failure(str, Enum):
    oom = "oom"  # device (or emulated card) out of memory
    host_oom = "host_oom"  # killed by the kernel, most likely for host memory
    timeout = "timeout"
    crash = "crash"  # an exception other than OOM
    no_report = "no_report"  # exited 0 without a report
    write_error = "write_error"  # a result could not be written (disk full, read-only or unwritable folder)
    card_busy = "card_busy"  # another harness was measuring the card (harness.runtime.card_lock)


class ErrorInfo(BaseModel):
    kind: Failure
    message: str
    tried_to_allocate: int | None = None
    phase: str | None = None  # load, engine, step, probe


class StackRun(BaseModel):
    """The framework a case trained through (harness.runtime.stacks): its name and version, the trainer
    class that ran, and what the run changed to train on this host (a CPU drops Liger, say)."""

    name: str
    version: str | None = None
    trainer: str | None = None
    notes: list[str] = Field(default_factory=list)


class RankReport(BaseModel):
    case_id: FileName
    fidelity: str
    rank: int
    world_size: int
    process_slot: int = 0  # which of several jobs sharing one card (guide 004)
    platform: str
    device_name: str
    emulated_card_bytes: int | None = None
    context_bytes: int | None = None  # device memory of the CUDA/HIP context, outside the allocator
    # device memory free for this process when it started, its own context counted as free; under an
    # emulated card, less than the card means another process held memory (harness.runtime.measurement)
    card_free_at_start: int | None = None
    load: Memory | None = None
    step: Memory | None = None
    weights: Weights | None = None
    zero: Zero | None = None
    offload: Offload | None = None
    probes: Probes = Field(default_factory=Probes)
    step_times_s: list[float] = Field(default_factory=list)  # wall clock of each step, the warm-up's first
    # the device's own time of each step (CUDA events around it, harness.runtime.train); empty on a CPU and
    # in runs recorded before it was kept
    step_device_s: list[float] = Field(default_factory=list)
    warmup_steps: int = 1
    seq_len: int = 0
    micro_batch: int = 0
    grad_accum: int = 0
    tokens_per_step: NonNegativeInt = 0
    flops_per_token: float | None = None
    losses: list[float] = Field(default_factory=list)
    model_config_used: dict = Field(default_factory=dict)
    # the attention kernel transformers chose for the model ('sdpa', 'eager', ...): the library's
    # default, which changes between versions and models, and moves a step's peak by GiBs
    attn_implementation: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    stack: StackRun | None = None  # the framework that trained, for llamafactory and hf_trainer cases
    triton_cache: str | None = None  # 'cold' or 'warm' where the run used Triton kernels (runtime.compile_cache)
    cpu_threads: int | None = None  # torch's intra-op threads in this process (harness.runtime.launcher.cpu_threads)
    clocks: Clocks | None = None  # the card's SM clock during the timed steps (NVIDIA; harness.measure.clocks)
    host_cpu: str | None = None  # the host CPU's model name
    # HARNESS_INJECT_DELAY as the run had it ('5%', '0.02s': a slowdown made on purpose to measure the
    # checks' power, harness.runtime.train); None in every real measurement
    injected_delay: str | None = None
    # the rank's allocator timeline, a file in the run's folder (harness.measure.timeline); "" when not recorded
    memory_timeline: FileNameOrEmpty = ""
    error: ErrorInfo | None = None

    @field_validator("step_times_s", "step_device_s")
    @classmethod
    def _finite_times(cls, value, info):
        bad = [t for t in value if not math.isfinite(t) or t < 0]
        if bad:
            raise ValueError(f"{info.field_name}: {bad[0]!r} is not a duration; step times are finite seconds >= 0")
        return value

    @property
    def mfu(self) -> float | None:
        from harness.measure.flops import peak_flops

        peak = peak_flops(self.device_name)
        rate = self.tokens_per_s
        if peak is None or rate is None or not self.flops_per_token:
            return None
        return rate * self.flops_per_token / peak

    @property
    def tokens_per_s(self) -> float | None:
        timed = self.step_times_s[self.warmup_steps :]
        median = statistics.median(timed) if timed else 0
        return self.tokens_per_step / median if median > 0 else None

    @property
    def device_step_s(self) -> float | None:
        """The median of the timed steps on the device's clock (CUDA events), None where none was recorded."""
        timed = self.step_device_s[self.warmup_steps :]
        return statistics.median(timed) if timed else None


class CaseRun(BaseModel):
    """A whole case run: all ranks (or all processes sharing a card)."""

    case_id: FileName
    fidelity: str
    variant: FileNameOrEmpty = ""  # '' as written, else how it was measured (harness.spec.variants: '2r8L2ga')
    command: list[str]
    returncode: int | None
    wall_s: float
    ranks: list[RankReport] = Field(default_factory=list)
    error: ErrorInfo | None = None
    log_tail: str = ""
    run_dir: str = ""
    # jobs sharing an emulated card (harness.runtime.ballast): the card's size and the device memory
    # the ballast left them, less than that size where another process held memory
    emulated_card_bytes: int | None = None
    card_free_at_start: int | None = None

    # what identifies the case this run measured (harness.spec.identity), checked by `oom-harness bless`:
    # None in runs recorded before they were kept
    case_digest: str | None = None
    model: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.ranks) and all(r.error is None for r in self.ranks)

    def first_error(self) -> ErrorInfo | None:
        if self.error is not None:
            return self.error
        return next((r.error for r in self.ranks if r.error is not None), None)

    def card_shortfall(self) -> tuple[int, int] | None:
        """(free, emulated) bytes where the card had less memory free at the start than the card it
        emulates (another process held the rest), else None. An out-of-memory error in such a run
        says nothing about the config."""
        found = [(r.card_free_at_start, r.emulated_card_bytes) for r in self.ranks]
        found.append((self.card_free_at_start, self.emulated_card_bytes))
        short = [(free, card) for free, card in found if short_of(free, card)]
        return min(short) if short else None

    def per_card_peak(self, procs_per_card: int) -> int | None:
        """The figure a card must hold: the worst rank for a sharded job (never the sum over
        ranks); the sum of the processes when several independent jobs share one card."""
        peaks = [r.step.limiting() for r in self.ranks if r.step is not None]
        if not peaks:
            return None
        return sum(peaks) if procs_per_card > 1 else max(peaks)

    def per_card_rate(self, procs_per_card: int, attr: str = "tokens_per_s") -> float | None:
        """Tokens/s (or `attr`: mfu) of a card: the slowest rank of a sharded job (its ranks step
        together); the sum of the jobs when several independent jobs share one card, which is the
        card's throughput (the slowest job times their number would understate it, and move with
        whichever job the card's scheduling favoured in that run)."""
        rates = [getattr(r, attr) for r in self.ranks if getattr(r, attr)]
        if not rates:
            return None
        return sum(rates) if procs_per_card > 1 else min(rates)

    def host_peak(self) -> int | None:
        """Host RSS of the worst process, with its dataloader workers (None: nothing was measured).
        Processes on one host add up; `harness.judge.host_ram` multiplies this by the case's processes per node."""
        return max((r.step.host_rss for r in self.ranks if r.step is not None and r.step.host_rss), default=None)
