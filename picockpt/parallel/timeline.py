"""What one pipeline rank did from when to when, and the memory of all its micro-batches at once.

    timeline = Timeline(device)
    with timeline.span("forward", microbatch=2):   # nested spans split the outer one:
        with timeline.span("wait"):                # [forward 2][wait 2][forward 2]
            ...
    timeline.totals()    # {"forward": s, "recompute": s, "backward": s, "wait": s, "send": s, "reduce": s, ...}

Kinds: forward, recompute, backward (the engine's phases); wait (blocked on a neighbour's message: the bubble as this
rank sees it); send (its last sends leaving); reduce (blocked on a data-parallel all-reduce: what compute did not hide);
idle the rest (the schedule's own Python); total the step. time.monotonic() is one clock for a machine's processes, so
ranks' timelines line up; on CUDA span edges synchronise the compute stream, so spans hold their GPU work.

StageMemory makes one store of a stage's micro-batches: each micro-batch's Step has its own ActivationStore, whose
listener, a MicroBatchTracker, passes every event to the rank's Tracker with the bytes of *all* the stage's stores (its
peak: the stage's, every micro-batch in flight); phases go to the Tracker (FLOPs, bytes) and the Timeline.
"""
import contextlib
import time

import torch

KINDS = ("forward", "recompute", "backward", "wait", "send", "reduce")


class Timeline:
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.segments = []  # (kind, micro-batch or None, start, end), leaf segments in time order
        self._stack = []    # open spans: [kind, micro-batch, start of its current segment]
        self.start = self.end = None

    def clock(self):
        if self.device.type == "cuda":  # the compute stream only: an all-reduce on its own stream goes on
            torch.cuda.current_stream(self.device).synchronize()
        return time.monotonic()

    def begin(self):
        self.start = self.clock()

    def finish(self):
        self.end = self.clock()

    @contextlib.contextmanager
    def span(self, kind, microbatch=None):
        """Everything inside is `kind`, except nested spans; a span without a micro-batch takes its outer one's."""
        now = self.clock()
        if self._stack:  # the outer span pauses; its micro-batch is the default
            self._close(self._stack[-1], now)
            microbatch = self._stack[-1][1] if microbatch is None else microbatch
        self._stack.append([kind, microbatch, now])
        try:
            yield
        finally:
            now = self.clock()
            self._close(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][2] = now  # the outer span resumes

    def _close(self, entry, now):
        kind, microbatch, since = entry
        if now > since:
            self.segments.append((kind, microbatch, since, now))

    def totals(self):
        """Seconds per kind, idle (the step's time outside every span) and total."""
        seconds = dict.fromkeys(KINDS, 0.0)
        for kind, _, start, end in self.segments:
            seconds[kind] += end - start
        total = (self.end - self.start) if self.start is not None and self.end is not None else sum(seconds.values())
        seconds["idle"], seconds["total"] = max(0.0, total - sum(seconds.values())), total
        return seconds

    def relative(self, origin=None):
        """[(kind, micro-batch, start, end)] in seconds from `origin` (default: this rank's start)."""
        origin = self.start if origin is None else origin
        return [(kind, m, start - origin, end - origin) for kind, m, start, end in self.segments]


class StageMemory:
    """The bytes of every micro-batch's store on this stage, summed; a record of them over time."""

    def __init__(self, tracker, timeline):
        self.tracker, self.timeline = tracker, timeline
        self.held, self.bytes = {}, 0  # micro-batch -> bytes its store holds now; their sum
        self.samples = []   # (time, bytes) at every store event
        self.end_of_forward = {}  # micro-batch -> bytes its store held when its forward ended

    def for_microbatch(self, microbatch):
        return MicroBatchTracker(self, microbatch)

    def mean_bytes(self):
        """The time-weighted mean of the stage's stored bytes from the timeline's start to its end."""
        start, end = self.timeline.start, self.timeline.end
        if not self.samples or start is None or end is None or end <= start:
            return 0.0
        area, (last_time, last_bytes) = 0.0, (start, 0)
        for when, nbytes in self.samples:
            area += last_bytes * (max(when, start) - last_time)
            last_time, last_bytes = max(when, start), nbytes
        area += last_bytes * (end - last_time)
        return area / (end - start)


class MicroBatchTracker:
    """What one micro-batch's Step and store talk to (as picockpt/tracker.py's Tracker)."""

    def __init__(self, memory, microbatch):
        self.memory, self.microbatch = memory, microbatch

    @contextlib.contextmanager
    def phase(self, name):
        with self.memory.tracker.phase(name), self.memory.timeline.span(name, self.microbatch):
            yield

    def on_event(self, event):
        memory = self.memory
        memory.held[self.microbatch] = event.live_bytes
        memory.bytes = sum(memory.held.values())
        memory.samples.append((time.monotonic(), memory.bytes))
        memory.tracker.on_event(event._replace(live_bytes=memory.bytes))

    def mark(self, tensor, category):
        self.memory.tracker.mark(tensor, category)

    @property
    def phase_name(self):
        return self.memory.tracker.phase_name
