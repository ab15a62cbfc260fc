"""Baselines: measured figures of full-size runs, kept as data per platform, with provenance.

`oom-harness bless RUNS.json` turns the JSON of `oom-harness run --fidelity real --json` into one
file per case under results/baselines/<platform>/. A platform is the card, how many, and the
software that measured (driver, torch and CUDA/ROCm, transformers, peft, DeepSpeed, bitsandbytes).
Nothing measured is ever pasted into code: comparisons read these files.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import statistics
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from harness.report import CaseRun, Clocks

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results" / "baselines"


class PlatformInfo(BaseModel):
    device_name: str
    device_count: int
    driver: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of_run(cls, run: CaseRun, driver: str | None = None) -> PlatformInfo:
        """The platform a run measured on: its card, how many ranks it used, its software."""
        first = run.ranks[0]
        return cls(device_name=first.device_name, device_count=max(r.world_size for r in run.ranks),
                   driver=driver or first.versions.get("driver"), versions=first.versions)

    @property
    def key(self) -> str:
        name = re.sub(r"[^a-z0-9]+", "-", self.device_name.lower()).strip("-")
        return f"{name}-x{self.device_count}"


class Figures(BaseModel):
    """Bytes and rates of one run. The per-card peak is the device's own figure where known; it and
    the card's tokens/s and MFU are the worst rank's of a sharded job and the sum of the jobs
    sharing a card (`CaseRun.per_card_peak`, `CaseRun.per_card_rate`)."""

    per_card_peak: int | None
    allocated_peak: int | None
    reserved_peak: int | None
    load_footprint: int | None
    host_peak: int | None = None  # host RSS of the worst rank (with its dataloader workers)
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    step_times_s: list[float]
    outcome: str  # ok, or the failure kind (oom, crash, timeout)
    failure: str | None = None
    triton_cache: str | None = None  # 'cold' or 'warm' for runs that compiled Triton kernels (harness.compile_cache)
    cpu_threads: int | None = None  # OMP threads per process (harness.launcher.cpu_threads); speed depends on it
    clocks: Clocks | None = None  # the slowest card's SM clock during the timed steps (harness.gpu_clocks)
    host_cpu: str | None = None  # the host CPU's model name; speed depends on it
    recorded: str | None = None  # the day of this repetition, where it differs from the baseline's (bless --append)


class Baseline(BaseModel):
    case_id: str
    variant: str = ""  # '' as the case is written; '2r', '8L', '2r8L' (harness.variants)
    platform: PlatformInfo
    emulated_card_bytes: int | None
    measured: str  # how: "full depth", "2 of 8 ranks, 8 of 64 layers" (harness.variants.Variant.label)
    steps: int
    runs: list[Figures]  # one per repetition
    recorded: str
    note: str = ""

    def values(self, attr: str) -> list[float]:
        """One figure over the repetitions that have it."""
        return [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]


def spread(values: list[float]) -> tuple[float, float]:
    """(median, largest relative deviation from it) of repeated measurements of one figure."""
    mid = statistics.median(values)
    return mid, (max(abs(v - mid) for v in values) / mid if mid else 0.0)


def figures_of(run: CaseRun, procs_per_card: int) -> Figures:
    ranks = run.ranks
    err = run.first_error()
    steps = [r for r in ranks if r.step is not None]
    return Figures(
        per_card_peak=run.per_card_peak(procs_per_card),
        allocated_peak=max((r.step.allocated for r in steps), default=None),
        reserved_peak=max((r.step.reserved or 0 for r in steps), default=None) or None,
        load_footprint=max((r.load.limiting() for r in ranks if r.load), default=None),
        host_peak=run.host_peak(),
        tokens_per_s_per_gpu=run.per_card_rate(procs_per_card),
        mfu=run.per_card_rate(procs_per_card, "mfu"),
        step_times_s=ranks[0].step_times_s if ranks else [],
        outcome="ok" if err is None else err.kind.value,
        failure=None if err is None else err.message.strip().splitlines()[-1][:400] if err.message else None,
        triton_cache=next((c for c in ("cold", "warm") if any(r.triton_cache == c for r in ranks)), None),
        cpu_threads=max((r.cpu_threads for r in ranks if r.cpu_threads), default=None),
        clocks=min((r.clocks for r in ranks if r.clocks), key=lambda c: c.sm_mhz_median, default=None),
        host_cpu=next((r.host_cpu for r in ranks if r.host_cpu), None),
    )


class BlessError(ValueError):
    """A runs file that cannot be blessed, or runs that would mix software stacks in one baseline."""


def read_runs(paths: list[Path]) -> list[CaseRun]:
    """The runs in `oom-harness run --json` files, in `run.json` files (one run each), and in every
    `run.json` below a folder (`pytest --harness-run-dir`, `oom-harness run --out`), in that order."""
    runs = []
    for path in map(Path, paths):
        files = sorted(path.rglob("run.json")) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise BlessError(f"{path}: no run.json below this folder; name a run folder or a `run --json` file")
        for f in files:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                raise BlessError(f"{f}: cannot be read as JSON ({exc})") from exc
            entries = data if isinstance(data, list) else [{"run": data}]
            for i, entry in enumerate(entries):
                try:
                    runs.append(CaseRun.model_validate(entry["run"]))
                except (KeyError, TypeError, ValidationError) as exc:
                    where = f"entry {i}" if isinstance(data, list) else "its content"
                    raise BlessError(f"{f}: {where} is not a run of `oom-harness run --json` or a run.json "
                                     f"({str(exc).splitlines()[0]})") from exc
    return runs


def bless(runs_json: Path | list[Path], driver: str | None = None, root: Path = RESULTS_DIR, note: str = "",
          recorded: str | None = None, append: bool = False) -> list[Path]:
    """Write or refresh the baselines of every full-size run in `runs_json` (see `read_runs`).
    Repeated runs of a case in them become repetitions of one baseline. With `append`, they are
    added to the repetitions a baseline already has (runs of another day or another host of the same
    platform), so the spread the tolerances derive from covers them all."""
    from harness.cases import CASES_DIR, load_case
    from harness.variants import parse_variant

    day = recorded or dt.date.today().isoformat()
    by_case: dict[tuple[str, str], list[CaseRun]] = {}
    for run in read_runs([runs_json] if isinstance(runs_json, (str, Path)) else runs_json):
        if run.fidelity != "real" or not run.ranks:
            continue
        by_case.setdefault((run.case_id, run.variant), []).append(run)
    baselines: dict[Path, Baseline] = {}
    for (case_id, variant), runs in by_case.items():
        case = load_case(CASES_DIR / f"{case_id}.yaml")
        first = runs[0].ranks[0]
        platform = PlatformInfo.of_run(runs[0], driver)
        v = parse_variant(variant)
        figures = [figures_of(r, case.launch.procs_per_card) for r in runs]
        path = root / platform.key / f"{case_id}{v.suffix}.json"
        if append and path.exists():
            baselines[path] = _appended(Baseline.model_validate_json(path.read_text()),
                                        platform, figures, day, note, path)
            continue
        baselines[path] = Baseline(
            case_id=case_id, variant=variant, platform=platform, emulated_card_bytes=first.emulated_card_bytes,
            measured=v.label(case), steps=len(first.step_times_s) or 0, runs=figures, recorded=day, note=note,
        )
    for path, baseline in baselines.items():  # written only once every run was accepted
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(baseline.model_dump_json(indent=1) + "\n")
    return list(baselines)


def _appended(old: Baseline, platform: PlatformInfo, figures: list[Figures], day: str, note: str,
              path: Path) -> Baseline:
    """`old` with `figures` as further repetitions, each dated; refused across software stacks. A
    version the baseline did not record (runs before the worker recorded it) is not a difference:
    it is taken from these runs, and the note says so."""
    before = {**old.platform.versions, "driver": old.platform.driver}
    after = {**platform.versions, "driver": platform.driver}
    differ = sorted(k for k in before.keys() | after.keys()
                    if before.get(k) is not None and before.get(k) != after.get(k))
    if differ:
        pairs = ", ".join(f"{k} {before.get(k)} -> {after.get(k)}" for k in differ)
        raise BlessError(f"{path}: these runs differ from the baseline's software ({pairs}); a spread across "
                         f"stacks is not noise. Bless without --append to replace the baseline.")
    unrecorded = sorted(k for k in after if before.get(k) is None and after[k] is not None)
    if unrecorded:
        first = ", ".join(f"{k} {after[k]}" for k in unrecorded)
        note = f"{note + '; ' if note else ''}first recorded with these runs: {first}"
        old = old.model_copy(update={"platform": old.platform.model_copy(update={
            "driver": old.platform.driver or platform.driver,
            "versions": {**platform.versions, **old.platform.versions}})})
    for f in old.runs:
        f.recorded = f.recorded or old.recorded
    for f in figures:
        f.recorded = day
    added = f"{day}: {note}" if note else f"{day}: {len(figures)} more repetition(s)"
    return old.model_copy(update={"runs": [*old.runs, *figures], "recorded": day,
                                  "note": f"{old.note}\n{added}" if old.note else added})


def load_baselines(root: Path = RESULTS_DIR) -> list[Baseline]:
    return [Baseline.model_validate_json(p.read_text()) for p in sorted(root.glob("*/*.json"))]


def report_markdown(baselines: list[Baseline]) -> str:
    """One row per baseline: target card, measured peaks, headroom, speed, and the guide's
    memory claims beside the measurement."""
    from harness.cases import CASES_DIR, load_case
    from harness.host_ram import node_text
    from harness.units import fmt_gib
    from harness.variants import parse_variant
    from harness.verdicts import WHOLE_CARD_CLAIMS

    lines = [
        ("| case | measured on | target card (budget) | outcome "
         "| peak allocated / reserved (worst process) / device (per card) | headroom "
         "| host RAM per node (processes x worst process) | tokens/s/GPU | MFU | guide's claims vs measured |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in baselines:
        case = load_case(CASES_DIR / f"{b.case_id}.yaml")
        r = b.runs[0]
        budget = case.budget_bytes
        head = "-" if r.per_card_peak is None else f"{(budget - r.per_card_peak) / 2**30:+.2f} GiB"
        peaks = " / ".join(fmt_gib(x) for x in (r.allocated_peak, r.reserved_peak, r.per_card_peak))
        if r.outcome != "ok":
            peaks += " (at the failure)"
        if r.triton_cache:
            peaks += f" ({r.triton_cache} Triton cache)"
        claims = []
        for c in case.claims:
            if c.kind != "memory_range":
                continue
            if c.metric == "usage_fraction":
                value = r.per_card_peak / case.target.card.memory if r.per_card_peak else None
                got = "-" if value is None else f"{value:.0%}"
                want = f"{c.low:.0%}-{c.high:.0%}"
            else:
                value = r.load_footprint if c.metric == "load_footprint" else r.per_card_peak
                got = fmt_gib(value)
                want = f"{c.low / 2**30:.0f}-{c.high / 2**30:.0f} GiB"
            ok = value is not None and c.low <= value <= c.high and r.outcome == "ok"
            mark = "(holds)" if ok else ("(refuted, as recorded)" if c.finding else "(refuted)")
            claims.append(f"{c.metric} {want}: {got} {mark}")
        verdict = r.outcome if r.outcome != "ok" else "fits"
        mark = _against_guide(case, verdict)
        rate = "-" if r.tokens_per_s_per_gpu is None else f"{r.tokens_per_s_per_gpu:,.0f}"
        mfu = "-" if r.mfu is None else f"{r.mfu:.1%}"
        where = f"{b.platform.device_name} x{b.platform.device_count}, {b.measured}"
        card = f"{case.target.card.name} ({fmt_gib(budget)})"
        # a shallower depth says nothing of the node: its extrapolation below does
        variant = parse_variant(b.variant)
        host = "-" if variant.layers else node_text(case, r.host_peak)
        if variant.uncapped:
            # measured for the claims that compare configs: its target card's verdict is in the
            # case's own row, and the headroom says how far the whole-card peak overshoots it
            judged = sorted({c.kind for c in case.claims if c.kind in WHOLE_CARD_CLAIMS})
            claims = [f"{', '.join(judged)}: judged on this run"] if judged else []
            verdict = "trains" if r.outcome == "ok" else r.outcome
            mark = "on the whole card: no verdict on its target"
        elif case.expect.outcome == "detected":
            # what the mistake costs, measured; whether it was detected is the run's verdict. Its
            # variant is a single depth (a mistake shows at any depth), so nothing is extrapolated.
            verdict = "trains" if r.outcome == "ok" else r.outcome
            mark, claims = f"the mistake to detect: {case.expect.detect}", []
        elif b.variant:
            claims, mark = ["stated for the case as written: see the extrapolation below"], "a measured variant"
        lines.append(f"| {b.case_id} | {where} | {card} | {verdict} ({mark}) | {peaks} | {head} | {host} | {rate} | "
                     f"{mfu} | {'; '.join(claims) or '-'} |")
    extra = extrapolation_markdown(baselines)
    return "\n".join(lines) + ("\n\n" + extra if extra else "")


def _against_guide(case, outcome: str, carries: bool = True) -> str:
    """A measured (or extrapolated) outcome beside the case's expectation, and its recorded finding.
    `carries` is False for an excess measured on fewer ranks, which says nothing of the case."""
    expected = case.expect.outcome
    if not carries:
        return "inconclusive on fewer ranks"
    if outcome == expected:
        return "as expected"
    if case.expect.finding:
        return f"the guide says {expected}: refuted, as recorded"
    return f"expected {expected}"


def extrapolation_markdown(baselines: list[Baseline]) -> str:
    """Depth fits of the measured variants: the full-depth figures they predict, labelled as
    extrapolated, the full-depth measurement beside them where one exists, and the margin the
    model's full-depth check adds before a fit is judged."""
    from harness.extrapolate import every_fit
    from harness.host_ram import node_text
    from harness.regression import MEMORY_FLOOR
    from harness.units import fmt_gib
    from harness.variants import parse_variant

    rows = []
    for case, e in every_fit(baselines):
        peak = e.values.get("per_card_peak")
        budget = case.budget_bytes
        judged = e.peak_with_margin() if case.expect.outcome == "fits" else peak
        verdict = "-"
        if judged is not None:
            fits = judged <= budget
            fewer_ranks = parse_variant(e.base_variant).fewer_ranks(case)
            mark = _against_guide(case, "fits" if fits else "oom", carries=fits or not fewer_ranks)
            verdict = f"{'fits' if fits else 'exceeds the budget'} ({mark})"
        check = "-"
        m = e.measured_full_depth
        if m is not None and m.outcome == "ok":
            check = f"peak {fmt_gib(m.per_card_peak)} (fit {e.error('per_card_peak'):+.1%})"
            if e.error("host_peak") is not None:
                check += f"; host {fmt_gib(m.host_peak)} (fit {e.error('host_peak'):+.1%})"
            if m.tokens_per_s_per_gpu and e.tokens_per_s:
                check += (f"; {m.tokens_per_s_per_gpu:,.0f} tokens/s "
                          f"(fit {e.tokens_per_s / m.tokens_per_s_per_gpu - 1:+.0%})")
        elif m is not None:
            check = (f"measured: {m.outcome} at {fmt_gib(m.per_card_peak)} "
                     f"on the {fmt_gib(case.target.card.memory)} card")
        line = e.lines.get("per_card_peak")
        per_layer = "-" if line is None else (
            f"flat (within {MEMORY_FLOOR:.0%})" if line.flat else f"{line.slope / 2**30:.3f} GiB")
        margin = "-" if peak is None else (
            f"{fmt_gib(e.peak_with_margin())} (+{e.margin:.1%}, {e.check.case_id})" if e.check else "none (unchecked)")
        rate = "-" if e.tokens_per_s is None else f"{e.tokens_per_s:,.0f}"
        if e.tokens_per_s is None and any(r.startswith("step time") for r in e.rejected):
            rate = "- (step time falls with depth)"
        host = node_text(case, e.values.get("host_peak"))
        rows.append(f"| {case.id} | {e.platform_key}, variant {e.base_variant or 'as written'} | {e.label} | "
                    f"{fmt_gib(peak)} | {per_layer} | {margin} | {host} | {rate} | {fmt_gib(budget)}: {verdict} | "
                    f"{check} |")
    if not rows:
        return ""
    intro = ("Depth extrapolations (extrapolated figures, not measurements). A fit is judged with the margin "
             "its model's full-depth check found (the worst shortfall of an extrapolation against a full-depth "
             "measurement of the same model); an expected OOM without it.")
    columns = ("case", "measured on", "extrapolation", "per-card peak at full depth", "per layer",
               "with the full-depth margin", "host RAM per node (processes x worst rank)", "tokens/s/GPU", "budget",
               "full-depth check")
    head = [intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(head + rows)
