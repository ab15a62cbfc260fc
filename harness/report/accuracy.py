"""The predictor's measured accuracy by kind of config: the table docs/predictor.md opens with.

    python -m harness.report.accuracy      print it, from results/predictor/errors.json

Each row is a kind of config as the margin groups them (method and the stack's k-bit path, ZeRO stage,
offload; a cold Triton cache apart), over the benchmark's full-size runs, each predicted leave-one-out
(`python benchmarks/predictor_errors.py` writes them): how many runs, the error of the device figure per
card (measured / predicted - 1; median of its size and the worst), and the margin `check` adds to a
config of that kind. A run that ran out of memory gives only a lower bound: it is counted apart, and
the margin covers it where the prediction was under it. The page's table is this function's output; a
test holds them equal, so a figure in the page cannot drift from the file it comes from.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from harness.predict.margin import ERRORS_FILE, ConfigKind, ErrorRecord, ErrorTable, margin_from

HEADER = ("| kind of config | finished runs (cases) | out of memory | device error: median \\|e\\| | worst "
          "| margin `check` adds |\n|---|---|---|---|---|---|")


@dataclass(frozen=True)
class Row:
    kind: str
    runs: int
    cases: int
    oom: int
    median_abs: float | None
    worst: float | None
    margins: tuple[float, ...]  # the margin of every kind of the group the benchmark holds
    unmeasured: int = 0  # of those kinds, the ones measured on too few cases for a margin of their own


def _group(kind: ConfigKind) -> tuple:
    return (kind.triton, kind.method, kind.path, kind.zero, kind.offload)


def _label(kind: ConfigKind) -> str:
    method = {"lora": "LoRA", "qlora": "QLoRA", "full": "full fine-tune"}[kind.method]
    method += {"peft": " through peft's k-bit path", "llamafactory": " through LLaMA-Factory's path"}.get(kind.path, "")
    zero = "no DeepSpeed" if kind.zero == 0 else f"ZeRO-{kind.zero}"
    offload = {"none": "", "optimizer": ", optimizer offload", "optimizer+param": ", optimizer and parameter offload",
               "param": ", parameter offload"}[kind.offload]
    cold = ", cold Triton cache" if kind.triton == "cold" else ""
    return f"{method}, {zero}{offload}{cold}"


def rows(table: ErrorTable) -> list[Row]:
    groups: dict[tuple, list[ErrorRecord]] = {}
    for r in table.records:
        groups.setdefault(_group(r.kind), []).append(r)
    out = []
    for key in sorted(groups, key=lambda k: (k[0], ["lora", "qlora", "full"].index(k[1]), k[2], k[3], k[4])):
        records = groups[key]
        done = [r.measured / r.predicted - 1 for r in records if r.outcome == "ok"]
        kinds = sorted({r.kind for r in records}, key=lambda k: k.label())
        margins = [margin_from(table.records, k) for k in kinds]
        out.append(Row(kind=_label(records[0].kind), runs=len(done), cases=len({r.case_id for r in records}),
                       oom=sum(r.outcome == "oom" for r in records),
                       median_abs=statistics.median(abs(e) for e in done) if done else None,
                       worst=max(done, key=abs) if done else None,
                       margins=tuple(m.fraction for m in margins),
                       unmeasured=sum(m.basis.startswith("margin not measured") for m in margins)))
    return out


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def markdown(table: ErrorTable) -> str:
    lines = [HEADER]
    for r in rows(table):
        low, high = min(r.margins), max(r.margins)
        margin = f"{low:.1%}" if low == high else f"{low:.1%} to {high:.1%}"
        if r.unmeasured:
            margin += (" (not measured)" if r.unmeasured == len(r.margins)
                       else f" ({r.unmeasured} of {len(r.margins)} kinds not measured)")
        lines.append(f"| {r.kind} | {r.runs} ({r.cases}) | {r.oom or '-'} | {_pct(r.median_abs)} "
                     f"| {_pct(r.worst, signed=True)} | {margin} |")
    return "\n".join(lines)


def main() -> int:
    print(markdown(ErrorTable.read(ERRORS_FILE)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
