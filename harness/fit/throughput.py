"""A throughput model good enough to rank configs: predicted tokens/s of a case on its card.

One optimizer step of one process is the sum of the work it waits for, each a count from the case and
its model (`harness.fit.shape`) times a constant:

    t = FLOPs / achieved_flops_per_s                       model FLOPs, recomputation included
      + linear passes x launch_s_per_linear_pass           launch-bound small batches
      + 4-bit linear passes x launch_s_per_4bit_linear_pass
      + GLA layer passes x fla_s_per_layer_pass            flash-linear-attention's Triton kernel chains
      + ZeRO-3 parameter passes x zero3_s_per_param_pass   DeepSpeed's per-parameter fetch and release
      + host-device bytes / pcie_bytes_per_s               offloaded parameters and optimizer state
      + collective bytes / network_bytes_per_s             ZeRO's all-gathers and reductions
      + offloaded trainable parameters / cpu_adam_params_per_s
      + offload_s_per_step (an optimizer step with offloaded optimizer state)

Processes sharing a card share its FLOPs (the compute term is multiplied by their number) and launch
their kernels independently. tokens/s per card = processes x tokens per step / t.

The constants are named data with their priors and provenance (`throughput.json`); `calibrate` fits
them at call time on the tokens/s of results/baselines: non-negative least squares on the step time's
relative error, each prior a weak pseudo-observation so a constant no baseline exercises keeps it.
`benchmarks/bench_throughput.py` reports the error leave-one-out.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from harness.baselines.store import RESULTS_DIR, load_baselines
from harness.fit.shape import ModelShape
from harness.measure.flops import flops_per_token
from harness.spec.cases import CASES_DIR
from harness.spec.schema import Case, Offload

_DATA = json.loads(resources.files(__package__).joinpath("throughput.json").read_text(encoding="utf-8"))
CONSTANTS: dict[str, dict] = _DATA["constants"]
# The terms, in the order of the fitted constants (each term's count is divided or multiplied by it).
TERMS = ("achieved_flops_per_s", "launch_s_per_linear_pass", "launch_s_per_4bit_linear_pass", "fla_s_per_layer_pass",
         "zero3_s_per_param_pass", "pcie_bytes_per_s", "network_bytes_per_s", "cpu_adam_params_per_s",
         "offload_s_per_step")
_RATES = {"achieved_flops_per_s", "pcie_bytes_per_s", "network_bytes_per_s", "cpu_adam_params_per_s"}
PRIOR_WEIGHT = 0.3  # weight of a prior pseudo-observation against one baseline's relative error
HALF = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step of one process waits for, in the units of TERMS."""

    counts: tuple[float, ...]  # per term (TERMS): FLOPs, 4 x passes, bytes, bytes, parameters, steps
    tokens: int  # tokens of one process's optimizer step
    procs_per_card: int


def step_work(case: Case, config: dict, shape: ModelShape | None = None) -> StepWork:
    """The counts of one optimizer step of `case` (one process, the worst rank of a sharded job)."""
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
    half = HALF[case.precision.value]
    world = case.launch.ranks
    trainable = _trainable(case, shape)
    fla = shape.layers * passes if config.get("model_type") == "gla" else 0
    hooks = pcie = net = adam = offload_steps = 0.0
    if ds is not None:
        shard = world if ds.stage >= 1 else 1
        pageable = 1.0 if ds.pin_memory else 1 / CONSTANTS["pageable_copy_factor"]["prior"]
        gathers = (3 if gc else 2) * ga  # ZeRO-3: forward, backward and the recomputed forward gather
        if ds.stage == 3:
            hooks = shape.layers * shape.layer_tensors * gathers
            net += shape.params * half * (world - 1) / world * gathers
            if ds.offload_param == Offload.cpu:
                pcie += shape.params * half / world * gathers * pageable
        if world > 1:  # gradients: reduced every micro step (ZeRO-2/3), once per step otherwise
            net += trainable * half * 2 * (world - 1) / world * (ga if ds.stage >= 2 else 1)
        if ds.offload_optimizer == Offload.cpu:
            adam = trainable / shard
            offload_steps = 1.0
            pcie += trainable / shard * (half + 4) * pageable  # gradients down, updated parameters up
    return StepWork(counts=(flops, linear_passes, four_bit, fla, hooks, pcie, net, adam, offload_steps), tokens=tokens,
                    procs_per_card=procs)


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
    fitted_on: list[str] = field(default_factory=list)  # case ids of the baselines
    notes: list[str] = field(default_factory=list)

    def coefficients(self) -> list[float]:
        return [1 / self.values[k] if k in _RATES else self.values[k] for k in TERMS]

    def seconds(self, work: StepWork) -> dict[str, float]:
        """Seconds per optimizer step, by term."""
        return {k: c * x for k, c, x in zip(TERMS, self.coefficients(), work.counts, strict=True)}

    def tokens_per_s(self, work: StepWork) -> float:
        """Tokens per second per card (every process sharing it)."""
        return work.procs_per_card * work.tokens / max(sum(self.seconds(work).values()), 1e-9)

    def predict(self, case: Case, config: dict) -> float:
        return self.tokens_per_s(step_work(case, config))


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

    @property
    def seconds(self) -> float:
        return self.work.procs_per_card * self.work.tokens / self.tokens_per_s


@lru_cache(maxsize=4)
def observations(root: str = str(RESULTS_DIR), case_dir: str = str(CASES_DIR)) -> tuple[Observation, ...]:
    """Every finished baseline with a tokens/s, the case as measured (its variant applied); mistakes
    (`expect: detected`) left out, as the predictor's calibration leaves them out."""
    from harness.models.source import load_model
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    out = []
    for b in load_baselines(Path(root)):
        rates = [r.tokens_per_s_per_gpu for r in b.runs if r.outcome == "ok" and r.tokens_per_s_per_gpu]
        if not rates:
            continue
        try:
            case = parse_variant(b.variant).apply(load_case(Path(case_dir) / f"{b.case_id}.yaml"))
        except Exception:  # a baseline of a case that no longer exists, or a variant it no longer takes
            continue
        if case.expect.outcome == "detected":
            continue
        work = step_work(case, load_model(case.model).config)
        out.append(Observation(b.case_id, b.variant, b.platform.key, work, statistics.median(rates)))
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


def fit(obs: list[Observation]) -> ThroughputModel:
    """The constants fitted on `obs` (see the module's docstring)."""
    base = prior_model()
    if not obs:
        return base
    priors = base.coefficients()
    # unknowns scaled by their priors (theta_j = prior_j * s_j), so every column is of order one
    rows, target = [], []
    for o in obs:
        rows.append([p * x / o.seconds for p, x in zip(priors, o.work.counts, strict=True)])
        target.append(1.0)
    for j in range(len(TERMS)):
        rows.append([PRIOR_WEIGHT if i == j else 0.0 for i in range(len(TERMS))])
        target.append(PRIOR_WEIGHT)
    scales = _nnls(rows, target)
    values = dict(base.values)
    for k, p, s in zip(TERMS, priors, scales, strict=True):
        coefficient = max(p * s, p * 1e-3)  # never free: a term fitted to zero keeps a thousandth of its prior
        values[k] = 1 / coefficient if k in _RATES else coefficient
    return ThroughputModel(values=values, fitted_on=sorted({o.case_id for o in obs}),
                           notes=[f"throughput constants fitted on the tokens/s of {len(obs)} baselines"])


@lru_cache(maxsize=8)
def calibrate(exclude: frozenset[str] = frozenset(), root: str = str(RESULTS_DIR),
              case_dir: str = str(CASES_DIR)) -> ThroughputModel:
    """The model fitted on every platform's baselines but those of the case ids in `exclude`."""
    return fit([o for o in observations(root, case_dir) if o.case_id not in exclude])
