"""The caching allocator model: each rule on a small sequence, and the recorded timelines replayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.measure.timeline import MemoryTimeline
from harness.predict.allocator.allocator import (
    AllocatorConf,
    AllocConfError,
    CachingAllocator,
    round_size,
    segment_size,
)
from harness.predict.allocator.replay import recorded_limit, replay

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent
TIMELINES = sorted(p for d in ("results/timelines", "results/architectures/timelines", "results/fitted/timelines")
                   for p in (ROOT / d).glob("*/*.json.gz"))


def test_sizes_round_to_512_bytes_or_a_power_of_two_division():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(5 * MiB + 1) == 5 * MiB + 512
    four = AllocatorConf.parse("roundup_power2_divisions:4")
    assert round_size(5 * MiB + 1, four) == 6 * MiB  # 4 MiB to 8 MiB in steps of 1 MiB
    assert round_size(8 * MiB, four) == 8 * MiB
    listed = AllocatorConf.parse("roundup_power2_divisions:[2:1,4:4,>:2]")
    assert round_size(5 * MiB + 1, listed) == 6 * MiB  # the 4 MiB interval: 4 divisions
    assert round_size(2 * MiB + 1, listed) == 2 * MiB + 512  # the 2 MiB interval: 1 division, no power-of-two step
    assert round_size(9 * MiB, listed) == 12 * MiB  # above: 2 divisions of 8 MiB to 16 MiB


def test_segment_sizes_by_request():
    assert segment_size(512) == segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 512) == 12 * MiB


def test_small_and_large_requests_use_separate_pools():
    a = CachingAllocator()
    a.free(a.malloc(20 * MiB))  # a cached large segment ...
    a.malloc(1024)  # ... does not serve a small request
    assert a.stats.reserved == 22 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    a = CachingAllocator()
    big, small = a.malloc(30 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    assert a.malloc(11 * MiB).size == 12 * MiB  # not split: 1 MiB left is not more than 1 MiB
    a.malloc(28 * MiB)  # the 30 MiB block is still there
    assert a.stats.reserved == 42 * MiB


def test_blocks_are_split_only_past_the_limits():
    a = CachingAllocator()
    assert a.malloc(19 * MiB).size == 20 * MiB  # a new 20 MiB segment; 1 MiB would remain: not split
    b = a.malloc(30 * MiB)
    a.free(b)
    b = a.malloc(29 * MiB)
    assert b.size == 30 * MiB  # a cached block, 1 MiB over: not split
    a.free(b)
    assert a.malloc(27 * MiB).size == 27 * MiB  # 3 MiB over: split, and the rest serves the next request
    a.malloc(2 * MiB)
    assert a.stats.reserved == 50 * MiB
    assert a.malloc(1000).size == 1024  # small pool: split whenever 512 B or more remain
    assert a.malloc(MiB).size == MiB  # in the same 2 MiB segment
    assert a.malloc(MiB - 1024).size == MiB - 1024  # and the last of it
    assert a.stats.reserved == 52 * MiB


def test_freed_neighbours_merge():
    a = CachingAllocator()
    blocks = [a.malloc(6 * MiB) for _ in range(3)]  # one 20 MiB segment, split three times
    assert a.stats.reserved == 20 * MiB
    for b in blocks:
        a.free(b)
    assert a.malloc(20 * MiB).size == 20 * MiB  # the whole segment again: no new one
    assert a.stats.reserved == 20 * MiB


def test_max_split_size_keeps_oversize_blocks_whole_and_for_requests_near_their_size():
    a = CachingAllocator(AllocatorConf.parse("max_split_size_mb:40"))
    a.free(a.malloc(64 * MiB))
    a.malloc(8 * MiB)  # below max_split_size: not served by the oversize block
    assert a.stats.reserved == 84 * MiB
    a.malloc(40 * MiB)  # 64 MiB exceeds 40 MiB by 20 MiB or more: not reused
    assert a.stats.reserved == 124 * MiB
    b = a.malloc(50 * MiB)  # within 20 MiB: reused, and not split
    assert b.size == 64 * MiB and a.stats.reserved == 124 * MiB


def test_expandable_segments_grow_one_segment_in_pages():
    plain, grown = CachingAllocator(), CachingAllocator(AllocatorConf.parse("expandable_segments:True"))
    for a in (plain, grown):
        first = a.malloc(30 * MiB)
        a.malloc(8 * MiB)
        a.free(first)
        a.malloc(35 * MiB)
    assert plain.stats.reserved == 30 * MiB + 20 * MiB + 36 * MiB  # a segment per miss
    # 40 MiB of pages for the first two; the freed 30 MiB at the start plus 10 MiB unused at the end
    # are not contiguous, so the 35 MiB request maps 40 MiB more at the end
    assert grown.stats.reserved == 80 * MiB
    assert len(grown.segments()) == 1


def test_a_block_used_on_another_stream_returns_at_free_completed():
    a = CachingAllocator()
    b = a.malloc(20 * MiB)
    a.free_requested(b)
    a.malloc(20 * MiB)  # not reusable yet
    assert a.stats.reserved == 40 * MiB
    a.free_completed(b)
    a.malloc(20 * MiB)
    assert a.stats.reserved == 40 * MiB


def test_blocks_are_reused_only_on_their_own_stream():
    a = CachingAllocator()
    a.free(a.malloc(20 * MiB, stream=1))
    a.malloc(20 * MiB, stream=2)
    assert a.stats.reserved == 40 * MiB
    a.malloc(20 * MiB, stream=1)  # the cached block of stream 1
    assert a.stats.reserved == 40 * MiB


def test_under_a_cap_cached_segments_are_released_and_the_allocation_retried_then_oom():
    a = CachingAllocator(limit=50 * MiB)
    a.free(a.malloc(30 * MiB))
    assert a.malloc(40 * MiB) is not None  # 70 MiB would pass the cap: the cached 30 MiB go first
    assert a.stats.reserved == 40 * MiB and a.stats.retries == 1
    assert a.malloc(20 * MiB) is None  # nothing cached left to release
    assert a.stats.ooms[0].size == 20 * MiB and a.stats.ooms[0].reserved == 40 * MiB


def test_pending_cross_stream_frees_complete_before_a_release():
    a = CachingAllocator(limit=50 * MiB)
    b = a.malloc(30 * MiB)
    a.free_requested(b)
    assert a.malloc(40 * MiB) is not None  # the release synchronises: the pending block is freed too
    assert a.stats.reserved == 40 * MiB
    a.free_completed(b)  # the recorded completion comes later: already done
    assert a.stats.reserved == 40 * MiB


def test_garbage_collection_frees_old_cached_segments_before_the_cap_is_hit():
    gc = CachingAllocator(AllocatorConf.parse("garbage_collection_threshold:0.5"), limit=100 * MiB)
    plain = CachingAllocator(limit=100 * MiB)
    for a in (gc, plain):
        a.free(a.malloc(60 * MiB))
        a.malloc(80 * MiB)
        assert a.stats.reserved == 80 * MiB
    assert gc.stats.retries == 0 and plain.stats.retries == 1


def test_empty_cache_releases_unsplit_cached_segments_only():
    a = CachingAllocator()
    a.malloc(6 * MiB)  # a 20 MiB segment, split: stays
    a.free(a.malloc(30 * MiB))  # a segment of its own, cached whole: released
    a.empty_cache()
    assert a.stats.reserved == 20 * MiB


def test_the_fingerprint_tells_where_the_next_requests_will_be_served():
    """Two allocators that served the same requests have the same fingerprint; one whose cached blocks
    lie elsewhere (the same bytes reserved and allocated) has another."""

    def served(order):
        a = CachingAllocator()
        keep, blocks = a.malloc(4 * MiB), [a.malloc(size * MiB) for size in (30, 40)]
        for i in order:
            a.free(blocks[i])
        return a, keep

    (a, _), (b, _) = served([0, 1]), served([1, 0])
    assert a.fingerprint() == b.fingerprint()  # the same blocks cached, whatever the order of the frees
    c = CachingAllocator()
    c.malloc(4 * MiB)
    for block in [c.malloc(40 * MiB), c.malloc(30 * MiB)]:
        c.free(block)
    assert (c.stats.reserved, c.stats.allocated) == (a.stats.reserved, a.stats.allocated)
    assert c.fingerprint() != a.fingerprint()  # the 30 and 40 MiB segments made in the other order
    a.malloc(2 * MiB)
    assert a.fingerprint() != b.fingerprint()


def test_the_alloc_conf_is_parsed_and_bad_options_are_named():
    conf = AllocatorConf.parse("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,"
                               "release_lock_on_cudamalloc:True")
    assert conf.expandable_segments and conf.max_split_size == 128 * MiB and conf.garbage_collection_threshold == 0.6
    assert AllocatorConf.parse("") == AllocatorConf()
    for text, named in [("max_split_size_mb:16", "max_split_size_mb"),
                        ("expandable_segment:True", "expandable_segment"),
                        ("expandable_segments:yes", "expandable_segments"),
                        ("garbage_collection_threshold:2", "0 and 1"),
                        ("roundup_power2_divisions:3", "power of two")]:
        with pytest.raises(AllocConfError, match=named):
            AllocatorConf.parse(text)
    with pytest.raises(AllocConfError, match="cudaMallocAsync"):
        CachingAllocator(AllocatorConf.parse("backend:cudaMallocAsync"))


@pytest.mark.parametrize("path", TIMELINES, ids=lambda p: f"{p.parent.name}/{p.name.removesuffix('.json.gz')}")
def test_recorded_timelines_replay_to_the_recorded_reserved_peak_and_oom(path):
    timeline = MemoryTimeline.load(path)
    _, recorded = timeline.curve().peak("reserved")
    result = replay(timeline, limit=recorded_limit(timeline, ROOT / "results" / "runs"))
    assert abs(result.peak_reserved - recorded) <= 0.01 * recorded, (result.peak_reserved, recorded)
    assert result.oom_index == result.recorded_oom_index  # both None without a cap that was hit


def _timeline(actions: list[tuple[str, int, int]], card: int | None = None) -> MemoryTimeline:
    """A recording from (action, address, size) triples on stream 0."""
    from harness.measure.timeline import ACTIONS

    n = len(actions)
    return MemoryTimeline(case_id="c", fidelity="real", platform="cuda", device_name="card", torch_version="2.11",
                          recorded="2026-11-27T00:00:00+00:00", emulated_card_bytes=card, t_us=list(range(n)),
                          action=[ACTIONS.index(a) for a, _, _ in actions], addr=[a for _, a, _ in actions],
                          size=[s for _, _, s in actions], stream=[0] * n, site=[-1] * n, phase=[0] * n)


def test_a_programs_empty_cache_is_read_from_the_segments_it_released_and_the_allocators_own_is_not():
    """Two 100 MiB tensors freed, their segments released by empty_cache(), then one 200 MiB tensor:
    the replay must release them too (200 MiB reserved at the peak, not 400). Under a 300 MiB cap the
    same releases are the allocator's own, made to fit the 200 MiB: the model makes them itself."""
    a, b, c = 0x1000_0000, 0x2000_0000, 0x3000_0000
    seg = 100 * MiB
    actions = [("segment_alloc", a, seg), ("alloc", a, seg), ("segment_alloc", b, seg), ("alloc", b, seg),
               ("free_requested", a, seg), ("free_completed", a, seg), ("free_requested", b, seg),
               ("free_completed", b, seg), ("segment_free", a, seg), ("segment_free", b, seg),
               ("segment_alloc", c, 2 * seg), ("alloc", c, 2 * seg)]
    timeline = _timeline(actions)
    assert timeline.curve().peak("reserved")[1] == 2 * seg
    assert replay(timeline).peak_reserved == 2 * seg
    capped = replay(_timeline(actions, card=300 * MiB), limit=300 * MiB)
    assert capped.oom_index is None and capped.peak_reserved == 2 * seg
    # the same releases, the allocation after them fitting under the cap: the program's call again
    assert replay(_timeline(actions, card=500 * MiB), limit=500 * MiB).peak_reserved == 2 * seg


def test_fits_says_whether_a_cached_block_serves_a_request_and_changes_nothing():
    sim = CachingAllocator()
    block = sim.malloc(30 * 2**20)
    sim.free(block)
    before = sim.fingerprint()
    assert sim.fits(12 * 2**20)  # from the cached 30 MiB segment
    assert not sim.fits(40 * 2**20)  # would need a segment of its own
    assert sim.fingerprint() == before
    assert not CachingAllocator(AllocatorConf.parse("expandable_segments:True")).fits(2**20)
