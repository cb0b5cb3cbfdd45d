"""The caching allocator model (picockpt/measurement/allocator.py) rule by rule against hand calculations, its replay of a
real step's trace (picockpt/measurement/alloc_trace.py) against the tracker, its errors, and on a GPU against
torch.cuda.memory_stats()."""
import pytest
import torch

from picockpt import Config, init_params
from picockpt.measurement.alloc_trace import Event, measure_on_cuda, only, pool_from_snapshot, record_step, step_on_cuda
from picockpt.measurement.allocator import (LARGE_BUFFER, MIB, SMALL_BUFFER, CachingAllocator, pool_of, replay, round_size,
                                segment_size, should_split)
from picockpt.measurement.measure import make_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- one rule at a time -------------------------------------------------------------------------

def test_round_size_to_512_bytes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1024, 1536]
    assert round_size(MIB + 1) == MIB + 512


def test_pool_of_a_rounded_size():
    assert pool_of(round_size(MIB)) == "small"  # 1 MiB exactly: the largest small request
    assert pool_of(round_size(MIB + 1)) == "large"  # rounds to 1 MiB + 512


def test_segment_size_per_request():
    assert segment_size(round_size(1000)) == 2 * MIB  # kSmallBuffer
    assert segment_size(round_size(MIB + 1)) == 20 * MIB  # kLargeBuffer
    assert segment_size(round_size(10 * MIB - 512)) == 20 * MIB  # still under kMinLargeAlloc
    assert segment_size(round_size(10 * MIB - 1)) == 10 * MIB  # rounds up to 10 MiB: its own segment
    assert segment_size(10 * MIB) == 10 * MIB  # from kMinLargeAlloc on: its own size ...
    assert segment_size(round_size(12 * MIB + 1)) == 14 * MIB  # ... up to a multiple of kRoundLarge


def test_split_or_not():
    assert should_split(2 * MIB, 1024)  # small pool: a rest of 2 MiB - 1 KiB
    assert should_split(2048, 1536) and not should_split(2048, 2048)  # a rest of 512 B splits, none does not
    assert not should_split(12 * MIB, 11 * MIB + 512)  # large pool: a rest of 1 MiB - 512 B stays in the block
    assert not should_split(13 * MIB, 12 * MIB)  # exactly kSmallSize left: not more than it
    assert should_split(13 * MIB + 512, 12 * MIB)


def test_the_three_requests_of_the_lesson():
    for size, (allocated, reserved) in {1000: (1024, 2 * MIB), 3 * MIB // 2: (3 * MIB // 2, 20 * MIB),
                                        12 * MIB: (12 * MIB, 12 * MIB)}.items():
        pool = CachingAllocator()
        pool.malloc("t", size)
        assert (pool.requested, pool.allocated, pool.reserved) == (size, allocated, reserved), size
    pool = CachingAllocator()
    pool.malloc("t", 11 * MIB + 1)  # a 12 MiB segment whose 1 MiB - 512 B rest is not split off
    assert (pool.allocated, pool.reserved, len(pool.free_blocks())) == (12 * MIB, 12 * MIB, 0)


def test_split_blocks_share_a_segment_and_the_last_one_takes_the_rest():
    pool = CachingAllocator()
    size = 7 * MIB // 4  # 1.75 MiB: eleven of them fill a 20 MiB segment
    for n in range(12):
        pool.malloc(n, size)
    assert pool.reserved == 40 * MIB and pool.device_mallocs == 2
    assert pool.live[10].size == 20 * MIB - 10 * size  # the 11th: 2.5 MiB, its 0.75 MiB rest kept
    assert pool.allocated == 20 * MIB + size  # the first segment all handed out, the 12th in the second


def test_best_fit_takes_the_smallest_block_that_fits_then_the_lowest_address():
    pool = CachingAllocator()
    for key in "abcd":
        pool.malloc(key, 4 * MIB)  # one 20 MiB segment: a b c d, then a free 4 MiB rest
    pool.free("a")  # free: a (4 MiB, lowest address), the 4 MiB rest after d
    block = pool.malloc("e", 3 * MIB)
    assert block.address == 0 and block.size == 4 * MIB  # equal sizes: the lowest address; rest not split
    pool.free("c")
    pool.free("e")
    assert sorted(b.size for b in pool.free_blocks()) == [4 * MIB, 4 * MIB, 4 * MIB]
    pool.free("b")  # a, b, c merge into one 12 MiB block
    assert sorted(b.size for b in pool.free_blocks()) == [4 * MIB, 12 * MIB]
    assert pool.malloc("f", 2 * MIB).address == 16 * MIB  # the 4 MiB rest, not the 12 MiB block


def test_coalescing_and_fragmentation():
    pool = CachingAllocator()
    for key in "abc":
        pool.malloc(key, 6 * MIB)  # a 20 MiB segment: 6 + 6 + 6, a 2 MiB rest
    pool.free("a")
    pool.free("c")  # c merges with the 2 MiB rest: free blocks 6 and 8 MiB
    assert sorted(b.size for b in pool.free_blocks()) == [6 * MIB, 8 * MIB] and pool.largest_free == 8 * MIB
    pool.malloc("d", 10 * MIB)  # no free block fits: a new 10 MiB segment beside 14 MiB of free blocks
    assert pool.state() == {"requested": 16 * MIB, "allocated": 16 * MIB, "reserved": 30 * MIB,
                            "cached": 14 * MIB, "largest_free": 8 * MIB, "segments": 2}
    pool.free("b")  # a, b and c's blocks merge back into the whole segment
    assert [b.size for b in pool.free_blocks()] == [20 * MIB]


def test_reuse_after_free_and_separate_pools():
    pool = CachingAllocator()
    pool.malloc("x", 3 * MIB // 2)
    pool.free("x")
    pool.malloc("y", 3 * MIB // 2)  # the same size again: the cached block, no cudaMalloc
    assert pool.device_mallocs == 1 and pool.last == "cached" and pool.reserved == 20 * MIB
    pool.malloc("z", 1000)  # a small request never takes a large-pool block
    assert pool.device_mallocs == 2 and pool.reserved == 20 * MIB + SMALL_BUFFER


def test_only_empty_cache_gives_segments_back():
    pool = CachingAllocator()
    pool.malloc("big", 12 * MIB)
    pool.malloc("a", 1000)
    pool.malloc("b", 1000)
    pool.free("big")
    pool.free("a")
    assert pool.reserved == 12 * MIB + SMALL_BUFFER  # freeing releases nothing
    pool.empty_cache()  # the wholly free 12 MiB segment goes; the small one holds b
    assert pool.reserved == SMALL_BUFFER and len(pool.segments) == 1


def test_max_split_size():
    pool = CachingAllocator(max_split_size_mb=20)
    pool.malloc("big", 30 * MIB)
    pool.free("big")  # a free 30 MiB block, oversize
    pool.malloc("small", 5 * MIB)  # an oversize block serves no smaller request: a new 20 MiB segment
    assert pool.device_mallocs == 2 and pool.reserved == 50 * MIB
    assert pool.malloc("large", 25 * MIB).size == 30 * MIB  # >= max_split_size: taken whole (within kLargeBuffer)
    pool.free("large")
    pool.malloc("huge", 60 * MIB)
    pool.free("huge")
    pool.malloc("mid", 24 * MIB)  # the smallest that fits: 30 MiB, within kLargeBuffer of 24 MiB
    assert pool.live["mid"].size == 30 * MIB and pool.device_mallocs == 3
    pool.free("mid")
    pool.free("small")  # the 20 MiB segment is whole again: oversize itself
    pool.malloc("again", 5 * MIB)
    assert pool.device_mallocs == 4 and pool.reserved == 50 * MIB + 60 * MIB + LARGE_BUFFER
    pool = CachingAllocator(max_split_size_mb=20)
    pool.malloc("huge", 60 * MIB)
    pool.free("huge")
    pool.malloc("mid", 24 * MIB)  # 60 MiB >= 24 + 20 MiB (kLargeBuffer): too wasteful, a 24 MiB segment instead
    assert pool.device_mallocs == 2 and pool.live["mid"].size == 24 * MIB


# ---- clear errors ---------------------------------------------------------------------------------

def test_errors_name_the_mistake():
    pool = CachingAllocator()
    with pytest.raises(ValueError, match=r"free\('ghost'\): no live tensor"):
        pool.free("ghost")
    with pytest.raises(ValueError, match="size=-1"):
        pool.malloc("neg", -1)
    with pytest.raises(ValueError, match="size=1.5"):
        pool.malloc("half", 1.5)
    pool.malloc("t", 10)
    with pytest.raises(ValueError, match="allocated already"):
        pool.malloc("t", 10)
    pool.free("t")
    with pytest.raises(ValueError, match="freed already"):
        pool.free("t")
    with pytest.raises(ValueError, match="max_split_size_mb=10"):
        CachingAllocator(max_split_size_mb=10)
    with pytest.raises(ValueError, match="event 1: kind='keep'"):
        replay([Event("alloc", 0, 8, "forward", None), Event("keep", 0, 8, "forward", None)])
    with pytest.raises(ValueError, match=r"free\(7\)"):
        replay([Event("free", 7, 8, "forward", None)])
    with pytest.raises(ValueError, match="needs a CUDA device"):
        measure_on_cuda(lambda: None, "cpu")


def test_zero_byte_tensors_take_no_block():
    pool = CachingAllocator()
    assert pool.malloc("empty", 0) is None and pool.reserved == 0
    pool.free("empty")


def test_a_pool_from_a_snapshot():
    """torch.cuda.memory_snapshot()'s layout, written by hand: the model starts from what it lists."""
    snapshot = [
        {"device": 0, "address": 1 << 30, "segment_type": "large", "total_size": 20 * MIB,
         "blocks": [{"size": 6 * MIB, "requested_size": 6 * MIB - 100, "state": "active_allocated"},
                    {"size": 14 * MIB, "requested_size": 0, "state": "inactive"}]},
        {"device": 0, "address": 1 << 29, "segment_type": "small", "total_size": 2 * MIB,
         "blocks": [{"size": 512, "requested_size": 4, "state": "active_allocated"},
                    {"size": 2 * MIB - 512, "requested_size": 0, "state": "inactive"}]},
        {"device": 1, "address": 1 << 31, "segment_type": "large", "total_size": 40 * MIB,
         "blocks": [{"size": 40 * MIB, "requested_size": 0, "state": "inactive"}]}]  # another GPU's: left out
    pool = pool_from_snapshot(snapshot, 0)
    assert pool.state() == {"requested": 6 * MIB - 96, "allocated": 6 * MIB + 512, "reserved": 22 * MIB,
                            "cached": 16 * MIB - 512, "largest_free": 14 * MIB, "segments": 2}
    assert pool.malloc("x", 10 * MIB).address == (1 << 30) + 6 * MIB and pool.last == "cached"
    pool.free(("before", 1 << 30, 0))  # a block the snapshot listed can be freed like any other
    assert sorted(b.size for b in pool.free_blocks("large")) == [4 * MIB, 6 * MIB]
    assert pool_from_snapshot(snapshot, 0, max_split_size=64 * MIB).max_split_size == 64 * MIB
    with pytest.raises(ValueError, match="expandable"):
        pool_from_snapshot([{**snapshot[0], "is_expandable": True}], 0)


# ---- a real step --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def step():
    cfg = Config.from_preset("small", layers=2)
    params = init_params(cfg, seed=0)
    ids, targets = make_batch(cfg, 2, 192, "cpu", 0)
    return params, cfg, ids, targets


@pytest.mark.parametrize("policy", ["none", "full", "every:2", "selective"])
def test_replay_of_a_step_equals_the_tracker(step, policy):
    trace, tracker = record_step(*step, policy)
    frees = [event.key for event in trace if event.kind == "free"]
    assert len(set(frees)) == len(frees) and all(event.size > 0 for event in trace)
    run = replay(trace)
    measured = [row["total"] for row in tracker.timeline if row["kind"] in ("alloc", "free")]
    assert [row["requested"] for row in run.timeline] == measured  # every storage of the step, event by event
    assert run.peak("requested") == max(p["total"] for p in tracker.peaks.values())
    assert replay(only(trace)).peak("requested") == tracker.peak_physical  # activations and working memory
    assert run.peak("requested") <= run.peak("allocated") <= run.peak("reserved")
    category = {event.key: event.category for event in trace}
    left = [(category[key], block.requested) for key, block in run.pool.live.items()]
    params = step[0]
    assert sum(size for kind, size in left if kind == "gradients") == sum(p.nbytes for p in params.values())
    assert [size for kind, size in left if kind != "gradients"] == [4]  # the fp32 loss: the trace ends with the step


def test_recomputation_reuses_the_pool(step):
    none = replay(record_step(*step, "none")[0])
    full = replay(record_step(*step, "full")[0])
    assert full.cached["recompute"] > 0
    assert full.new_segments.get("recompute", 0) < full.cached["recompute"]
    assert full.peak("reserved") < none.peak("reserved")


# ---- on a GPU -----------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_the_model_equals_the_real_allocator_on_plain_tensors():
    device = torch.device("cuda")

    def work():  # the lesson's hand examples, as tensors: no kernel runs, so nothing is hidden from the model
        kept = [torch.empty(n, dtype=torch.uint8, device=device) for n in (1000, 3 * MIB // 2, 12 * MIB, 11 * MIB + 1)]
        parts = [torch.empty(6 * MIB, dtype=torch.uint8, device=device) for _ in range(3)]
        del parts[2], parts[0]
        return kept + parts + [torch.empty(10 * MIB, dtype=torch.uint8, device=device)]
    numbers, _ = measure_on_cuda(work, device)
    assert {name: model for name, (model, _) in numbers.items()} == \
        {name: measured for name, (_, measured) in numbers.items()}


@cuda
def test_a_step_on_the_gpu_against_memory_stats():
    cfg = Config.from_preset("small", layers=2)
    params = init_params(cfg, seed=0, device="cuda")
    ids, targets = make_batch(cfg, 2, 192, "cuda", 0)
    numbers, trace = step_on_cuda(params, cfg, ids, targets, "full")
    model, measured = numbers["requested at the end"]
    assert model == measured  # what lives after the step: the snapshot's blocks and the trace's gradients
    model, measured = numbers["allocated peak"]
    assert model <= measured  # a kernel's own buffer can only add to what the tensors hold
