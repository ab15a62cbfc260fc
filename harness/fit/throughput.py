"""A throughput model good enough to rank configs: predicted tokens/s of a case on its card.

One optimizer step of one process is the sum of the work it waits for, each a count from the case and
its model (`harness.fit.shape`) times a constant:

    t = max(FLOPs / achieved_flops_per_s,                  model FLOPs, recomputation included
            linear passes x launch_s_per_linear_pass       launch-bound small batches: the card computes
          + 4-bit linear passes x launch_s_per_4bit_linear_pass    while the host dispatches, so the
          + GLA layer passes x fla_s_per_layer_pass)               longer of the two counts
      + ZeRO-3 parameter passes x zero3_s_per_param_pass   DeepSpeed's per-parameter fetch and release hooks
      + micro steps x deepspeed_s_per_micro_step           DeepSpeed's engine beside the model
      + pinned host-device bytes / pcie_bytes_per_s        offloaded parameters gathered, gradients down,
      + pageable host-device bytes / pageable_bytes_per_s  updated parameters up
      + CPU Adam's bytes / host_memory_bytes_per_s         host memory bandwidth
      + offloaded parameters / (threads x cpu_adam_params_per_s_per_thread)   CPU Adam's arithmetic
      + collective bytes / network_bytes_per_s             ZeRO's all-gathers and reductions
      + offload_s_per_step                                 an optimizer step with offloaded state

Processes sharing a card share its FLOPs (the compute term is multiplied by their number) and launch
their kernels independently. tokens/s per card = processes x tokens per step / t. ZeRO-3 gathers every
parameter in the forward, the backward and a recomputed forward, except where reentrant checkpointing
of a frozen base keeps the forward's (`_gathers`). CPU Adam's threads are the process's OpenMP threads:
recorded with each baseline run, and for a prediction the case's OMP_NUM_THREADS or the launcher's
share of the host's cores (`harness.fit.platforms`).

The constants are named data with their priors and provenance (`throughput.json`). `calibrate` fits
them at call time on the tokens/s of results/baselines, in two levels: pooled over every platform
(non-negative least squares on the step time's relative error, each prior a weak pseudo-observation so
a constant no baseline exercises keeps it), then per platform on that platform's own baselines with
the pooled values as the priors. A platform without baselines borrows the nearest platform's
constants (the same card family; `harness.fit.platforms.nearest`), its compute rate scaled by the
cards' peak FLOPs, and the model's notes say so. `benchmarks/bench_throughput.py` reports the error
leave-one-case-out, per platform.

Offload is priced by the same terms at any rank count: on one GPU nothing crosses a link, and what is
left is CPU Adam over every trainable parameter (its arithmetic on the process's threads and its 30 bytes
per parameter through host memory), the gradients down and the updated parameters up over PCIe once per
step, and under ZeRO-3 with the parameters offloaded every parameter up over PCIe at each gather (each
forward, backward and recomputed forward). A model remembers which kinds of offloaded job its baselines
measured (`OffloadKind`); `ThroughputModel.unmeasured` says where a prediction is of a kind none of them
is, its price modelled rather than measured.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path

from harness.baselines.store import RESULTS_DIR, load_baselines
from harness.fit.platforms import THREADS_WHEN_UNRECORDED, Host, host, nearest
from harness.fit.shape import ModelShape
from harness.measure.flops import flops_per_token, peak_flops
from harness.predict.constants import HALF_BYTES
from harness.predict.step import liger_applies, reentrant_checkpointing
from harness.spec.cases import CASES_DIR
from harness.spec.schema import Case, Offload

_DATA = json.loads(resources.files(__package__).joinpath("throughput.json").read_text(encoding="utf-8"))
CONSTANTS: dict[str, dict] = _DATA["constants"]
# The terms, in the order of the fitted constants (each term's count is divided or multiplied by it).
TERMS = ("achieved_flops_per_s", "launch_s_per_linear_pass", "launch_s_per_4bit_linear_pass", "fla_s_per_layer_pass",
         "zero3_s_per_param_pass", "deepspeed_s_per_micro_step", "pcie_bytes_per_s", "pageable_bytes_per_s",
         "host_memory_bytes_per_s", "network_bytes_per_s", "cpu_adam_params_per_s_per_thread", "offload_s_per_step")
_RATES = {"achieved_flops_per_s", "pcie_bytes_per_s", "pageable_bytes_per_s", "host_memory_bytes_per_s",
          "network_bytes_per_s", "cpu_adam_params_per_s_per_thread"}
COMPUTE = ("achieved_flops_per_s",)
DISPATCH = ("launch_s_per_linear_pass", "launch_s_per_4bit_linear_pass", "fla_s_per_layer_pass")
# What one platform's fit scales together: the card's compute; its host's dispatch of eager PyTorch
# kernels and Python-side hooks (linear modules, bitsandbytes, ZeRO-3's hooks, DeepSpeed's engine, the
# fixed cost of an offloaded step); flash-linear-attention's Triton launches; PCIe; host memory; the
# link; CPU Adam.
GROUPS = (COMPUTE, ("launch_s_per_linear_pass", "launch_s_per_4bit_linear_pass", "zero3_s_per_param_pass",
                    "deepspeed_s_per_micro_step", "offload_s_per_step"), ("fla_s_per_layer_pass",),
          ("pcie_bytes_per_s", "pageable_bytes_per_s"), ("host_memory_bytes_per_s",), ("network_bytes_per_s",),
          ("cpu_adam_params_per_s_per_thread",))
PRIOR_WEIGHT = float(_DATA["fit"]["prior_weight"]["value"])  # pooled fit: a prior against one baseline's error
PLATFORM_PRIOR_WEIGHT = float(_DATA["fit"]["platform_prior_weight"]["value"])  # a platform's fit, pooled priors
CPU_ADAM_BYTES = float(CONSTANTS["cpu_adam_bytes_per_param"]["prior"])
LIGER_COMPUTE_FACTOR = float(CONSTANTS["liger_compute_factor"]["prior"])


@dataclass(frozen=True)
class OffloadKind:
    """What of an offloaded job its step's price depends on beyond the counts: one rank or several (copies
    alone, or beside collectives), a full fine-tune or adapters (CPU Adam over every parameter or a few),
    the ZeRO stage, and whether the parameters are offloaded too."""

    one_rank: bool
    full: bool
    stage: int
    params: bool

    @staticmethod
    def of(case: Case) -> OffloadKind | None:
        ds = case.deepspeed
        if ds is None or (ds.offload_optimizer != Offload.cpu and ds.offload_param != Offload.cpu):
            return None
        return OffloadKind(one_rank=case.launch.ranks == 1, full=case.method.kind == "full", stage=ds.stage,
                           params=ds.offload_param == Offload.cpu)

    def words(self) -> str:
        what = "the optimizer and the parameters" if self.params else "the optimizer"
        return (f"{'a one-GPU' if self.one_rank else 'a multi-GPU'} {'full fine-tune' if self.full else 'adapter job'}"
                f" under ZeRO-{self.stage} with {what} offloaded")


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step of one process waits for, in the units of TERMS."""

    counts: tuple[float, ...]  # per term (TERMS): FLOPs, passes, bytes, bytes, bytes, parameters / thread, steps
    tokens: int  # tokens of one process's optimizer step
    procs_per_card: int
    threads: int = 1  # the process's CPU threads (CPU Adam)
    compute_factor: float = 1.0  # the compute term's share under Liger's kernels (LIGER_COMPUTE_FACTOR)


def step_work(case: Case, config: dict, shape: ModelShape | None = None, threads: int = 1) -> StepWork:
    """The counts of one optimizer step of `case` (one process, the worst rank of a sharded job) whose
    process runs CPU Adam on `threads` threads."""
    shape = (shape or ModelShape.of(config)).at_depth(case.layers or int(config.get("num_hidden_layers")
                                                                         or ModelShape.of(config).layers))
    t, ds = case.train, case.deepspeed
    micro, seq, ga = t.micro_batch, t.seq_len, t.grad_accum
    tokens = micro * seq * ga
    full = case.method.kind == "full"
    gc = t.gradient_checkpointing
    cfg = dict(config.get("text_config") or config)
    cfg["num_hidden_layers"] = shape.layers
    per_token = flops_per_token(shape.linear_weights, cfg, seq, full)
    if gc:  # the recomputed forward: 2 FLOPs per weight and a third of the attention term
        per_token += 2 * shape.linear_weights + (flops_per_token(0, cfg, seq, True) / 3)
    procs = case.launch.procs_per_card
    flops = per_token * tokens * procs  # processes sharing a card share its FLOPs
    passes = (4 if gc else 3) * ga  # forward 1, backward 2, recomputed forward 1, per micro step
    linear_passes = shape.layers * shape.layer_linears * passes
    four_bit = linear_passes if case.method.kind == "qlora" else 0
    half = HALF_BYTES[case.precision.value]
    world = case.launch.ranks
    trainable = _trainable(case, shape)
    fla = shape.layers * passes if config.get("model_type") == "gla" else 0
    hooks = engine = host_device = host_memory = net = adam = offload_steps = 0.0
    if ds is not None:
        engine = ga
        shard = world if ds.stage >= 1 else 1
        gathers = _gathers(case) * ga
        if ds.stage == 3:
            # DeepSpeed's fetch and release hooks run on every pass; the weights move once per gather
            hooks = shape.layers * shape.layer_tensors * (3 if gc else 2) * ga
            net += shape.params * half * (world - 1) / world * gathers
            if ds.offload_param == Offload.cpu:
                host_device += shape.params * half / world * gathers
        if world > 1:  # gradients: reduced every micro step (ZeRO-2/3), once per step otherwise
            net += trainable * half * 2 * (world - 1) / world * (ga if ds.stage >= 2 else 1)
        if ds.offload_optimizer == Offload.cpu:
            params = trainable / shard
            adam = params / max(1, threads)
            host_memory += params * CPU_ADAM_BYTES
            offload_steps = 1.0
            host_device += params * half * 2  # gradients down, updated parameters up
    pinned = ds is None or ds.pin_memory
    pcie, pageable = (host_device, 0.0) if pinned else (0.0, host_device)
    liger = liger_applies(case, str(config.get("model_type")))
    return StepWork(counts=(flops, linear_passes, four_bit, fla, hooks, engine, pcie, pageable, host_memory, net, adam,
                            offload_steps), tokens=tokens, procs_per_card=procs, threads=threads,
                    compute_factor=LIGER_COMPUTE_FACTOR if liger else 1.0)


def _gathers(case: Case) -> int:
    """ZeRO-3's gathers of every parameter per micro step: forward and backward, and the recomputed
    forward with checkpointing; with reentrant checkpointing of a frozen base (LoRA, QLoRA) the
    forward's gathered weights stay on the card through the recompute and the backward (measured on
    guide 000: the step peak grows by a whole layer's weights per layer, docs/findings.md), so one."""
    if not case.train.gradient_checkpointing:
        return 2
    if case.method.kind != "full" and reentrant_checkpointing(case):
        return 1
    return 3


def _trainable(case: Case, shape: ModelShape) -> int:
    """Trainable parameters: every one for a full fine-tune; LoRA's A and B of each targeted linear."""
    if case.method.kind == "full":
        return shape.params
    lora = case.method.lora
    targets = shape.layer_linears if lora.targets == "all" else min(len(lora.targets), shape.layer_linears)
    return shape.layers * targets * lora.r * 2 * shape.hidden


@dataclass
class ThroughputModel:
    values: dict[str, float]  # the constants (TERMS and the unfitted ones)
    platform: str | None = None  # the platform the constants are for; None: pooled over every platform
    source: str = "priors"  # 'own' (fitted on its baselines), 'borrowed from <platform>', 'pooled' or 'priors'
    host: Host = field(default_factory=lambda: host(None))  # whose cores give CPU Adam its threads
    fitted_on: list[str] = field(default_factory=list)  # case ids of the baselines
    notes: list[str] = field(default_factory=list)
    offload_measured: frozenset[OffloadKind] = frozenset()  # the offloaded kinds of job among those baselines

    def unmeasured(self, case: Case) -> str | None:
        """Where `case` offloads and no baseline the constants were fitted on is its kind of offloaded job
        (`OffloadKind`): a sentence saying its tokens/s are modelled, not measured. None otherwise."""
        kind = OffloadKind.of(case)
        if kind is None or kind in self.offload_measured:
            return None
        whose = f"{self.platform}'s baselines" if self.source == "own" or self.source.startswith("borrowed") \
            else "the baselines"
        return (f"tokens/s modelled, not measured: none of {whose} is {kind.words()}; its CPU Adam, host memory "
                "and PCIe copies are priced with constants fitted on other kinds of job")

    def coefficients(self) -> list[float]:
        return [1 / self.values[k] if k in _RATES else self.values[k] for k in TERMS]

    def seconds(self, work: StepWork) -> dict[str, float]:
        """Seconds per optimizer step, by term. The card computes while the host dispatches the next
        kernels, so of the two only the longer counts (the other is 0 here): small batches are bound
        by their kernel launches, large ones by FLOPs."""
        terms = self.seconds_unhidden(work)
        for k in hidden(terms):
            terms[k] = 0.0
        return terms

    def seconds_unhidden(self, work: StepWork) -> dict[str, float]:
        terms = {k: c * x for k, c, x in zip(TERMS, self.coefficients(), work.counts, strict=True)}
        for k in COMPUTE:
            terms[k] *= work.compute_factor
        return terms

    def tokens_per_s(self, work: StepWork) -> float:
        """Tokens per second per card (every process sharing it)."""
        return work.procs_per_card * work.tokens / max(sum(self.seconds(work).values()), 1e-9)

    def work(self, case: Case, config: dict) -> StepWork:
        """The step's counts, CPU Adam on the threads this model's host gives each of `case`'s processes."""
        return step_work(case, config, threads=self.host.threads(case))

    def predict(self, case: Case, config: dict) -> float:
        return self.tokens_per_s(self.work(case, config))


def hidden(terms: dict[str, float]) -> tuple[str, ...]:
    """The terms hidden behind the others: the shorter of compute and dispatch."""
    compute, dispatch = sum(terms[k] for k in COMPUTE), sum(terms[k] for k in DISPATCH)
    return COMPUTE if compute < dispatch else DISPATCH


def prior_model() -> ThroughputModel:
    return ThroughputModel(values={k: float(v["prior"]) for k, v in CONSTANTS.items()},
                           notes=["throughput constants at their priors (no baseline to fit on)"])


# --- calibration ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """One baseline's median tokens/s per card and the work of its step."""

    case_id: str
    variant: str
    platform: str
    work: StepWork
    tokens_per_s: float
    offload: OffloadKind | None = None

    @property
    def seconds(self) -> float:
        return self.work.procs_per_card * self.work.tokens / self.tokens_per_s


def _threads(runs) -> int:
    """The CPU threads per process of a baseline's runs: the most common recorded count, or the count of
    a run that predates the launcher's thread rule (`platforms.json`, thread_rule)."""
    recorded = Counter(r.cpu_threads for r in runs if r.cpu_threads)
    return recorded.most_common(1)[0][0] if recorded else THREADS_WHEN_UNRECORDED


@lru_cache(maxsize=4)
def observations(root: str = str(RESULTS_DIR), case_dir: str = str(CASES_DIR)) -> tuple[Observation, ...]:
    """Every finished baseline with a tokens/s, the case as measured (its variant applied); mistakes
    (`expect: detected`) left out, as the predictor's calibration leaves them out, and runs on a cold
    Triton cache (their timed steps still compile and autotune kernels: guide 004's plan A ran 34%
    under its warm runs, docs/findings.md)."""
    from harness.models.source import load_model
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    out = []
    for b in load_baselines(Path(root)):
        runs = [r for r in b.runs if r.outcome == "ok" and r.tokens_per_s_per_gpu and r.triton_cache != "cold"]
        if not runs:  # none finished, or every one compiled and autotuned its Triton kernels in its timed steps
            continue
        try:
            case = parse_variant(b.variant).apply(load_case(Path(case_dir) / f"{b.case_id}.yaml"))
        except Exception:  # a baseline of a case that no longer exists, or a variant it no longer takes
            continue
        if case.expect.outcome == "detected":
            continue
        work = step_work(case, load_model(case.model).config, threads=_threads(runs))
        out.append(Observation(b.case_id, b.variant, b.platform.key, work,
                               statistics.median(r.tokens_per_s_per_gpu for r in runs), OffloadKind.of(case)))
    return tuple(out)


def _nnls(a: list[list[float]], b: list[float], iterations: int = 200) -> list[float]:
    """Non-negative least squares (Lawson and Hanson's active set)."""
    import numpy as np

    A, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = A.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(iterations):
        w = A.T @ (y - A @ x)
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            ratio = np.where(passive & (z <= 0), x / np.maximum(x - z, 1e-300), np.inf)
            alpha = float(min(ratio.min(), 1.0))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return [float(v) for v in x]


def fit(obs: list[Observation], prior: ThroughputModel | None = None, weight: float = PRIOR_WEIGHT,
        columns: tuple[tuple[str, ...], ...] = tuple((k,) for k in TERMS)) -> ThroughputModel:
    """The constants fitted on `obs`, each column of `columns` (terms scaled together) a pseudo-observation
    of `weight` at `prior`'s values (throughput.json's priors by default; see the module's docstring).
    Which of compute and dispatch each baseline waits for depends on the constants, so the fit repeats
    until no baseline changes sides."""
    base = prior or prior_model()
    if not obs:
        return base
    priors = dict(zip(TERMS, base.coefficients(), strict=True))
    model, sides = base, None
    for _ in range(8):
        now = [hidden(model.seconds_unhidden(o.work)) for o in obs]
        if now == sides:
            break
        sides = now
        # unknowns: each column's scale of its priors (theta_j = prior_j * s_col), every column of order one
        rows, target = [], []
        for o, off in zip(obs, sides, strict=True):
            per_term = {k: 0.0 if k in off else priors[k] * x / o.seconds
                        for k, x in zip(TERMS, o.work.counts, strict=True)}
            rows.append([sum(per_term[k] for k in col) for col in columns])
            target.append(1.0)
        for j in range(len(columns)):
            rows.append([weight if i == j else 0.0 for i in range(len(columns))])
            target.append(weight)
        values = dict(base.values)
        for col, scale in zip(columns, _nnls(rows, target), strict=True):
            for k in col:
                coefficient = max(priors[k] * scale, priors[k] * 1e-3)  # a term fitted to zero keeps a thousandth
                values[k] = 1 / coefficient if k in _RATES else coefficient
        model = replace(base, values=values)
    return replace(model, fitted_on=sorted({o.case_id for o in obs}),
                   offload_measured=frozenset(o.offload for o in obs if o.offload is not None),
                   notes=[f"throughput constants fitted on the tokens/s of {len(obs)} baselines"])


@lru_cache(maxsize=64)
def _pooled(exclude: frozenset[str], root: str, case_dir: str) -> ThroughputModel:
    obs = [o for o in observations(root, case_dir) if o.case_id not in exclude]
    model = fit(obs)
    return replace(model, source="pooled" if obs else "priors",
                   notes=[f"throughput constants pooled over every platform: fitted on the tokens/s of {len(obs)} "
                          "baselines"] if obs else model.notes)


@lru_cache(maxsize=64)
def calibrate(exclude: frozenset[str] = frozenset(), platform: str | None = None, root: str = str(RESULTS_DIR),
              case_dir: str = str(CASES_DIR)) -> ThroughputModel:
    """The model for `platform`, fitted on the baselines but those of the case ids in `exclude`: its own
    constants where it has baselines, the nearest platform's of its card family where it has none
    (said in the notes), the pooled constants where no platform of its family has any or none is named."""
    pooled = _pooled(exclude, root, case_dir)
    if platform is None:
        return replace(pooled, notes=[*pooled.notes, "no platform named: the pooled constants"])
    obs = [o for o in observations(root, case_dir) if o.case_id not in exclude]
    measured = {o.platform for o in obs}
    near = nearest(platform, measured)
    if near is None:
        return replace(pooled, platform=platform, host=host(platform),
                       notes=[*pooled.notes, f"no baseline of {platform} or of its card family: the pooled constants"])
    own = [o for o in obs if o.platform == near]
    model = replace(fit(own, prior=pooled, weight=PLATFORM_PRIOR_WEIGHT, columns=GROUPS), platform=near, source="own",
                    host=host(near))
    model.notes = [f"throughput constants of {near}: fitted on the tokens/s of its {len(own)} baselines, the pooled "
                   f"constants ({len(obs)} baselines) as priors"]
    if near == platform:
        return model
    values = dict(model.values)
    theirs, ours = peak_flops(near.replace("-", " ")), peak_flops(platform.replace("-", " "))
    note = f"{platform} has no baseline: borrowed from {near} (the same card family)"
    if theirs and ours and theirs != ours:
        values["achieved_flops_per_s"] *= ours / theirs
        note += f", the compute rate scaled by the cards' peak FLOPs ({ours / 1e12:.0f} against {theirs / 1e12:.0f} T)"
    return replace(model, values=values, platform=platform, source=f"borrowed from {near}", host=host(platform),
                   notes=[*model.notes, note])
