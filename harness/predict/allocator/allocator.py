"""PyTorch's CUDA caching allocator as a model: what a stream of allocations and frees reserves.

Reserved memory is not allocated memory times a ratio: it is what the caching allocator
(`c10/cuda/CUDACachingAllocator.cpp`) has taken from the driver, and it depends on the order and sizes
of the requests. This module follows that allocator's rules, written from its source (torch 2.x):

- sizes are rounded up to 512 B (or to a power-of-two division, `roundup_power2_divisions`);
- requests up to 1 MiB use the small pool, larger ones the large pool;
- a new segment is 2 MiB for a small request, 20 MiB for a request under 10 MiB, else the request
  rounded up to 2 MiB;
- a free block is found best-fit by (stream, size, address): the smallest block of the request's
  stream that fits, the lowest address among equals;
- a found block is split when what remains is at least 512 B (small pool, or any pool under
  expandable segments) or more than 1 MiB (large pool), and the request is below `max_split_size`;
- blocks at or above `max_split_size` are never split, serve no request below it, and serve a
  larger request only if they exceed it by less than `max_non_split_rounding` (20 MiB);
- a freed block merges with free neighbours of its segment; a block used on another stream comes
  back only when its free completes (`free_requested` then `free_completed` in the recorded
  history);
- when a new segment would exceed the memory cap (`torch.cuda.set_per_process_memory_fraction`) or
  the device, the allocator frees cached oversize blocks and retries, then frees every unsplit cached
  segment (and unmaps the free pages of expandable segments) and retries, then raises an OOM;
- `garbage_collection_threshold` (only under a cap) frees the cached unsplit large segments
  that have gone unused the longest first, before a new segment is taken;
- `expandable_segments:True`: one segment per stream and pool, grown by mapping pages (2 MiB in the
  small pool, 20 MiB in the large pool) at the lowest address that fits; reserved is the mapped
  pages.

Addresses are the model's own (each new segment below the last); only the order, size and stream
of the requests are inputs. CUDA graphs' private pools and the `cudaMallocAsync` backend are not
modelled. ROCm runs the same code under HIP (`PYTORCH_HIP_ALLOC_CONF` is read as well); see
docs/predictor.md for where it differs.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field

from harness.predict.constants import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    POWER2_INTERVALS,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
)

_KEYS_WITHOUT_EFFECT = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                        "pinned_use_background_threads", "pinned_use_hip_host_register", "per_process_memory_fraction",
                        "graph_capture_record_stream_reuse")


class AllocConfError(ValueError):
    """A PYTORCH_CUDA_ALLOC_CONF the model cannot read; the message names the option and the fix."""


@dataclass(frozen=True)
class AllocatorConf:
    """The options of PYTORCH_CUDA_ALLOC_CONF that change where device memory goes."""

    max_split_size: int | None = None  # bytes; None: no limit (torch's default)
    max_non_split_rounding: int = LARGE_BUFFER  # bytes an oversize block may exceed a request by
    roundup_power2_divisions: tuple[int, ...] = (0,) * POWER2_INTERVALS  # per interval from 1 MiB
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0  # fraction of the cap; 0: off
    backend: str = "native"

    @classmethod
    def parse(cls, text: str | None, source: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorConf:
        """`text` as torch reads it: `key:value` pairs separated by commas, e.g.
        `expandable_segments:True,max_split_size_mb:128` or `roundup_power2_divisions:[256:1,>:4]`."""
        kw: dict = {}
        for key, value in _pairs(text or "", source):
            if key == "max_split_size_mb":
                mb = _number(value, key, source)
                if mb <= LARGE_BUFFER >> 20:
                    raise AllocConfError(f"{source}: max_split_size_mb:{value} must be above {LARGE_BUFFER >> 20} "
                                         f"(torch refuses it too); use e.g. max_split_size_mb:128")
                kw["max_split_size"] = int(mb) << 20
            elif key == "max_non_split_rounding_mb":
                kw["max_non_split_rounding"] = int(_number(value, key, source)) << 20
            elif key == "garbage_collection_threshold":
                threshold = float(_number(value, key, source))
                if not 0.0 < threshold < 1.0:
                    raise AllocConfError(f"{source}: garbage_collection_threshold:{value} must be between 0 and 1 "
                                         f"(exclusive), e.g. garbage_collection_threshold:0.6")
                kw["garbage_collection_threshold"] = threshold
            elif key == "expandable_segments":
                if value not in ("True", "False"):
                    raise AllocConfError(f"{source}: expandable_segments:{value} must be True or False")
                kw["expandable_segments"] = value == "True"
            elif key == "roundup_power2_divisions":
                kw["roundup_power2_divisions"] = _divisions(value, source)
            elif key == "backend":
                if value not in ("native", "cudaMallocAsync"):
                    raise AllocConfError(f"{source}: backend:{value} must be native or cudaMallocAsync")
                kw["backend"] = value
            elif key not in _KEYS_WITHOUT_EFFECT:
                raise AllocConfError(f"{source}: unknown option {key!r}; the options are max_split_size_mb, "
                                     "max_non_split_rounding_mb, garbage_collection_threshold, expandable_segments, "
                                     f"roundup_power2_divisions, backend, {', '.join(_KEYS_WITHOUT_EFFECT)}")
        return cls(**kw)


def _pairs(text: str, source: str):
    depth, start, items = 0, 0, []
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if text[start:i].strip():
                items.append(text[start:i].strip())
            start = i + 1
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not value.strip():
            raise AllocConfError(f"{source}: {item!r} is not key:value (e.g. expandable_segments:True)")
        yield key.strip(), value.strip()


def _number(value: str, key: str, source: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise AllocConfError(f"{source}: {key}:{value} needs a number") from None


def _divisions(value: str, source: str) -> tuple[int, ...]:
    """A single number for every interval, or `[MB:divisions,...,>:divisions]` as torch reads it."""
    def check(v: str) -> int:
        n = int(_number(v, "roundup_power2_divisions", source))
        if n != 0 and (n < 1 or n & (n - 1)):
            raise AllocConfError(f"{source}: roundup_power2_divisions value {v} must be a power of two")
        return n

    if not value.startswith("["):
        return (check(value),) * POWER2_INTERVALS
    out = [0] * POWER2_INTERVALS
    first, last = True, 0
    for pair in value.strip("[]").split(","):
        key, sep, v = pair.partition(":")
        if not sep:
            raise AllocConfError(f"{source}: roundup_power2_divisions entry {pair!r} is not MB:divisions")
        n = check(v)
        if key.strip() == ">":
            out[last + 1:] = [n] * (POWER2_INTERVALS - last - 1)
            continue
        mb = int(_number(key, "roundup_power2_divisions", source))
        if mb < 1 or mb & (mb - 1):
            raise AllocConfError(f"{source}: roundup_power2_divisions size {key} must be a power of two in MB")
        index = min(mb.bit_length() - 1, POWER2_INTERVALS - 1)
        if first:
            out[:index] = [n] * index
            first = False
        out[index] = n
        last = index
    return tuple(out)


def round_size(size: int, conf: AllocatorConf = AllocatorConf()) -> int:
    """The block size a request of `size` bytes takes (torch's round_size)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    index = min(max(size.bit_length() - 1 - 20, 0), POWER2_INTERVALS - 1)
    divisions = conf.roundup_power2_divisions[index]
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment a rounded request takes from the driver when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Block:
    """A range of a segment, allocated or free (torch's Block)."""

    __slots__ = (
        "addr",
        "allocated",
        "gc_base",
        "mapped",
        "next",
        "pending",
        "pool",
        "prev",
        "requested",
        "segment",
        "size",
        "stream",
    )

    def __init__(self, stream: int, size: int, addr: int, pool: _Pool, segment: _Expandable | None = None):
        self.stream, self.size, self.addr, self.pool, self.segment = stream, size, addr, pool, segment
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.pending = False  # freed, its use on another stream not yet complete
        self.gc_base = 0
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free blocks of one pool, per stream, sorted by (size, address); unmapped expandable ranges by address."""

    __slots__ = ("free", "gc_calls", "small", "unmapped")

    def __init__(self, small: bool):
        self.small = small
        self.free: dict[int, list] = {}
        self.unmapped: dict[int, list] = {}
        self.gc_calls = 0

    def insert(self, block: Block) -> None:
        block.gc_base = self.gc_calls
        insort(self.free.setdefault(block.stream, []), (block.size, block.addr, block))

    def remove(self, block: Block) -> None:
        blocks = self.free[block.stream]
        del blocks[bisect_left(blocks, (block.size, block.addr))]

    def insert_unmapped(self, block: Block) -> None:
        insort(self.unmapped.setdefault(block.stream, []), (block.addr, block))

    def remove_unmapped(self, block: Block) -> None:
        blocks = self.unmapped[block.stream]
        del blocks[bisect_left(blocks, (block.addr,))]

    def ordered(self) -> list[Block]:
        return [b for stream in sorted(self.free) for _, _, b in self.free[stream]]


class _Expandable:
    """One expandable segment: a reserved address range mapped in pages as needed."""

    __slots__ = ("base", "mapped", "page", "pages")

    def __init__(self, base: int, page: int, pages: int):
        self.base, self.page, self.pages = base, page, pages
        self.mapped = bytearray(pages)

    def size(self) -> int:
        return self.page * self.pages


@dataclass(frozen=True)
class Segment:
    """One segment at a moment: its stream, pool, bytes reserved and bytes in allocated blocks."""

    stream: int
    small: bool
    expandable: bool
    size: int
    allocated: int


@dataclass
class OutOfMemory:
    """Where a simulated allocation failed."""

    size: int  # the request, bytes
    reserved: int  # reserved when it failed (after releasing what could be released)
    allocated: int  # bytes in allocated blocks then
    limit: int | None


@dataclass
class Stats:
    reserved: int = 0
    peak_reserved: int = 0
    allocated: int = 0  # bytes in allocated blocks (torch's allocated_bytes: rounded sizes)
    peak_allocated: int = 0
    segments_allocated: int = 0  # cudaMalloc calls and page mappings
    segments_freed: int = 0  # cudaFree calls and page unmappings
    retries: int = 0  # allocations that released cached segments first
    ooms: list[OutOfMemory] = field(default_factory=list)


class CachingAllocator:
    """The allocator of one device. `limit`: the per-process cap in bytes
    (`set_per_process_memory_fraction` x total memory); `device_bytes`: what the driver can hand out in
    all (None: unlimited). Sizes are bytes; streams are any integers."""

    def __init__(self, conf: AllocatorConf | None = None, *, limit: int | None = None,
                 device_bytes: int | None = None):
        self.conf = conf or AllocatorConf()
        if self.conf.backend != "native":
            raise AllocConfError(f"backend:{self.conf.backend} hands memory to CUDA's own pool allocator, which this "
                                 "model does not follow; predict with backend:native")
        self.limit = limit
        self.device_bytes = device_bytes
        self.max_split = self.conf.max_split_size if self.conf.max_split_size is not None else math.inf
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.stats = Stats()
        self.pending: list[Block] = []  # freed blocks waiting for their use on another stream to complete
        self.live: set[Block] = set()
        self.expandable: list[_Expandable] = []
        self._next_addr = 1 << 56
        self._address_space = 0
        if device_bytes is not None:
            self._address_space = device_bytes + device_bytes // 8
        self._gc_on = limit is not None and self.conf.garbage_collection_threshold > 0.0

    # --- the public operations ---

    def malloc(self, size: int, stream: int = 0) -> Block | None:
        """Allocate `size` bytes on `stream`; None when it would run out of memory (recorded in stats.ooms)."""
        conf = self.conf
        rsize = round_size(size, conf)
        pool = self.small if rsize <= SMALL_SIZE else self.large
        block = self._get_free_block(pool, stream, rsize)
        if block is None:
            alloc_size = segment_size(rsize)
            if self._gc_on:
                self._garbage_collect()
            block = self._alloc_block(pool, stream, rsize, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, stream, rsize):
                block = self._alloc_block(pool, stream, rsize, alloc_size)
            if block is None:
                self.stats.retries += 1
                self._release_cached_blocks()
                block = self._alloc_block(pool, stream, rsize, alloc_size)
            if block is None:
                self.stats.ooms.append(OutOfMemory(size, self.stats.reserved, self.stats.allocated, self.limit))
                return None
        remaining = block.size - rsize
        if pool.small or conf.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = rsize < self.max_split and remaining > SMALL_SIZE
        if split:
            rest = block
            block = Block(stream, rsize, rest.addr, pool, rest.segment)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += rsize
            rest.size -= rsize
            pool.insert(rest)
        block.allocated = True
        block.requested = size
        self.live.add(block)
        stats = self.stats
        stats.allocated += block.size
        if stats.allocated > stats.peak_allocated:
            stats.peak_allocated = stats.allocated
        return block

    def free(self, block: Block) -> None:
        """Free a block used on its own stream only: it is reusable at once."""
        self.free_requested(block)
        self.free_completed(block)

    def free_requested(self, block: Block) -> None:
        """The program dropped the block; it comes back to the pool at `free_completed` (at once for a
        block used on its own stream only, later for one recorded on another stream)."""
        if not block.allocated:
            raise ValueError("free of a block that is not allocated")
        block.allocated = False
        block.pending = True
        self.live.discard(block)
        self.stats.allocated -= block.size
        self.pending.append(block)

    def free_completed(self, block: Block) -> None:
        """The block's last use completed: it merges with free neighbours and is cached for reuse. A block
        whose free was completed already (the model synchronised to release memory) is left alone."""
        if block.pending:
            if self.pending[-1] is block:
                self.pending.pop()
            else:
                self.pending.remove(block)
            self._free_block(block)

    def fits(self, size: int, stream: int = 0) -> bool:
        """Whether `malloc(size, stream)` would be served from a cached block, without a new segment or a
        mapped page; the allocator is left as it was. A block allocated so and freed at once leaves the
        allocator's blocks as they were (the split-off rest merges back)."""
        if self.conf.expandable_segments or self._gc_on:
            return False
        rsize = round_size(size, self.conf)
        pool = self.small if rsize <= SMALL_SIZE else self.large
        block = self._get_free_block(pool, stream, rsize)
        if block is None:
            return False
        pool.insert(block)
        return True

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every unsplit cached segment back to the driver."""
        self._release_cached_blocks()

    def segments(self) -> list[Segment]:
        """The segments now (an expandable segment's mapped run counts as one), by address."""
        heads: dict[int, Block] = {}
        for block in list(self.live) + self.pending + self.small.ordered() + self.large.ordered():
            head = block
            while head.prev is not None and head.prev.mapped:
                head = head.prev
            heads[head.addr] = head
        out = []
        for addr in sorted(heads):
            head, size, used = heads[addr], 0, 0
            block = head
            while block is not None and block.mapped:
                size += block.size
                used += block.size if block.allocated else 0
                block = block.next
            out.append(Segment(head.stream, head.pool.small, head.segment is not None, size, used))
        return out

    def fingerprint(self) -> tuple:
        """The allocator's state as a value: every block's range, stream, pool and use (allocated, freed
        with its use on another stream pending, cached with its age for the garbage collector), the
        unmapped ranges of expandable segments and where the next segment goes. Two allocators whose
        fingerprints are equal serve the same requests from the same blocks."""
        small, large = self.small, self.large
        used = sorted((b.addr, b.size, b.stream, b.pool.small, b.pending, b.prev is None, b.next is None)
                      for b in (*self.live, *self.pending))
        cached = sorted((b.addr, b.size, b.stream, pool.small, pool.gc_calls - b.gc_base, b.prev is None,
                         b.next is None) for pool in (small, large) for b in pool.ordered())
        unmapped = sorted((b.addr, b.size, b.stream) for pool in (small, large)
                          for blocks in pool.unmapped.values() for _, b in blocks)
        return self._next_addr, self.stats.reserved, tuple(used), tuple(cached), tuple(unmapped)

    # --- torch's private methods, by the same names ---

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        if self._gc_on:
            pool.gc_calls += 1
        blocks = pool.free.get(stream)
        if not blocks:
            return None
        i = bisect_left(blocks, (size,))
        if i == len(blocks):
            return None
        block = blocks[i][2]
        if block.segment is not None:
            if self.conf.expandable_segments:
                def room(b: Block) -> int:  # what a block can grow to by mapping the range after it
                    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
                while block.segment is not None and i + 1 < len(blocks) and room(blocks[i + 1][2]) < room(block):
                    i += 1
                    block = blocks[i][2]
            else:
                i += 1
                while i < len(blocks) and blocks[i][2].segment is not None:
                    i += 1
                if i == len(blocks):
                    return None
                block = blocks[i][2]
        if size < self.max_split and block.size >= self.max_split:
            return None  # no oversize block for a request below max_split_size
        if size >= self.max_split and block.size >= size + self.conf.max_non_split_rounding:
            return None  # an oversize block only for a request nearly its size
        del blocks[i]
        return block

    def _over(self, extra: int) -> bool:
        reserved = self.stats.reserved + extra
        return (self.limit is not None and reserved > self.limit) or (
            self.device_bytes is not None and reserved > self.device_bytes)

    def _alloc_block(self, pool: _Pool, stream: int, size: int, alloc_size: int) -> Block | None:
        if self.limit is not None and self.stats.reserved + alloc_size > self.limit:
            return None
        if self.conf.expandable_segments:
            return self._allocate_expandable(pool, stream, size)
        if self._over(alloc_size):
            return None
        block = Block(stream, alloc_size, self._take_addresses(alloc_size), pool)
        self._reserve(alloc_size)
        return block

    def _take_addresses(self, size: int) -> int:
        # Each new segment below the last, as the driver placed cudaMalloc's segments on the recorded
        # runs; it decides between free blocks of one size (the lowest address is taken first).
        self._next_addr -= -(-size // ROUND_LARGE) * ROUND_LARGE + ROUND_LARGE  # a gap: segments never touch
        return self._next_addr

    def _reserve(self, size: int) -> None:
        stats = self.stats
        stats.reserved += size
        stats.segments_allocated += 1
        if stats.reserved > stats.peak_reserved:
            stats.peak_reserved = stats.reserved

    def _unreserve(self, size: int) -> None:
        self.stats.reserved -= size
        self.stats.segments_freed += 1

    def _free_block(self, block: Block) -> None:
        block.pending = False
        pool = block.pool
        for other in (block.prev, block.next):
            self._try_merge(block, other, pool)
        pool.insert(block)

    def _try_merge(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or src.pending or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _release_block(self, block: Block) -> None:
        block.pool.remove(block)
        self._unreserve(block.size)

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        if self.max_split == math.inf:
            return False
        blocks = pool.free.get(stream) or []
        key = max(size, self.max_split)
        i = bisect_left(blocks, (key,))
        if i < len(blocks) and blocks[i][2].segment is None:
            self._release_block(blocks[i][2])
            return True
        released = 0
        for _, _, block in reversed(blocks[:i]):  # largest first, while oversize
            if released >= key or block.size < self.max_split:
                break
            if block.segment is None:
                self._release_block(block)
                released += block.size
        return released >= key

    def _release_cached_blocks(self) -> None:
        for block in list(self.pending):  # synchronize: every outstanding free completes
            self.pending.remove(block)
            self._free_block(block)
        for pool in (self.large, self.small):
            to_unmap = []
            for block in pool.ordered():
                if block.segment is not None:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.remove_unmapped(block)
                    self.expandable.remove(block.segment)

    def _garbage_collect(self) -> None:
        threshold = int(self.conf.garbage_collection_threshold * self.limit)
        if self.stats.reserved <= threshold:
            return
        target = self.stats.reserved - threshold
        pool = self.large
        candidates = [b for b in pool.ordered() if not b.is_split()]
        total_age = sum(pool.gc_calls - b.gc_base for b in candidates)
        count = len(candidates)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age = total_age / count
            freed = False
            for block in pool.ordered():
                if not block.is_split() and block.segment is None and pool.gc_calls - block.gc_base >= age:
                    freed = True
                    reclaimed += block.size
                    total_age -= pool.gc_calls - block.gc_base
                    count -= 1
                    self._release_block(block)

    # --- expandable segments ---

    def _allocate_expandable(self, pool: _Pool, stream: int, size: int) -> Block | None:
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, stream: int, size: int) -> Block:
        def free_here(b: Block | None) -> bool:
            return b is not None and not b.allocated and not b.pending

        for _, block in pool.unmapped.get(stream) or ():
            c = block.prev if free_here(block.prev) else block
            room, b = 0, c
            while room < size and free_here(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        space = self._address_space or (1 << 40)  # the address space: 9/8 of the device's memory
        segment = _Expandable(0, page, -(-space // page))
        segment.base = self._take_addresses(segment.size())
        self.expandable.append(segment)
        block = Block(stream, segment.size(), segment.base, pool, segment)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _map_block(self, block: Block, size: int) -> bool:
        segment = block.segment
        begin = (block.addr - segment.base) // segment.page
        end = -(-(block.addr + size - segment.base) // segment.page)
        mapped = (end - begin) * segment.page
        if self.device_bytes is not None and self.stats.reserved + mapped > self.device_bytes:
            return False
        segment.mapped[begin:end] = b"\x01" * (end - begin)
        pool = block.pool
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.stream, block.size - mapped, block.addr + mapped, pool, segment)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.insert_unmapped(rest)
            block.size = mapped
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self._reserve(mapped)
        return True

    def _unmap_block(self, block: Block) -> None:
        segment = block.segment
        begin = -(-(block.addr - segment.base) // segment.page)
        end = (block.addr + block.size - segment.base) // segment.page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        start = segment.base + begin * segment.page
        size = (end - begin) * segment.page
        before = start - block.addr
        if before > 0:
            head = Block(block.stream, before, block.addr, pool, segment)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            pool.insert(head)
        after = block.size - before - size
        if after > 0:
            tail = Block(block.stream, after, start + size, pool, segment)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pool.insert(tail)
        block.addr, block.size, block.mapped = start, size, False
        segment.mapped[begin:end] = bytes(end - begin)
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert_unmapped(block)
        self._unreserve(size)
