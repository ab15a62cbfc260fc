"""Host RAM of one node at full size: the worst training process's host memory times the processes
the case puts on one host, against the host's RAM.

A case can fit its cards and still need more host memory than its machine has: ZeRO offload holds
tens of GiB per rank (guide 000: 58 GiB per rank at full depth), and guide 004 runs 14 jobs, each
with its dataloader workers, on one 251 GiB host. Full-size runs measure each process's host RSS
with its dataloader workers (`RankReport.step.host_rss`); the node needs the worst of them times
`Case.procs_per_node`, and may use `HOST_RAM_FRACTION` of `target.host_ram`.

What is judged (`check_host_ram`), and why:
- Cases that state `target.host_ram`; without it there is no verdict at all.
- Full size only. Tiny runs are not judged: their sequences, widths and ranks are scaled down, so
  their host figures say nothing of the case's host.
- Cases expected to fit only. The guide's failing configs (expect: oom) stop at their device OOM,
  so their host figure is of a step that never finished and the verdict they carry is the card's;
  the mistakes to detect (expect: detected) run as the mistake launches them (guide 002's
  plain-python job leaves three of its four cards idle), which the per-node count does not describe.
- Measured on fewer ranks than the case: ZeRO shards (offloaded partitions included) per rank shrink
  as ranks are added, so a per-process figure from fewer ranks bounds the case's from above. Under
  the host carries over; over it is inconclusive (as for the card, `harness.spec.variants`).
- Measured at fewer layers: judged on the depth fit of the host figure (host memory grows with
  depth: 4.9 GiB per layer per rank on guide 002), which the verdict labels as extrapolated; without
  one, not checkable. The full-depth margin of `harness.judge.extrapolation` is the caching allocator's
  (a device figure) and is not added: guide 000's host figure extrapolated within 0.1%.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.judge.verdicts import Verdict
from harness.measure.records import CaseRun
from harness.spec.schema import Case, Offload
from harness.spec.units import fmt_gib
from harness.spec.variants import Variant, parse_variant

# The share of a host's RAM training may take: the kernel, the page cache and everything else on the
# host need the rest, and pinned (page-locked) memory past it starves them. Used by the full-size
# verdict here and by the pre-merge lint `offload-pinned-host-ram` (harness.premerge.lints).
HOST_RAM_FRACTION = 0.8


@dataclass(frozen=True)
class NodeHostNeed:
    """Host memory one node needs for a case, bytes."""

    per_process: int  # the worst process's host RSS, with its dataloader workers
    processes: int  # training processes on the node (Case.procs_per_node)
    host_ram: int  # the host's RAM (target.host_ram)
    source: str  # 'measured', or the depth fit's label ('extrapolated from 4, 8 layers to 64')

    @property
    def total(self) -> int:
        return self.per_process * self.processes

    @property
    def usable(self) -> int:
        return int(self.host_ram * HOST_RAM_FRACTION)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def text(self) -> str:
        return (f"{self.processes} processes x {fmt_gib(self.per_process)} ({self.source}; the worst process with "
                f"its dataloader workers) = {fmt_gib(self.total)} on the node {'<=' if self.fits else '>'} "
                f"{fmt_gib(self.usable)} usable ({HOST_RAM_FRACTION:.0%} of the host's {fmt_gib(self.host_ram)})")


def _per_process(case: Case, run: CaseRun, extrapolation) -> tuple[int | None, str]:
    """The worst process's host memory at the case's depth and where it comes from; (None, why) without one."""
    if extrapolation is not None:
        value = extrapolation.values.get("host_peak")
        if value is None:
            why = next((r for r in extrapolation.rejected if r.startswith("host_peak")),
                       "no host figure at the measured depths")
            return None, f"host memory has no depth fit ({why})"
        return int(value), extrapolation.label
    measured = parse_variant(run.variant)
    if measured.layers is not None:
        return None, f"measured {measured.label(case)} only; host memory grows with depth and was not extrapolated"
    value = run.host_peak()
    return (value, "measured") if value is not None else (None, "no host memory was measured")


def node_host_need(case: Case, run: CaseRun, extrapolation=None) -> NodeHostNeed | None:
    """The node's host need at the case's depth (None: no host RAM stated, or no figure for that depth)."""
    if case.target.host_ram is None:
        return None
    per_process, source = _per_process(case, run, extrapolation)
    return None if per_process is None else NodeHostNeed(per_process, case.procs_per_node, case.target.host_ram, source)


def _remedies(case: Case) -> str:
    """What lowers this case's host memory per node, from its own settings."""
    t, ds = case.train, case.deepspeed
    out = []
    if t.dataloader_workers:
        out.append(f"fewer dataloader workers (train.dataloader_workers: {t.dataloader_workers}; each is a process)")
    if t.pin_memory:
        out.append("train.pin_memory: false (pinned batches are page-locked)")
    if ds is not None and ds.pin_memory and Offload.cpu in (ds.offload_optimizer, ds.offload_param):
        out.append("deepspeed.pin_memory: false (page-locked offload buffers)")
    if case.launch.procs_per_card > 1:
        out.append(f"fewer jobs per card (launch.procs_per_card: {case.launch.procs_per_card})")
    out.append("fewer training processes on one host, or a host with more RAM (target.host_ram)")
    return "; ".join(out)


def check_host_ram(case: Case, variant: Variant, run: CaseRun, extrapolation=None) -> Verdict | None:
    """The node's host need against `target.host_ram` x HOST_RAM_FRACTION; None where not judged (see
    the module's docstring). `case` as written; `variant` and `run` as measured (for a depth series,
    its deepest run, or the run that failed, with the series' fit)."""
    if run.fidelity != "real" or case.target.host_ram is None or case.expect.outcome != "fits":
        return None
    err = run.first_error()
    if err is not None:
        return Verdict("host_ram", "not_checkable", f"the run did not finish ({err.kind.value}; see the outcome)")
    need = node_host_need(case, run, extrapolation)
    if need is None:
        return Verdict("host_ram", "not_checkable", _per_process(case, run, extrapolation)[1])
    fewer_ranks = variant.fewer_ranks(case)
    if need.fits:
        note = (f" (per process on {variant.ranks} of {case.launch.ranks} ranks, which bounds the "
                f"{case.launch.ranks}-rank figure from above)" if fewer_ranks else "")
        return Verdict("host_ram", "confirmed", need.text() + note)
    if fewer_ranks:
        return Verdict("host_ram", "not_checkable",
                       f"over the host on {variant.ranks} ranks, which says nothing of {case.launch.ranks} (ZeRO "
                       f"shards per rank shrink with more ranks): {need.text()}")
    return Verdict("host_ram", "refuted",
                   f"more host RAM than the node may use: {need.text()}. Lower it: {_remedies(case)}")


def node_text(case: Case, per_process: float | None) -> str:
    """'14 x 3.52 GiB = 49.28 GiB' (with the host's usable share where the case states it), for reports."""
    if per_process is None:
        return "-"
    n = case.procs_per_node
    text = f"{n} x {fmt_gib(per_process)} = {fmt_gib(per_process * n)}"
    if case.target.host_ram is not None:
        text += f" of {fmt_gib(case.target.host_ram * HOST_RAM_FRACTION)} usable"
    return text
