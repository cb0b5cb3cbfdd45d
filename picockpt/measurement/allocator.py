"""A model of PyTorch's CUDA caching allocator: the rules it uses to turn tensors' requests into segments.

What a GPU shows as "reserved" is not what the tensors asked for. Between the two sit the rules of
c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.13, the native backend, one stream, default settings; recent
versions share some of it with other devices in c10/core/CachingDeviceAllocator.h and parse the settings
in c10/core/AllocatorConfig.cpp), modelled here line by line; each rule names the constant or function
of that file it follows:

    round_size       a request rounds up to a multiple of kMinBlockSize (512 B), never below it
    pool_of          rounded sizes up to kSmallSize (1 MiB) go to the small pool, the rest to the large pool
    segment_size     a new segment (one cudaMalloc) is kSmallBuffer (2 MiB) for a small request, kLargeBuffer
                     (20 MiB) for one under kMinLargeAlloc (10 MiB), else the request rounded up to kRoundLarge
                     (2 MiB) (get_allocation_size)
    best fit         a request takes the smallest free block of its pool that is big enough, the lowest
                     address first among equal sizes (get_free_block: lower_bound on BlockComparatorSize)
    should_split     the rest of that block becomes a free block of its own when it is at least kMinBlockSize
                     (small pool) or more than kSmallSize (large pool, and the request under max_split_size);
                     otherwise the tensor gets the whole block, remainder included
    coalescing       a freed block merges with a free neighbour of its segment, before and after (free_block,
                     try_merge_blocks); blocks never merge across segments
    release          a segment goes back to the device only when it is one whole free block, by empty_cache()
                     (release_cached_blocks, release_blocks) or by a failed cudaMalloc's retry (not modelled):
                     reserved bytes never fall otherwise
    max_split_size   (PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N, N >= 20, default unlimited) a block of that
                     size or more is never split, serves no smaller request, and serves a larger one only
                     when it is under request + kLargeBuffer (get_free_block, should_split; the tolerance is
                     the max_non_split_rounding_mb setting where a version has it, kLargeBuffer by default)

The three numbers torch.cuda.memory_stats() gives, and this model reports after every event:
    requested   what the live tensors asked for ("requested_bytes"; the tracker's physical bytes)
    allocated   the blocks handed to them: rounding and unsplit remainders included ("allocated_bytes",
                torch.cuda.memory_allocated())
    reserved    every segment, busy or free ("reserved_bytes", torch.cuda.memory_reserved())
and the fragmentation between them: cached = reserved - allocated (free blocks inside segments) and the
largest free block (the biggest request the pool can serve without a new segment).

Not modelled: several streams (a block freed on one stream is reused there only), the out-of-memory path
(no device limit here: cudaMalloc never fails, so cached blocks are never released to retry),
garbage_collection_threshold, roundup_power2_divisions (off by default), expandable_segments, CUDA
graphs' private pools. cudaMalloc's addresses are modelled as consecutive.

    pool = CachingAllocator()
    pool.malloc("x", 1000)      # rounds to 1,024 B in a new 2 MiB small segment
    pool.reserved, pool.allocated, pool.requested     # 2097152, 1024, 1000
    replay(trace)               # a step's trace (picockpt/measurement/alloc_trace.py), event by event and per phase
"""
from dataclasses import dataclass, field

MIB = 1 << 20
MIN_BLOCK_SIZE = 512          # kMinBlockSize: every size rounds up to a multiple of 512 bytes
SMALL_SIZE = 1 * MIB          # kSmallSize: the largest request the small pool serves
SMALL_BUFFER = 2 * MIB        # kSmallBuffer: the small pool's segment size
LARGE_BUFFER = 20 * MIB       # kLargeBuffer: the segment a request of 1 to 10 MiB is cut from
MIN_LARGE_ALLOC = 10 * MIB    # kMinLargeAlloc: from here up, a request gets a segment of its own size ...
ROUND_LARGE = 2 * MIB         # kRoundLarge: ... rounded up to a multiple of 2 MiB
UNLIMITED = float("inf")      # max_split_size's default (SIZE_MAX): every block may be split


def round_size(size):
    """The bytes a request of `size` bytes is rounded to (round_size)."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE  # kMinBlockSize: nothing smaller than 512 B
    return MIN_BLOCK_SIZE * -(-size // MIN_BLOCK_SIZE)  # up to the next multiple of kMinBlockSize


def pool_of(rounded):
    """"small" or "large": the pool a rounded request is served from (get_pool)."""
    return "small" if rounded <= SMALL_SIZE else "large"  # kSmallSize, inclusive


def segment_size(rounded):
    """The bytes of the segment a new cudaMalloc makes for a rounded request (get_allocation_size)."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER  # kSmallBuffer: small requests are packed into 2 MiB segments
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER  # kLargeBuffer: 1 to 10 MiB requests share 20 MiB segments
    return ROUND_LARGE * -(-rounded // ROUND_LARGE)  # kRoundLarge: a segment of its own, rounded up to 2 MiB


def should_split(block_size, rounded, max_split_size=UNLIMITED):
    """Whether a free block of `block_size` bytes, given to a rounded request, is cut in two (should_split)."""
    remaining = block_size - rounded
    if pool_of(rounded) == "small":
        return remaining >= MIN_BLOCK_SIZE  # small pool: any rest of at least kMinBlockSize
    return rounded < max_split_size and remaining > SMALL_SIZE  # large pool: a rest of more than kSmallSize


@dataclass
class Block:
    address: int
    size: int
    segment: "Segment"
    owner: object = None   # the key of the tensor in it; None: the block is free
    requested: int = 0     # the bytes its tensor asked for


@dataclass
class Segment:
    address: int
    size: int
    pool: str                                   # "small" or "large"
    blocks: list = field(default_factory=list)  # in address order, covering the segment


class CachingAllocator:
    """The pools of one device and one stream; malloc(key, size), free(key), empty_cache()."""

    def __init__(self, max_split_size_mb=None):
        if max_split_size_mb is not None and (not isinstance(max_split_size_mb, int) or max_split_size_mb < 20):
            raise ValueError(f"max_split_size_mb={max_split_size_mb!r}: use a whole number of MiB, at least 20 "
                             f"(kLargeBuffer, torch's own minimum), or None for unlimited")
        self.max_split_size = UNLIMITED if max_split_size_mb is None else max_split_size_mb * MIB
        self.segments, self.live = [], {}       # the segments; key -> Block (None: a zero-byte request)
        self.requested = self.allocated = self.reserved = 0
        self.device_mallocs = 0                 # segments created (cudaMalloc calls): "num_device_alloc"
        self.next_address = 0                   # where the next segment starts (cudaMalloc, modelled)
        self.last = None                        # what the last malloc did: "cached" or "new segment"

    # -- the three verbs -----------------------------------------------------------------------
    def malloc(self, key, size):
        """A tensor `key` asks for `size` bytes: the Block it gets."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"malloc({key!r}, size={size!r}): a size is a whole number of bytes, 0 or more")
        if key in self.live:
            raise ValueError(f"malloc({key!r}): {key!r} is allocated already; free it first, or give a new key")
        if size == 0:  # torch hands out no memory for an empty tensor (a null pointer, no block)
            self.live[key], self.last = None, "nothing"
            return None
        rounded = round_size(size)
        block, self.last = self._best_fit(rounded, pool_of(rounded)), "cached"
        if block is None:  # nothing cached fits: a new segment (alloc_block)
            block, self.last = self._new_segment(segment_size(rounded), pool_of(rounded)), "new segment"
        if should_split(block.size, rounded, self.max_split_size):
            self._split(block, rounded)  # block keeps `rounded` bytes; the rest is a free block after it
        block.owner, block.requested = key, size
        self.live[key] = block
        self.requested += size
        self.allocated += block.size  # "allocated_bytes" counts the whole block (alloc_found_block)
        return block

    def free(self, key):
        """Tensor `key` is gone: its block goes back to its pool, merged with free neighbours."""
        if key not in self.live:
            raise ValueError(f"free({key!r}): no live tensor has that key (never allocated, or freed already); "
                             f"a trace frees each key once, after allocating it")
        block = self.live.pop(key)
        if block is None:
            return
        self.requested -= block.requested
        self.allocated -= block.size
        block.owner, block.requested = None, 0
        blocks = block.segment.blocks
        index = blocks.index(block)
        if index + 1 < len(blocks) and blocks[index + 1].owner is None:  # try_merge_blocks with the next block
            block.size += blocks.pop(index + 1).size
        if index > 0 and blocks[index - 1].owner is None:  # ... and with the previous one
            blocks[index - 1].size += blocks.pop(index).size

    def empty_cache(self):
        """torch.cuda.empty_cache(): every segment that is one whole free block goes back (release_blocks)."""
        for segment in [s for s in self.segments if len(s.blocks) == 1 and s.blocks[0].owner is None]:
            self.segments.remove(segment)
            self.reserved -= segment.size  # cudaFree: the only way reserved bytes fall

    # -- what it holds -------------------------------------------------------------------------
    def free_blocks(self, pool=None):
        return [b for s in self.segments if pool in (None, s.pool) for b in s.blocks if b.owner is None]

    @property
    def largest_free(self):
        return max((b.size for b in self.free_blocks()), default=0)

    def state(self):
        """{requested, allocated, reserved, cached, largest_free, segments}: the numbers after the last event."""
        return {"requested": self.requested, "allocated": self.allocated, "reserved": self.reserved,
                "cached": self.reserved - self.allocated, "largest_free": self.largest_free,
                "segments": len(self.segments)}

    # -- the rules -----------------------------------------------------------------------------
    def _best_fit(self, rounded, pool):
        """The smallest free block of `pool` that holds `rounded` bytes, lowest address first (get_free_block)."""
        fits = [b for b in self.free_blocks(pool) if b.size >= rounded]
        if not fits:
            return None
        block = min(fits, key=lambda b: (b.size, b.address))  # BlockComparatorSize: size, then address
        if rounded < self.max_split_size <= block.size:
            return None  # max_split_size: an oversize block serves no smaller request
        if rounded >= self.max_split_size and block.size >= rounded + LARGE_BUFFER:
            return None  # ... and a larger one only within kLargeBuffer of its size
        return block

    def _new_segment(self, size, pool):
        segment = Segment(self.next_address, size, pool)
        segment.blocks.append(Block(segment.address, size, segment))  # one free block, the whole segment
        self.segments.append(segment)
        self.next_address += size
        self.reserved += size  # "reserved_bytes" grows by the segment (alloc_block)
        self.device_mallocs += 1
        return segment.blocks[0]

    def _split(self, block, rounded):
        blocks = block.segment.blocks
        rest = Block(block.address + rounded, block.size - rounded, block.segment)  # free, right after
        blocks.insert(blocks.index(block) + 1, rest)
        block.size = rounded

    @classmethod
    def from_segments(cls, segments, max_split_size_mb=None):
        """A pool already holding `segments`: [(address, pool, [(size, owner or None, requested), ...])], each segment's
        blocks in address order (picockpt/measurement/alloc_trace.py reads them from torch.cuda.memory_snapshot())."""
        model = cls(max_split_size_mb)
        for address, pool, blocks in sorted(segments, key=lambda s: s[0]):
            segment = Segment(address, sum(size for size, _, _ in blocks), pool)
            offset = address
            for size, owner, requested in blocks:
                segment.blocks.append(Block(offset, size, segment, owner, requested if owner is not None else 0))
                offset += size
                if owner is not None:
                    model.live[owner] = segment.blocks[-1]
                    model.requested += requested
                    model.allocated += size
            model.segments.append(segment)
            model.reserved += segment.size
            model.next_address = max(model.next_address, address + segment.size)
        return model


@dataclass
class Replay:
    """A trace replayed through the model: `timeline`, one row per event (its kind, phase and the numbers of
    state()), and per phase the peaks, the segments created and the requests the cache served."""
    timeline: list
    peaks: dict         # phase -> {requested, allocated, reserved}: each at its highest within the phase
    new_segments: dict  # phase -> segments created (cudaMalloc calls)
    cached: dict        # phase -> requests served from free cached blocks (no new segment)
    pool: CachingAllocator

    def peak(self, what):
        return max((row[what] for row in self.timeline), default=getattr(self.pool, what))

    def at_peak(self, what):
        """The row where `what` is at its highest (the first such event)."""
        return max(self.timeline, key=lambda row: row[what])


def replay(trace, max_split_size_mb=None, allocator=None):
    """Replay `trace` (events with .kind "alloc" or "free", .key, .size, .phase) through a CachingAllocator
    (a new one, or `allocator` with what it holds already), in order."""
    pool = CachingAllocator(max_split_size_mb) if allocator is None else allocator
    timeline, peaks, new_segments, cached = [], {}, {}, {}
    for index, event in enumerate(trace):
        if event.kind == "alloc":
            pool.malloc(event.key, event.size)
            counter = new_segments if pool.last == "new segment" else cached if pool.last == "cached" else {}
            counter[event.phase] = counter.get(event.phase, 0) + 1
        elif event.kind == "free":
            pool.free(event.key)
        else:
            raise ValueError(f"trace event {index}: kind={event.kind!r}; use 'alloc' or 'free'")
        row = {"index": index, "kind": event.kind, "phase": event.phase, **pool.state()}
        timeline.append(row)
        phase = peaks.setdefault(event.phase, dict.fromkeys(("requested", "allocated", "reserved"), 0))
        for what in phase:
            phase[what] = max(phase[what], row[what])
    return Replay(timeline, peaks, new_segments, cached, pool)
