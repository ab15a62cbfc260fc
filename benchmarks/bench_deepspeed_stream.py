"""What DeepSpeed adds to the caching allocator's stream, read from the recorded DeepSpeed timelines.

    .venv/bin/python benchmarks/bench_deepspeed_stream.py [results/timelines]

A DeepSpeed config's reserved figure is allocated times a fitted ratio: the stream the allocator model
replays for the other configs (`harness.predict.allocator.stream`) is built from the fake-tensor trace, which does
not see DeepSpeed's own device allocations. This prints, for every recorded timeline of a DeepSpeed
run, what a stream built for DeepSpeed would have to reproduce:

1. **Share.** The allocations made from DeepSpeed's ZeRO and communication code (their call sites;
   `zero/linear.py`, which computes the model's own matmuls under ZeRO-3, is the model's), and the
   reserved peak of the timeline replayed through the allocator model with and without them (under the
   run's memory cap, as `benchmarks/bench_allocator.py` replays it).
2. **Order.** The reserved peak when each of DeepSpeed's allocations comes k allocator actions earlier
   and its free k actions later (k = 1, 2, 3, 5, 10), beside the allocated peak, which moves only when
   the shift lengthens a lifetime across it.
3. **ZeRO-3's gathers.** The allocations and frees of DeepSpeed's coordinator replayed over the case's
   step (`harness.predict.zero3.coordinator.replay(spec, stream=[])`) beside the recorded allocations on the gather
   stream (`partition_parameters.py`'s buffers and host copies, and the parameters `torch.cat` copies
   out of coalesced buffers) of the timeline's second-to-last forward and backward (a step after the
   one in which DeepSpeed records the module order): how many, how many bytes, and the largest sizes;
   then the gather stream's reserved peak, recorded and replayed through the allocator model
   (`harness.predict.zero3.coordinator.gather_pool`).
4. **Where the reserve grows.** For each phase of the timeline in which the reserve grew: reserved
   before and after, and the new segments by the call site of the allocation that asked for each; then
   the reserved peak's action, its phase and the allocation it was made for, with allocated memory
   and the largest free cached block just before it (what the allocation could not fit in).

Several folders may be named; the default is results/timelines and results/architectures/timelines.
"""

from __future__ import annotations

import itertools
import sys
from bisect import bisect_left
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB, MiB = 2**30, 2**20
# Call sites of DeepSpeed's own buffers (gathers, partitions, reduce buffers, norms, collectives)
DEEPSPEED_SITES = ("zero/partition_parameters.py", "zero/stage3.py", "zero/stage_1_and_2.py", "zero/utils.py",
                   "comm/", "runtime/utils.py")
GATHER_SITE = "zero/partition_parameters.py"
SHIFTS = (1, 2, 3, 5, 10)


def _site(timeline, i: int) -> str:
    return timeline.sites[timeline.site[i]] if timeline.site[i] >= 0 else "?"


def _is_deepspeed(site: str) -> bool:
    return any(part in site for part in DEEPSPEED_SITES)


def _unique(timeline):
    """The timeline with each allocation at an address of its own (its frees follow it), so that
    reordered actions still pair each free with its allocation."""
    from harness.measure.timeline import ALLOC, FREE_COMPLETED, FREE_REQUESTED

    current: dict[int, int] = {}
    addrs = []
    for i, (act, addr) in enumerate(zip(timeline.action, timeline.addr, strict=True)):
        if act == ALLOC:
            current[addr] = i + 1
            addrs.append(current[addr])
        elif act in (FREE_REQUESTED, FREE_COMPLETED):
            addrs.append(current.get(addr, -1))
        else:
            addrs.append(-2 - i)
    return timeline.model_copy(update={"addr": addrs})


def _reordered(timeline, keys: list[float], keep=None):
    order = sorted((i for i in range(len(keys)) if keep is None or keep[i]), key=keys.__getitem__)
    columns = {name: [getattr(timeline, name)[i] for i in order]
               for name in ("t_us", "action", "addr", "size", "stream", "site", "phase")}
    return timeline.model_copy(update=columns)


def _deepspeed_actions(timeline) -> list[bool]:
    """Whether each action belongs to an allocation made from DeepSpeed's code (on a `_unique` timeline)."""
    from harness.measure.timeline import ALLOC, FREE_COMPLETED, FREE_REQUESTED

    ours: set[int] = set()
    out = []
    for i, (act, addr) in enumerate(zip(timeline.action, timeline.addr, strict=True)):
        if act == ALLOC and _is_deepspeed(_site(timeline, i)):
            ours.add(addr)
        out.append(act in (ALLOC, FREE_REQUESTED, FREE_COMPLETED) and addr in ours)
    return out


def _shifted(timeline, flags: list[bool], k: int):
    from harness.measure.timeline import ALLOC

    keys = [float(i) if not flag else (i - k - 0.5 if act == ALLOC else i + k + 0.5)
            for i, (act, flag) in enumerate(zip(timeline.action, flags, strict=True))]
    return _reordered(timeline, keys)


def _gather_stream(timeline) -> int | None:
    """The stream DeepSpeed's coordinator gathers on: that of the first gather allocation of a forward
    (zero.Init's allocations at the load come from the same file, on the model's stream)."""
    from harness.measure.timeline import ALLOC, PHASES

    forward = PHASES.index("forward")
    return next((timeline.stream[i] for i, a in enumerate(timeline.action)
                 if a == ALLOC and timeline.phase[i] == forward and GATHER_SITE in _site(timeline, i)), None)


def _gathers(timeline) -> Counter | None:
    """Sizes of the recorded allocations on the gather stream (the buffers, the parameters copied out of
    them, the host partitions' copies) over the second-to-last forward and backward; None where the
    timeline holds no complete forward and backward (the run ran out of memory in its first step)."""
    from harness.measure.timeline import ALLOC

    spans = [s for s in timeline.phase_spans() if s[0] in ("forward", "backward")]
    pairs = [(a, b) for a, b in itertools.pairwise(spans) if (a[0], b[0]) == ("forward", "backward")]
    stream = _gather_stream(timeline)
    if not pairs or stream is None:
        return None
    forward, backward = pairs[-2] if len(pairs) > 1 else pairs[-1]
    return Counter(timeline.size[i] for i in range(forward[1], backward[2])
                   if timeline.action[i] == ALLOC and timeline.stream[i] == stream)


def _gather_pools(timeline) -> tuple[int, int] | None:
    """The gather stream's reserved peak, recorded and replayed (harness.predict.zero3.coordinator.gather_pool over
    POOL_ROUNDS steps)."""
    import dataclasses

    from harness.models.source import load_model
    from harness.predict.constants import POOL_ROUNDS
    from harness.predict.zero3 import coordinator

    case = _zero3_case(timeline)
    stream = _gather_stream(timeline)
    if case is None or stream is None:
        return None
    arch = load_model(case.model)
    spec = dataclasses.replace(coordinator.spec_for(case, arch, case.layers or arch.layers), pool_rounds=POOL_ROUNDS)
    return timeline.reserved_peak_on(stream), coordinator.replay(spec).pool_bytes


def _zero3_case(timeline):
    """The ZeRO-3 case a timeline recorded, as measured (its variant applied); None for any other."""
    from harness.spec.cases import load_case
    from harness.spec.variants import parse_variant

    found = [p for folder in (ROOT / "cases", ROOT / "benchmarks/architectures/cases")
             for p in sorted(folder.glob(f"{timeline.case_id}.yaml"))]
    if not found:
        return None
    case = load_case(found[0])
    case = parse_variant(timeline.variant).apply(case) if timeline.variant else case
    if case.deepspeed is None or case.deepspeed.stage != 3:
        return None
    return case


def _replayed_gathers(timeline) -> Counter | None:
    from harness.models.source import load_model
    from harness.predict.zero3 import coordinator

    case = _zero3_case(timeline)
    if case is None:
        return None
    arch = load_model(case.model)
    events: list = []
    coordinator.replay(coordinator.spec_for(case, arch, case.layers or arch.layers), record=events, stream=events)
    return Counter(e.nbytes for e in events if isinstance(e, coordinator.StreamEvent) and e.kind == "alloc")


def _largest_free_block(timeline, before: int) -> int:
    """The largest free gap inside the recorded segments (not expandable ones) just before action `before`."""
    from harness.measure.timeline import ALLOC, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE

    segments: dict[int, int] = {}
    live: dict[int, int] = {}
    for i in range(before):
        act, addr = timeline.action[i], timeline.addr[i]
        if act == SEGMENT_ALLOC:
            segments[addr] = timeline.size[i]
        elif act == SEGMENT_FREE:
            segments.pop(addr, None)
        elif act == ALLOC:
            live[addr] = timeline.size[i]
        elif act == FREE_COMPLETED:
            live.pop(addr, None)
    blocks = sorted(live.items())
    best = 0
    for start, size in segments.items():
        cursor = start
        for addr, n in blocks[bisect_left(blocks, (start, -1)):]:
            if addr >= start + size:
                break
            best, cursor = max(best, addr - cursor), addr + n
        best = max(best, start + size - cursor)
    return best


def _growth(timeline) -> list[str]:
    """Section 4 for one timeline."""
    from harness.measure.timeline import ALLOC, PHASES, SEGMENT_ALLOC, SEGMENT_MAP

    curve = timeline.curve()
    made = (SEGMENT_ALLOC, SEGMENT_MAP)

    def asked_by(i: int) -> str:
        j = next((k for k in range(i + 1, len(timeline)) if timeline.action[k] == ALLOC), None)
        return "?" if j is None else _site(timeline, j)

    lines = []
    counts = Counter()
    for phase, start, end in timeline.phase_spans():
        counts[phase] += 1
        before = curve.reserved[start - 1] if start else 0
        after = max(curve.reserved[start:end])
        if after - before < 64 * MiB:
            continue
        by_site: Counter = Counter()
        n_by_site: Counter = Counter()
        for i in range(start, end):
            if timeline.action[i] in made:
                by_site[asked_by(i)] += timeline.size[i]
                n_by_site[asked_by(i)] += 1
        top = "; ".join(f"{site} x{n_by_site[site]} {size / MiB:.0f} MiB" for site, size in by_site.most_common(4))
        lines.append(f"  {phase} #{counts[phase]}: reserved {before / GiB:.3f} -> {after / GiB:.3f} GiB "
                     f"(allocated at most {max(curve.allocated[start:end]) / GiB:.3f}); new segments: {top}")
    peak, reserved = curve.peak("reserved")
    phase = PHASES[timeline.phase[peak]] if timeline.phase[peak] >= 0 else "?"
    nth = sum(1 for p, s, _ in timeline.phase_spans() if p == phase and s <= peak)
    expandable = "expandable_segments:true" in timeline.alloc_conf.replace(" ", "").lower()
    free = "" if expandable else (f"; largest free cached block before it "
                                  f"{_largest_free_block(timeline, peak) / MiB:.0f} MiB")
    lines.append(f"  peak {reserved / GiB:.3f} GiB at action {peak} ({phase} #{nth}): a "
                 f"{timeline.size[peak] / MiB:.0f} MiB segment for {asked_by(peak)}; allocated "
                 f"{curve.allocated[peak] / GiB:.3f} GiB{free}")
    return lines


def _sizes(counter: Counter, n: int = 6) -> str:
    return ", ".join(f"{size / MiB:.2f} x{count}" for size, count in sorted(counter.items(), reverse=True)[:n])


def main(argv: list[str]) -> int:
    from harness.measure.timeline import ALLOC, MemoryTimeline
    from harness.predict.allocator.replay import recorded_limit, replay

    folders = [Path(a) for a in argv] or [ROOT / "results" / d for d in ("timelines", "architectures/timelines")]
    timelines = [(p, MemoryTimeline.load(p)) for folder in folders for p in sorted(folder.glob("*/*.json.gz"))]
    timelines = [(p, t) for p, t in timelines if any(_is_deepspeed(s) for s in t.sites)]
    if not timelines:
        print(f"no timeline of a DeepSpeed run under {', '.join(map(str, folders))}")
        return 1
    print("1. DeepSpeed's own allocations: share of the bytes allocated, and the reserved peak (GiB) replayed "
          "with and without them")
    head = (f"{'platform/timeline':<78} {'DS allocs':>9} {'DS bytes':>8} {'alloc pk':>8} {'reserved':>8} "
            f"{'alloc w/o':>9} {'res w/o':>8}")
    print(head)
    print("-" * len(head))
    prepared = []
    for path, timeline in timelines:
        name = path.parent.name + "/" + path.name.removesuffix(".json.gz")
        cap = recorded_limit(timeline, ROOT / "results" / "runs")
        timeline = _unique(timeline)
        flags = _deepspeed_actions(timeline)
        prepared.append((name, timeline, flags, cap))
        allocs = [i for i, a in enumerate(timeline.action) if a == ALLOC]
        ours = [i for i in allocs if flags[i]]
        share = sum(timeline.size[i] for i in ours) / max(1, sum(timeline.size[i] for i in allocs))
        without = _reordered(timeline, list(range(len(flags))), [not f for f in flags])
        print(f"{name:<78} {len(ours):>9} {100 * share:>7.1f}% {timeline.curve().peak()[1] / GiB:>8.3f} "
              f"{replay(timeline, limit=cap).peak_reserved / GiB:>8.3f} {without.curve().peak()[1] / GiB:>9.3f} "
              f"{replay(without, limit=cap).peak_reserved / GiB:>8.3f}")

    print(f"\n2. Each DeepSpeed allocation k actions earlier, its free k later: allocated / reserved peak change "
          f"(k = {', '.join(map(str, SHIFTS))})")
    for name, timeline, flags, cap in prepared:
        allocated, reserved = timeline.curve().peak()[1], replay(timeline, limit=cap).peak_reserved
        cells = []
        for k in SHIFTS:
            moved = _shifted(timeline, flags, k)
            cells.append(f"{100 * (moved.curve().peak()[1] / allocated - 1):+.1f}/"
                         f"{100 * (replay(moved, limit=cap).peak_reserved / reserved - 1):+.1f}%")
        print(f"{name:<78} " + "  ".join(f"{c:>14}" for c in cells))

    print("\n3. ZeRO-3 gathers over one steady-state forward and backward: recorded against DeepSpeed's "
          "coordinator replayed (harness.predict.zero3.coordinator); sizes in MiB")
    for name, timeline, _, _ in prepared:
        replayed = _replayed_gathers(timeline)
        if replayed is None:
            continue
        recorded = _gathers(timeline)
        if recorded is None:
            print(f"{name}\n  no complete forward and backward recorded")
            continue
        print(f"{name}\n  recorded: {sum(recorded.values())} allocations, "
              f"{sum(s * c for s, c in recorded.items()) / GiB:.3f} GiB, {len(recorded)} sizes; largest "
              f"{_sizes(recorded)}\n  replayed: {sum(replayed.values())} allocations, "
              f"{sum(s * c for s, c in replayed.items()) / GiB:.3f} GiB, {len(replayed)} sizes; largest "
              f"{_sizes(replayed)}")
        pools = _gather_pools(timeline)
        if pools is not None:
            from harness.predict.constants import POOL_ROUNDS

            print(f"  the gather stream's pool: recorded {pools[0] / GiB:.3f} GiB, replayed over {POOL_ROUNDS} "
                  f"steps {pools[1] / GiB:.3f} GiB ({100 * (pools[1] / pools[0] - 1):+.1f}%)")

    print("\n4. Where the reserve grows: the phases that added 64 MiB or more, their new segments by the call "
          "site that asked for them, and the reserved peak")
    for path, timeline in timelines:  # the recorded addresses, which `_unique` replaced
        print(path.parent.name + "/" + path.name.removesuffix(".json.gz"))
        print("\n".join(_growth(timeline)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
