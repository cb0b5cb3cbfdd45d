"""Time and device memory measured as a GPU runs, checked on the CPU with torch.cuda's functions faked: the allocator
read at the step's phase changes, not per tile pair; Timeline spans as CUDA events with one synchronisation, a span
per phase, not per tile pair; every rank's times from a common zero; data-parallel buckets timed in the streams the
all-reduce runs in; the caching allocator's free blocks counted as free; offloading's host buffers from a pool."""
import multiprocessing
import types

import pytest
import torch

from picockpt import Config, init_params
from picockpt.recompute.engine import Model, Step
from picockpt.measurement.measure import make_batch
from picockpt.parallel.data_parallel import dp_comm
from picockpt.parallel.timeline import MicroBatchTracker, StageMemory, Timeline
from picockpt.recompute.policy import parse_policy
from picockpt.measurement.tracker import Tracker
from picockpt.parallel import Layout

from processes import no_process_left_behind  # noqa: F401 (a fixture)

START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
B, T, TILE = 2, 32, 4  # 8 query tiles: 36 causal tile pairs per layer


def tiled(layers=3):
    cfg = Config.from_preset("tiny", layers=layers, attention="tiled", attention_tile=TILE)
    return cfg, init_params(cfg, seed=0), *make_batch(cfg, B, T, "cpu", 0)


def step(cfg, params, ids, targets, policy, listener):
    policy = parse_policy(policy, cfg)
    with torch.no_grad():
        run = Step(Model(params, cfg, ids, targets), policy.schedule(cfg, B, T), policy.unstored, listener)
        run.forward()
        run.backward()


# ---- the allocator's peak is read at phase changes, not per tile pair -----------------------------------------

def fake_allocator(monkeypatch, peaks=None):
    """torch.cuda's memory functions, counted: max_memory_allocated answers from `peaks` in turn (else 0)."""
    calls = {"max": 0, "reset": 0}
    answers = iter(peaks or ())

    def peak(device=None):
        calls["max"] += 1
        return next(answers, 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.__setitem__(
        "reset", calls["reset"] + 1))
    return calls


def test_device_memory_is_read_at_the_step_s_phase_changes_not_per_tile_pair(monkeypatch):
    """full under tiled attention: each layer's backward rebuilds 36 tiles, in and out of "recompute" (72 switches);
    the allocator is read at the real changes only: into and out of forward and backward (4), into and out of each
    layer's recompute (2 L: into it at its first store event, reading its checkpoint), and once at the end."""
    cfg, params, ids, targets = tiled()
    calls = fake_allocator(monkeypatch)
    with Tracker("cuda", physical=False, flops=False) as tracker:
        step(cfg, params, ids, targets, "full", tracker)
    switches = sum(record[0] == "phase" for record in tracker.log)
    assert switches == 4 + 2 * cfg.layers + 2 * 36 * cfg.layers  # 4 + 6 + 216: every tile pair switches twice
    assert calls["max"] == 4 + 2 * cfg.layers + 1 == 11
    assert calls["reset"] == calls["max"] + 1  # and once as the step starts


def test_a_phase_inside_another_books_its_peak_from_its_first_store_event(monkeypatch):
    fake_allocator(monkeypatch, peaks=[1, 10, 2, 20, 30, 40, 3])  # answers to the 7 reads, in order
    event = types.SimpleNamespace(kind="get", layer=0, name="input", live_bytes=0)
    with Tracker("cuda", physical=False, flops=False) as tracker:
        with tracker.phase("forward"):  # read 1 (outside, before it)
            pass
        with tracker.phase("backward"):  # read 2 (forward), read 3 (outside)
            with tracker.phase("recompute"):
                tracker.on_event(event)  # read 4: backward so far; read 5 on the way out: this recompute
            with tracker.phase("recompute"):  # no store event in here (a tile's rebuild): booked to backward
                pass
        # read 6 (backward), read 7 at the end (outside)
    assert {name: tracker.cuda_phase_peak[name] for name in ("forward", "recompute", "backward", "outside")} == {
        "forward": 10, "recompute": 30, "backward": 40, "outside": 3}


# ---- Timeline spans, CUDA events resolved once; a span per phase, not per tile pair ----------------------------

class FakeGPU:
    """A CUDA device's clock as the host sees it through events: each stream has its own GPU time (seconds); an
    event recorded in a stream takes that stream's time; synchronize() is counted."""

    def __init__(self, monkeypatch):
        self.syncs, self.compute = 0, FakeStream(self)
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = (stream or gpu.compute).clock

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3  # ms
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.compute)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: gpu.sync())

    def sync(self):
        self.syncs += 1


class FakeStream:
    def __init__(self, gpu, clock=0.0):
        self.gpu, self.clock = gpu, clock

    def synchronize(self):
        self.gpu.sync()


def test_timeline_spans_are_cuda_events_timed_once_at_finish(monkeypatch):
    gpu = FakeGPU(monkeypatch)
    gpu.compute.clock = 100.0  # the GPU's clock when the timeline is made: its zero
    timeline = Timeline("cuda")
    assert gpu.syncs == 1  # the origin: recorded in an idle stream
    timeline.begin()
    for m in range(50):
        with timeline.span("forward", m):
            gpu.compute.clock += 0.5  # the GPU's time, not the host's: the host has long returned
            with timeline.span("wait"):
                gpu.compute.clock += 0.25
    assert gpu.syncs == 1  # no span edge waits for the GPU
    timeline.finish()
    assert gpu.syncs == 2  # once, for the whole step
    assert (timeline.start, timeline.end) == (0.0, 37.5)
    assert timeline.totals()["forward"] == 25.0 and timeline.totals()["wait"] == 12.5
    assert timeline.relative()[:2] == [("forward", 0, 0.0, 0.5), ("wait", 0, 0.5, 0.75)]


def test_a_tiled_step_has_a_span_per_phase_not_per_tile_pair():
    """Every tile pair's rebuild enters "recompute" and leaves it (72 switches a layer); the Timeline keeps the step's
    phases: the forward, the backward, and each layer's recompute from its checkpoint, then its backward."""
    cfg, params, ids, targets = tiled()
    timeline = Timeline("cpu")
    with Tracker("cpu", physical=False, flops=False) as tracker:
        memory = StageMemory(tracker, timeline)
        timeline.begin()
        step(cfg, params, ids, targets, "full", MicroBatchTracker(memory, 0))
        timeline.finish()
    assert [kind for kind, *_ in timeline.segments] == ["forward", "backward"] + ["recompute", "backward"] * 3
    assert sum(record[0] == "phase" for record in tracker.log) == 4 + 2 * 3 + 2 * 36 * 3  # the tracker saw them all


@pytest.mark.parametrize("policy, attention", [("selective", "eager"), ("cheap", "eager"), ("none", "tiled")])
def test_a_rebuild_inside_the_backward_is_timed_as_recompute(policy, attention):
    """selective's and cheap's recipes, and tiled attention's tiles, rebuild inside the backward with no store event:
    no span of their own, but their seconds are recompute's (as their FLOPs are), taken from the backward's."""
    cfg, params, ids, targets = tiled()
    cfg = cfg.replace(attention=attention)
    timeline = Timeline("cpu")
    with Tracker("cpu", physical=False, flops=False) as tracker:
        memory = StageMemory(tracker, timeline)
        timeline.begin()
        step(cfg, params, ids, targets, policy, MicroBatchTracker(memory, 0))
        timeline.finish()
    assert {kind for kind, *_ in timeline.segments} == {"forward", "backward"}  # still a span per phase
    seconds = timeline.totals()
    assert seconds["recompute"] > 0 and seconds["backward"] > 0
    spans = sum(end - start for _, _, start, end in timeline.segments)
    assert seconds["forward"] + seconds["recompute"] + seconds["backward"] == pytest.approx(spans)


def test_every_rank_s_times_count_from_the_moment_it_left_the_barrier(monkeypatch):
    """Two machines' monotonic clocks read 5000.0 and 12.0 at the same moment (their origins are their own): made
    right after a barrier, each timeline counts from it, so a step that began 0.25 s later begins at 0.25 on both."""
    starts = []
    for host_clock in (5000.0, 12.0):
        now = [host_clock]
        monkeypatch.setattr("picockpt.parallel.timeline.time.monotonic", lambda: now[0])
        timeline = Timeline("cpu")
        now[0] += 0.25
        timeline.begin()
        now[0] += 1.0
        timeline.finish()
        starts.append((timeline.start, timeline.end))
    assert starts == [(0.25, 1.25), (0.25, 1.25)]


@pytest.mark.ranks
@pytest.mark.usefixtures("no_process_left_behind")
def test_two_ranks_report_their_start_from_the_common_zero():
    """A rank's report: timeline_start in seconds since its barrier (not its machine's monotonic clock, which counts
    from the machine's boot), and its data-parallel buckets inside its step."""
    from picockpt.parallel import ParallelJob, run_jobs
    cfg = Config.from_preset("tiny", layers=2)
    ids, targets = make_batch(cfg, 2, 8, "cpu", 0)
    job = ParallelJob(init_params(cfg, seed=0), cfg, ids, targets, "full", Layout(dp=2))
    (_, _, reports), = run_jobs([job], 2, start_method=START, timeout_s=120)
    for r in reports:
        total = r["timeline_seconds"]["total"]
        assert 0 <= r["timeline_start"] < 10, r["timeline_start"]  # a few milliseconds after the barrier
        assert r["dp_buckets"] and all(0 <= start <= end <= total for _, _, start, end in r["dp_buckets"])


# ---- data-parallel buckets timed in the streams the all-reduce runs in -----------------------------------------

def test_cuda_buckets_are_timed_by_events_in_the_streams_the_all_reduce_runs_in(monkeypatch):
    """NCCL queues an all-reduce and returns at once; the host's clock after it (or after wait()) is queue time. Here
    the compute stream reaches the launch at GPU time 2.0 and NCCL's stream finishes the all-reduce at 3.5: the
    bucket's times are those, from an event before the launch and one in the buckets' stream after wait()."""
    gpu = FakeGPU(monkeypatch)
    timeline = Timeline("cuda")
    timeline.begin()
    waited_in = []

    class Work:  # NCCL's: wait() makes the current stream wait for the all-reduce (done at 3.5), the host does not
        def wait(self):
            stream = torch.cuda.current_stream()
            stream.clock = max(stream.clock, 3.5)
            waited_in.append(stream)

        def is_completed(self):
            raise AssertionError("on CUDA completion is an event, not a poll")

    class StreamContext:  # torch.cuda.stream(s): s is the current stream inside
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            self.saved, gpu.compute = gpu.compute, self.stream

        def __exit__(self, *exc):
            gpu.compute = self.saved
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(gpu))
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(dp_comm.dist, "all_reduce", lambda *a, **k: Work())
    comm = types.SimpleNamespace(group=None, phase="backward", log=types.SimpleNamespace(record=lambda *a: None))
    buckets = dp_comm.GradientBuckets({0: ["w"]}, {"w": (4,)}, torch.float32, "cpu", comm, True, timeline)
    buckets.cuda, buckets.stream = True, FakeStream(gpu)  # as on a CUDA device (the flat buffer stays on the CPU)
    gpu.compute.clock = 2.0
    buckets.ready(0)
    assert waited_in == [buckets.stream]  # done: recorded in the buckets' own stream, no host wait
    gpu.compute.clock = 5.0  # the backward goes on
    buckets.finish()
    timeline.finish()
    assert buckets.events == [(0, 16, 2.0, 3.5)]
    assert gpu.syncs == 2  # the timeline's origin and its finish: none per bucket


# ---- free memory on CUDA counts the caching allocator's free blocks --------------------------------------------

def test_free_cuda_memory_counts_the_blocks_the_allocator_holds_unused(monkeypatch):
    from picockpt.device import available_bytes
    from picockpt.planning.fit import check_fits
    cfg = Config.from_preset("tiny")
    need = cfg.num_params() * 16  # weights, gradients and AdamW's two moments, fp32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 4096, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**20 + 8192)  # 8 KiB cached, unused
    assert available_bytes("cuda") == (need + 4096, "free memory on cuda (with the allocator's cache)")
    check_fits(cfg, "cuda")  # fits: the driver's free bytes alone would be 4 KiB short
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**20)
    with pytest.raises(ValueError, match=r"more than the .* GiB of free memory on cuda \(with the allocator's cache\)"):
        check_fits(cfg, "cuda")


# ---- offloading's host buffers come from a pool, reused by size ------------------------------------------------

def test_offloaded_host_buffers_are_reused_and_the_host_bytes_stay_exact(monkeypatch):
    from picockpt import loss_and_grads
    from picockpt.recompute import host_pool
    from picockpt.planning.step_forms import predicted_host_bytes
    monkeypatch.setattr(host_pool, "_POOLS", {})  # a fresh pool for this test
    cfg, params, ids, targets = tiled(layers=4)
    peaks = []
    for _ in range(2):
        with Tracker("cpu", flops=False) as tracker:
            loss_and_grads(params, cfg, ids, targets, "offload", tracker=tracker)
        peaks.append((tracker.peak_host, tracker.peak_host_live))
    pool = host_pool.host_pool("cpu")
    assert (pool.made, pool.reused) == (cfg.layers, cfg.layers)  # the L layer inputs: made once, then reused
    host = predicted_host_bytes(cfg, B, T, "offload")
    assert peaks == [(host, host), (host, host)]  # reused buffers count as live host copies while they hold one


def test_a_pooled_buffer_is_taken_by_size_and_waits_for_its_last_read():
    from picockpt.recompute.host_pool import MAX_SIZES, HostPool
    pool = HostPool(pinned=False)
    first = pool.take((4, 8), torch.float32)
    done = object()  # what a CUDA tier gives back: the event of the copy that last read it
    pool.give(first, done)
    again = pool.take((8, 4), torch.float32)  # 128 bytes again: the same buffer, with that event to wait for
    assert again.flat is first.flat and again.free is done and again.host.shape == (8, 4)
    other = pool.take((4, 8), torch.bfloat16)  # 64 bytes: a new one
    assert other.flat is not first.flat and other.free is None and (pool.made, pool.reused) == (2, 1)
    for size in range(MAX_SIZES + 1):  # past MAX_SIZES sizes the oldest size goes
        pool.give(pool.take((size + 1,), torch.uint8))
    assert len(pool.idle) == MAX_SIZES and 1 not in pool.idle and MAX_SIZES + 1 in pool.idle
