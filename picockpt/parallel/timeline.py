"""What one pipeline rank did from when to when, and the memory of all its micro-batches at once.

    timeline = Timeline(device)                    # right after a barrier: its zero, the same moment on every rank
    with timeline.span("forward", microbatch=2):   # nested spans split the outer one:
        with timeline.span("wait"):                # [forward 2][wait 2][forward 2]
            ...
    timeline.finish()
    timeline.totals()    # {"forward": s, "recompute": s, "backward": s, "wait": s, "send": s, "reduce": s, ...}

Kinds: the engine's phases; wait (blocked on a neighbour's message: the bubble as this rank sees it); send (its last
sends leaving); reduce (blocked on a data-parallel all-reduce: what compute did not hide); idle the rest. Every
rank's zero is the moment all leave one barrier, so timelines line up across hosts, whose clocks share no origin.
On CUDA a span edge is a torch.cuda.Event in the compute stream (no synchronisation: a span holds the GPU's time),
made seconds once in finish(); mark() gives such a time for anything else (stored bytes, dp_comm.py's buckets).

StageMemory sums the stores of a stage's micro-batches: each micro-batch's MicroBatchTracker passes every event to
the rank's Tracker with the bytes of all of them (the stage's peak). The Timeline gets a span per phase, not per op:
a phase entered inside another opens its span at its first store event (the engine's recompute, which starts by
reading its checkpoint); one with no store event (a tile rebuilt in the backward) gets no span, its seconds moved
to its own phase (Timeline.moved), so a rebuild is recompute time, as its FLOPs are recompute FLOPs.
"""
import contextlib
import time

import torch

from ..measurement.tracker import OUTSIDE

KINDS = ("forward", "recompute", "backward", "wait", "send", "reduce")


class Timeline:
    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.segments = []  # (kind, micro-batch or None, start, end), leaf segments in time order
        self.stack = []     # open spans: [kind, micro-batch, start of its current segment]
        self.moved = []     # (kind, the span's kind it ran inside, start, end): phases without a span of their own
        self.start = self.end = None
        if self.cuda:  # once: the stream is idle, so the origin event is timed as the host's zero
            torch.cuda.current_stream(self.device).synchronize()
            self._origin = self.mark()
        self._host_origin = time.monotonic()

    def mark(self, stream=None):
        """Now: seconds since the origin (CPU), or an event recorded in `stream` (CUDA; default the compute stream)."""
        if not self.cuda:
            return time.monotonic() - self._host_origin
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device) if stream is None else stream)
        return event

    def seconds(self, mark):
        """A mark in seconds since the origin (an event: once it has run; finish() waits for that)."""
        return mark if isinstance(mark, float) else self._origin.elapsed_time(mark) / 1e3  # ms -> s

    def begin(self):
        self.start = self.mark()

    def finish(self):
        """The step's end; on CUDA one synchronisation, then every span edge in seconds."""
        self.end = self.mark()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.start, self.end = self.seconds(self.start), self.seconds(self.end)
            self.segments, self.moved = ([(kind, what, self.seconds(start), self.seconds(end))
                                          for kind, what, start, end in spans] for spans in (self.segments, self.moved))
            self.segments = [segment for segment in self.segments if segment[3] > segment[2]]  # empty ones go now

    @contextlib.contextmanager
    def span(self, kind, microbatch=None):
        """Everything inside is `kind`, except nested spans; a span without a micro-batch takes its outer one's."""
        self.open(kind, microbatch)
        try:
            yield
        finally:
            self.close()

    def open(self, kind, microbatch=None):
        now = self.mark()
        if self.stack:  # the outer span pauses; its micro-batch is the default
            self._close(self.stack[-1], now)
            microbatch = self.stack[-1][1] if microbatch is None else microbatch
        self.stack.append([kind, microbatch, now])

    def close(self):
        now = self.mark()
        self._close(self.stack.pop(), now)
        if self.stack:
            self.stack[-1][2] = now  # the outer span resumes

    def _close(self, entry, now):
        kind, microbatch, since = entry
        if self.cuda or now > since:  # CUDA: empty segments go once timed (finish)
            self.segments.append((kind, microbatch, since, now))

    def totals(self):
        """Seconds per kind, idle (the step's time outside every span) and total."""
        seconds = dict.fromkeys(KINDS, 0.0)
        for kind, _, start, end in self.segments:
            seconds[kind] += end - start
        for kind, outer, start, end in self.moved:  # a rebuild inside the backward: recompute, not backward time
            seconds[kind] += end - start
            seconds[outer] -= end - start
        total = (self.end - self.start) if self.start is not None and self.end is not None else sum(seconds.values())
        seconds["idle"], seconds["total"] = max(0.0, total - sum(seconds.values())), total
        return seconds

    def relative(self):
        """[(kind, micro-batch, start, end)] in seconds from this rank's start."""
        return [(kind, m, start - self.start, end - self.start) for kind, m, start, end in self.segments]


class StageMemory:
    """The bytes of every micro-batch's store on this stage, summed; a record of them over time."""

    def __init__(self, tracker, timeline):
        self.tracker, self.timeline = tracker, timeline
        self.held, self.bytes = {}, 0  # (micro-batch, chunk) -> bytes its store holds now; their sum
        self.samples = []   # (time, bytes) at every store event, the time a Timeline mark
        self.end_of_forward = {}  # (micro-batch, chunk) -> bytes its store held when its forward ended

    def mean_bytes(self):
        """The time-weighted mean of the stage's stored bytes from the timeline's start to its end."""
        start, end = self.timeline.start, self.timeline.end
        if not self.samples or start is None or end is None or end <= start:
            return 0.0
        times = [max(self.timeline.seconds(when), start) for when, _ in self.samples] + [end]  # each sample's, then end
        return sum(nbytes * (t1 - t0) for (_, nbytes), t0, t1 in zip(self.samples, times, times[1:])) / (end - start)


class MicroBatchTracker:
    """What one micro-batch's Step and store talk to (as picockpt/measurement/tracker.py's Tracker): micro-batch m's
    (of an interleaved rank's chunk c; chunk (c, "W"): its W's store)."""

    def __init__(self, memory, microbatch, chunk=0):
        self.memory, self.microbatch, self.key = memory, microbatch, (microbatch, chunk)  # spans say m, held the key
        self.pending = []  # phases entered inside another, no span yet: [kind, span depth at entry, span opened]

    @contextlib.contextmanager
    def phase(self, name):
        """A span per phase of the step; one entered inside another opens at its first store event (docstring)."""
        tracker, timeline = self.memory.tracker, self.memory.timeline
        previous = tracker.phase_name
        with tracker.phase(name):
            if previous == name:  # the same phase again: nothing changes
                yield
            elif previous == OUTSIDE:
                with timeline.span(name, self.microbatch):
                    yield
            else:
                entry = [name, len(timeline.stack), False]
                self.pending.append(entry)
                since, segments = timeline.mark(), len(timeline.segments)
                try:
                    yield
                finally:
                    self.pending.pop()
                    # no store event, no span: its seconds move from the innermost span to its phase (Timeline.moved),
                    # unless a span closed in between booked its own time (the segments grew)
                    if entry[2]:
                        timeline.close()
                    elif timeline.stack and len(timeline.segments) == segments and timeline.stack[-1][0] != name:
                        timeline.moved.append((name, timeline.stack[-1][0], since, timeline.mark()))

    def on_event(self, event):
        memory = self.memory
        memory.held[self.key] = event.live_bytes
        memory.bytes = sum(memory.held.values())
        memory.samples.append((memory.timeline.mark(), memory.bytes))
        for entry in self.pending:  # the store moved: a phase entered inside another gets its span from here
            if not entry[2] and entry[1] == len(memory.timeline.stack):  # (not from inside a span opened since)
                memory.timeline.open(entry[0], self.microbatch)
                entry[2] = True
        memory.tracker.on_event(event._replace(live_bytes=memory.bytes))

    def __getattr__(self, name):  # mark, release, phase_name: the rank's Tracker's own
        return getattr(self.memory.tracker, name)
