"""The pre-merge check: does a training config still fit its cards? CPU only, seconds.

    oom-harness check CONFIG [--deepspeed DS.json] --gpu-memory 64GiB --gpus 8 [--procs-per-gpu 2] [--json]

Import the config (`harness.premerge.importers`), predict its per-GPU peaks at full size (`harness.predict.predictor`),
lint it (`harness.premerge.lints`), and judge: it fits when the predicted device peak of every process on a
card, summed, plus the prediction's margin (`harness.predict.margin.fit_verdict`, the one verdict every
caller uses), stays within the card's memory times the headroom, and (with --host-ram) the node's
predicted host RAM within its usable share of the host. A prediction that could not size part of
the job (`Prediction.missing`) is UNDECIDED, never FITS; so is a config with a key read but not modelled
that can raise the peak (`ImportedConfig.not_modelled`), and one that can only lower it makes a
DOES NOT FIT undecided (FITS holds). Each such key is named in the output. Exit codes: 0 fits and no lint of
severity error; 1 it does not fit, is undecided, or an error lint fired; 2 bad input (one message, no traceback);
3 the predictor failed on a config it should size (harness.cli.main logs the traceback).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.predict.margin import FitVerdict, fit_verdict
from harness.premerge.importers import ConfigError, ImportedConfig, JobSpec, import_config
from harness.premerge.lints import Lint, lint
from harness.spec.units import fmt_gib, gib_rounded

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class CheckResult:
    config: ImportedConfig
    prediction: Any | None  # harness.predict.predictor.Prediction; None where the config is outside the predictor
    lints: tuple[Lint, ...]

    @property
    def budget(self) -> int:
        """What one card may hold: its memory times the headroom."""
        return int(self.config.gpu_memory * self.config.headroom)

    @property
    def card_peak(self) -> int | None:
        """The predicted device peak of one card: every process sharing it, summed."""
        return None if self.fit is None else self.fit.predicted

    @property
    def fit(self) -> FitVerdict | None:
        """The card's predicted peak and its margin against the budget (None: nothing predicted)."""
        p, c = self.prediction, self.config
        if p is None:
            return None
        raising = [n.line() for n in c.not_modelled if n.raises]
        verdict = fit_verdict(p.device, p.margin, gpu_memory=c.gpu_memory, headroom=c.headroom,
                              procs_per_gpu=c.procs_per_gpu, missing=list(p.missing) + raising)
        lowering = [n.line() for n in c.not_modelled if not n.raises]
        if verdict.decided and not verdict.fits and lowering:  # it may fit once what they save is counted
            verdict = fit_verdict(p.device, p.margin, gpu_memory=c.gpu_memory, headroom=c.headroom,
                                  procs_per_gpu=c.procs_per_gpu, missing=list(p.missing) + raising + lowering)
        return verdict

    @property
    def case_fits(self) -> bool | None:
        """The verdict on the case a config becomes (`case-from`): the prediction's alone, as the case does
        not hold the keys read but not modelled (its notes name them)."""
        p, c = self.prediction, self.config
        if p is None:
            return None
        alone = fit_verdict(p.device, p.margin, gpu_memory=c.gpu_memory, headroom=c.headroom,
                            procs_per_gpu=c.procs_per_gpu, missing=p.missing)
        return alone.fits and self.host_fits is not False

    @property
    def node_host_ram(self) -> int | None:
        """The predicted host RAM of the node with every card busy."""
        return None if self.prediction is None else self.config.node_host_ram(self.prediction.host_ram)

    @property
    def host_ram_limit(self) -> int | None:
        """What the node's training processes may hold of the host's RAM (--host-ram), if it is known."""
        if self.config.host_ram is None:
            return None
        from harness.judge.host_ram import HOST_RAM_FRACTION  # the judge's verdict modules: only where it is given

        return int(self.config.host_ram * HOST_RAM_FRACTION)

    @property
    def host_fits(self) -> bool | None:
        """The node's predicted host RAM within its share of the host; None where the host is not given."""
        if self.host_ram_limit is None or self.node_host_ram is None:
            return None
        return self.node_host_ram <= self.host_ram_limit

    @property
    def fits(self) -> bool | None:
        """The card peak plus its margin within the budget, and the host RAM within the host's share where
        it is given."""
        return None if self.fit is None else self.fit.fits and self.host_fits is not False

    @property
    def errors(self) -> list[Lint]:
        return [f for f in self.lints if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return bool(self.fits) and not self.errors

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_FAIL

    @property
    def verdict(self) -> str:
        if self.fits is None:
            return "NOT PREDICTED: " + (self.config.unpredictable or "no prediction")
        if not self.fit.decided:
            return f"UNDECIDED ({self.fit.summary()})"
        head = ("FITS" if self.fits else "DOES NOT FIT") + f" ({self.fit.summary()})"
        if self.host_fits is False:
            head += (f" (host RAM: {fmt_gib(self.node_host_ram)} predicted on the node, "
                     f"{fmt_gib(self.host_ram_limit)} usable of {fmt_gib(self.config.host_ram)})")
        return head + (f", but {len(self.errors)} lint error(s)" if self.errors and self.fits else "")


PredictFn = Callable[..., Any]


def _predictor() -> PredictFn:
    try:
        from harness.predict.predictor import predict
    except ImportError as exc:
        raise ConfigError(None, None, f"the predictor is not available ({exc})",
                          "install the harness with its predictor (harness/predict/predictor.py)") from None
    return predict


def run_check(path: Path | str, spec: JobSpec, *, platform: str | None = None,
              predict: PredictFn | None = None) -> CheckResult:
    """Import, predict, lint. Raises ConfigError on bad input."""
    imported = import_config(path, spec)
    prediction = None
    if imported.case is not None:
        predict = predict or _predictor()
        # A config that imported is valid input: the predictor failing on it is the harness's error
        # (exit 3, its traceback logged by the command line), not the user's.
        with warnings.catch_warnings():  # library deprecation chatter from the traced model code
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            prediction = predict(imported.case, imported.arch, platform=platform)
    return CheckResult(config=imported, prediction=prediction, lints=tuple(lint(imported, prediction)))


# --- Rendering ----------------------------------------------------------------------------------


def as_json(result: CheckResult) -> dict[str, Any]:
    c, p = result.config, result.prediction
    return {
        "fits": result.fits,
        "decided": result.fit.decided if result.fit else None,
        "missing": list(result.fit.missing) if result.fit else [],
        "ok": result.ok,
        "verdict": result.verdict,
        "peak_allocated_gib": gib_rounded(p.allocated if p else None),
        "peak_reserved_gib": gib_rounded(p.reserved if p else None),
        "device_peak_gib": gib_rounded(p.device if p else None),
        "card_peak_gib": gib_rounded(result.card_peak),
        "margin_gib": gib_rounded(result.fit.margin if result.fit else None),
        "margin_fraction": round(p.margin.fraction, 4) if p else None,
        "margin_basis": p.margin.describe() if p else None,
        "card_peak_with_margin_gib": gib_rounded(result.fit.needed if result.fit else None),
        "host_ram_gib": gib_rounded(p.host_ram if p else None),
        "host_ram_node_gib": gib_rounded(result.node_host_ram),
        "node_processes": result.config.node_processes,
        "host_ram_available_gib": gib_rounded(c.host_ram),
        "host_ram_fits": result.host_fits,
        "gpu_memory_gib": gib_rounded(c.gpu_memory),
        "budget_gib": gib_rounded(result.budget),
        "headroom_gib": gib_rounded(result.fit.headroom if result.fit else None),
        "headroom_fraction": c.headroom,
        "gpus": c.gpus,
        "procs_per_gpu": c.procs_per_gpu,
        "world_size": c.world_size,
        "launcher": c.launcher,
        "model": c.arch.name,
        "files": [str(s) for s in c.sources],
        "format": c.training.format.value,
        "lints": [f.as_dict() for f in result.lints],
        "not_modelled": [n.as_dict() for n in c.not_modelled],
        "notes": list(c.notes) + (list(p.notes) if p else []),
        "calibrated_on": list(p.calibrated_on) if p else [],
        "platform": p.platform if p else None,
    }


def table(result: CheckResult) -> str:
    c, p = result.config, result.prediction
    t = c.training
    ds = f", ZeRO-{c.deepspeed.stage} ({c.deepspeed.path.name})" if c.deepspeed else ""
    lines = [
        f"{t.path}: {c.arch.name}, {t.method}, micro batch {t.micro_batch} x accumulation {t.grad_accum}, "
        f"{t.seq_len} tokens{ds}",
        f"{c.gpus} x {fmt_gib(c.gpu_memory)} cards, {c.world_size} rank(s) per job, {c.procs_per_gpu} process(es) "
        f"per card, launcher {c.launcher}",
        "",
    ]
    rows = [("per GPU (one process)", "")]
    if p is not None:
        rows += [
            ("  peak allocated", fmt_gib(p.allocated)),
            ("  peak reserved", fmt_gib(p.reserved)),
            ("  device peak", fmt_gib(p.device)),
        ]
        if c.procs_per_gpu > 1:
            rows.append((f"  card peak ({c.procs_per_gpu} processes)", fmt_gib(result.card_peak)))
        fit = result.fit
        rows += [
            (f"  margin ({fit.margin_of.fraction:.1%} of the card peak)", fmt_gib(fit.margin)),
            ("  card peak with margin", fmt_gib(fit.needed)),
            (f"  budget ({c.headroom:g} of the card)", fmt_gib(result.budget)),
            ("  headroom", fmt_gib(fit.headroom)),
        ]
        of_host = f" of {fmt_gib(c.host_ram)}" if c.host_ram else ""
        if c.node_processes > c.job_processes:
            rows += [(f"host RAM (this job, {c.job_processes} processes)", fmt_gib(p.host_ram)),
                     (f"host RAM (every card busy, {c.node_processes} processes)",
                      fmt_gib(result.node_host_ram) + of_host)]
        else:
            rows.append((f"host RAM (the node, {c.job_processes} processes)", fmt_gib(p.host_ram) + of_host))
    else:
        rows.append(("  prediction", "-"))
    width = max(len(label) for label, _ in rows)
    lines += [f"{label:<{width}}  {value}".rstrip() for label, value in rows]
    lines += ["", f"verdict: {result.verdict}"]
    if result.lints:
        lines += ["", "lints:"]
        for f in result.lints:
            lines += [f"  {f.one_line()}", f"      why: {f.reason}", f"      fix: {f.fix}"]
    if c.not_modelled:
        lines += ["", "read, not modelled:"] + [f"  - {n.line()}" for n in c.not_modelled]
    notes = list(c.notes) + (list(p.notes) if p else [])
    if notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in notes]
    if p is not None and p.calibrated_on:
        lines.append(f"calibrated on: {', '.join(p.calibrated_on)} ({p.platform})")
    return "\n".join(lines)


# --- Command line -------------------------------------------------------------------------------
