"""A fitted config as a few lines of text: what a failing pre-merge test says (`pytest -m premerge`
with `--premerge-fit`), the changes that make the config fit, key by key."""

from __future__ import annotations

from pathlib import Path

from harness.fit.knobs import knobs_of
from harness.fit.search import PredictFn, search
from harness.fit.writer import ALLOC_ENV, write_fitted
from harness.premerge.check import CheckResult
from harness.spec.units import fmt_gib


def fit_diff(base: CheckResult, out_dir: Path, predict: PredictFn, *, deepspeed_arg: Path | None = None,
             allow: frozenset[str] = frozenset(), platform: str | None = None) -> str:
    """Search a fitting config for `base` (a config that does not fit), write it into `out_dir`, and say
    what changes, or how far the closest candidate is over."""
    found = search(base, allow, predict, platform=platform)
    if found.best is None:
        c = found.closest
        stopped = f"oom-harness fit: {found.cut_short()}" if found.stopped_early else ""
        if c is None:
            return stopped or "oom-harness fit: no candidate could be predicted"
        return ((stopped + ";" if stopped else "oom-harness fit: no config fits;")
                + f" the closest is predicted at {fmt_gib(c.result.card_peak)} per card against "
                f"{fmt_gib(c.result.budget)} ({fmt_gib(c.result.card_peak - c.result.budget)} over)")
    imported = base.config
    # out_dir is the pre-merge run's own folder for this config: each run replaces what the last one wrote
    written = write_fitted(imported, knobs_of(imported.case), found.best.knobs, out_dir,
                           deepspeed_arg=deepspeed_arg, alloc_env=ALLOC_ENV not in imported.case.launch.env,
                           force=True)
    best = found.best
    lines = [f"oom-harness fit: this fits at {fmt_gib(best.result.card_peak)} per card predicted (budget "
             f"{fmt_gib(best.result.budget)}), about {best.tokens_per_s:.0f} tokens/s per card; written to "
             f"{written.config}:"]
    lines += [f"  {c.key}: {c.old} -> {c.new}  ({c.why})" for c in written.changes]
    return "\n".join(lines)
