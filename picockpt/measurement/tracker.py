"""Memory and FLOPs of one training step, phase by phase, in two views.

logical   the bytes held by the activation store (exact, the same on every device)
physical  the bytes of every tensor storage created during the step and still alive: the store's tensors plus all
          working memory (gradients of activations, the transient products of each op, rebuilt tensors). Found by
          watching every op's outputs through a TorchDispatchMode and a weakref.finalize on each new storage, so the
          micro-spikes of recomputation show. Storages marked "weights", "gradients" or "optimizer" are kept out of
          the physical activation count. Only the tracked device's storages count (physical, and "total" with every
          category): a tensor the step makes on another device (a CUDA step's host copy of a scalar) is in
          peak_elsewhere.
cuda      on a CUDA device max_memory_allocated() per phase, relative to the start of the step, read and reset at
          phase changes only: a phase inside another from its first store event; one with none (a tile rebuilt in
          the backward, 528 a layer at T=4096) counts in the phase around it; with cuda_timeline=True also
          torch.cuda.memory_allocated() at every store event (each query costs about 0.2 ms, twice a small step's
          GPU time, so it is off unless a timeline against the allocator is wanted: lesson 02's figure, the GPU
          benchmark).
host      with an offloading policy (picockpt/recompute/offload.py): the host tier's bytes at every store event
          (peak_host), the bytes copied each way in each phase (copy_bytes: "to_host", "to_device"), and the host
          copies' storages, marked "host", kept out of the physical (device) count (peak_host_live); on CUDA also
          exposed_copy_seconds, the time the compute stream waited for copies, measured with CUDA events (None
          elsewhere: on a CPU it is modelled, not measured).

Phases: forward, recompute, backward, optimizer.

FLOPs per phase: torch.utils.flop_counter's formulas (flop_registry: 2*m*n*k per matmul), and for the attention
kernels picockpt's own (picockpt/model/attention_flops.py: at the query's heads, on every torch), applied to every
op by the same dispatch mode that watches the storages, one Python hop per op. FlopCounterMode counts the same
(tests/test_formulas.py) at twice the cost (module hooks, decompositions). With times=True also the seconds spent in
each phase (wall seconds on the CPU; on CUDA the GPU's: a timing event is recorded at every phase switch, and the
GPU is synchronised once, when the step ends: the GPU's time between two events belongs to the phase that queued
that work, with no host stall at each switch).

    with Tracker(device) as tracker:
        loss, grads = loss_and_grads(params, cfg, ids, targets, policy, tracker=tracker)
    tracker.peaks["backward"]["physical"], tracker.flops["recompute"], tracker.timeline
    Tracker(device, cuda_timeline=True)   # timeline entries also carry "cuda": memory_allocated()

The tracker holds no tensors: only integers, strings and weak references.
"""
import contextlib
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..model.attention_flops import ATTENTION_FLOPS

PHASES = ("forward", "recompute", "backward", "optimizer")
OUTSIDE = "outside"  # before, between or after the phases above


class _OpWatcher(TorchDispatchMode):
    """Sees every aten op. physical: reports each new storage of its outputs the first time it appears (an
    output that shares a storage with an input, a view or an in-place op, is not new). flops: adds the op's
    FLOPs, by FlopCounterMode's formula for it (none: not a matmul), to the phase it runs in."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker, self.storages, self.flops = tracker, tracker.physical, tracker.count_flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.storages:
            inputs = {id(t.untyped_storage()) for t in _tensors((args, tuple(kwargs.values())))}
        out = func(*args, **kwargs)
        if self.flops:  # picockpt's attention formulas first (query heads, any torch), then torch's
            packet = func._overloadpacket
            formula = ATTENTION_FLOPS.get(packet) or flop_registry.get(packet)
            if formula is not None:
                self.tracker.flops[self.tracker.phase_name] += formula(*args, **kwargs, out_val=out)
        if self.storages:
            for tensor in _tensors((out,)):
                if id(tensor.untyped_storage()) not in inputs:
                    self.tracker._seen(tensor)
        return out


def _tensors(values):
    """The tensors among an op's arguments or outputs (aten ops nest them in lists and tuples only)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class Tracker:
    def __init__(self, device="cpu", physical=True, flops=True, cuda_timeline=False, times=False):
        self.device = torch.device(device)
        self.physical, self.count_flops = physical, flops
        self.cuda = self.device.type == "cuda"
        self.cuda_timeline = self.cuda and cuda_timeline  # memory_allocated() at every store event
        self.log = []            # raw records, replayed into timeline/peaks on exit
        self.sizes = {}          # storage id (ours) -> bytes
        self.devices = {}        # storage id -> its device's type: "cpu", "cuda" (picockpt/measurement/alloc_trace.py)
        self.categories = {}     # storage id -> excluded category
        self._ids = {}           # id(python storage object) -> storage id, while alive
        self._next = 0
        self.phase_name = OUTSIDE
        self.flops = dict.fromkeys(PHASES + (OUTSIDE,), 0)
        self.times = times       # wall seconds per phase (on CUDA from events, one synchronize at the end)
        self._spans = []         # CUDA only: (phase, start event, end event), timed once the step ends
        self.seconds = dict.fromkeys(PHASES + (OUTSIDE,), 0.0)
        self.timeline, self.peaks = [], {}
        self.peak_host = 0       # the store's host bytes, at their highest
        self.copy_bytes = {name: {"to_host": 0, "to_device": 0} for name in PHASES + (OUTSIDE,)}
        self._hosts = []         # the host tiers of the steps inside (picockpt/recompute/offload.py)
        self.exposed_copy_seconds = None  # CUDA: measured once the step ends
        self.peak_host_live = 0  # bytes of live storages marked "host" (host copies), at their highest
        self.peak_elsewhere = {}  # device type -> peak bytes of the step's storages on devices other than `device`
        self._excursions = []    # per open phase entered inside another: True while no store event came in it
        self._booked = OUTSIDE   # CUDA: the phase the allocator's peak since its last reset is booked to
        self._released = set()   # storage ids of host buffers given back to their pool (recompute/host_pool.py)

    # -- context -------------------------------------------------------------
    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.cuda_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_phase_peak = dict.fromkeys(PHASES + (OUTSIDE,), 0)
        self._watcher = _OpWatcher(self) if self.physical or self.count_flops else None
        if self._watcher:
            self._watcher.__enter__()
        self._since = self._clock()
        return self

    def __exit__(self, *exc):
        self._tick()
        self._time_spans()
        if self.cuda and self._hosts:
            self.exposed_copy_seconds = sum(host.exposed_seconds() for host in self._hosts)
        self._cuda_phase_end()
        if self._watcher:
            self._watcher.__exit__(*exc)
        self._replay()
        self._ids.clear()
        return False

    @contextlib.contextmanager
    def phase(self, name):
        """Everything inside is counted under `name`; the previous phase resumes after."""
        previous = self.phase_name
        inside = previous not in (OUTSIDE, name)  # inside another phase: device memory read once the store moves
        self._switch(name, sample=not inside)
        self._excursions += [True] if inside else []
        try:
            yield
        finally:  # back: read it unless it was inside and no store event came (still True)
            self._switch(previous, sample=not (inside and self._excursions.pop()))

    # -- what the engine and store report -------------------------------------
    def on_event(self, event):
        cuda = torch.cuda.memory_allocated(self.device) - self.cuda_base if self.cuda_timeline else None
        label = f"{event.kind} {event.name}" if event.layer is None else f"{event.kind} {event.layer}:{event.name}"
        self.log.append(("event", label, event.live_bytes, cuda))
        if any(self._excursions):  # the first store event of a phase entered inside another: its own peak from now
            self._cuda_phase_end()
            self._booked, self._excursions = self.phase_name, [False] * len(self._excursions)
        self.peak_host = max(self.peak_host, getattr(event, "host_bytes", 0))
        if event.kind == "put" and getattr(event, "where", "device") == "host":
            self.copy_bytes[self.phase_name]["to_host"] += event.bytes
        elif event.kind in ("prefetch", "fetch"):
            self.copy_bytes[self.phase_name]["to_device"] += event.bytes

    def watch_host(self, host):  # a step's host tier: its exposed copy time is read when the tracker exits (CUDA)
        self._hosts.append(host)

    def mark(self, tensor, category):
        """Put a tensor's storage in an excluded category (weights, gradients, optimizer, host: pooled, from now)."""
        sid = self._ids.get(id(tensor.untyped_storage()))
        if sid is None and category == "host" and self.physical:
            sid = self._seen(tensor)
        elif sid in self._released:  # back in use after release()
            self._released.discard(sid)
            self.log.append(("alloc", sid))
        if sid is not None:
            self.categories[sid] = category

    def release(self, tensor):
        """A host buffer given back to its pool: no longer live here, though its storage stays (the pool's)."""
        sid = self._ids.get(id(tensor.untyped_storage()))
        if sid is not None and sid not in self._released:
            self._released.add(sid)
            self.log.append(("free", sid))

    # -- results ---------------------------------------------------------------
    def _peak(self, view):
        return max((p[view] for p in self.peaks.values()), default=0)

    peak_logical = property(lambda self: self._peak("logical"))
    peak_physical = property(lambda self: self._peak("physical"))
    peak_cuda = property(lambda self: self._peak("cuda") if self.cuda else None)

    def retained_bytes(self):
        """Bytes created during the step and still alive now (outside the excluded categories)."""
        return sum(self.sizes[sid] for sid in set(self._alive)
                   if sid not in self.categories and self.devices[sid] == self.device.type)

    # -- internals -------------------------------------------------------------
    def _seen(self, tensor):
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._ids or storage.nbytes() == 0:
            return self._ids.get(key)
        sid, self._next = self._next, self._next + 1
        self._ids[key] = sid
        self.sizes[sid] = storage.nbytes()
        self.devices[sid] = storage.device.type
        self.log.append(("alloc", sid))
        weakref.finalize(storage, self._freed, key, sid)
        return sid

    def _freed(self, key, sid):
        if self._ids.get(key) == sid:
            del self._ids[key]
        self.log.append(("free", sid))

    def _switch(self, name, sample=True):
        if name not in PHASES + (OUTSIDE,):
            raise ValueError(f"phase {name!r}: use one of {PHASES}")
        if name == self.phase_name:
            return
        self._tick()
        if sample:  # the allocator's peak so far to the phase it was booked to; from now on to `name`
            self._cuda_phase_end()
            self._booked = name
        self.log.append(("phase", name))
        self.phase_name = name

    def _clock(self):
        if self.times and self.cuda:  # a mark in the GPU's stream: no wait for the work queued so far
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _tick(self):
        """Book the time since the last switch to the phase now ending (times=True only)."""
        if self.times:
            now = self._clock()
            if self.cuda:
                self._spans.append((self.phase_name, self._since, now))  # timed in _time_spans
            else:
                self.seconds[self.phase_name] += now - self._since
            self._since = now

    def _time_spans(self):
        """CUDA: one synchronize for the whole step, then each span's GPU time from its two events."""
        if self._spans:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._spans:
                self.seconds[name] += start.elapsed_time(end) / 1e3  # ms -> s
            self._spans.clear()

    def _cuda_phase_end(self):
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device) - self.cuda_base
            self.cuda_phase_peak[self._booked] = max(self.cuda_phase_peak[self._booked], peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _replay(self):
        """Turn the raw log into the timeline and the per-phase peaks, now that every storage's category is known."""
        phase, logical, physical, total, host = OUTSIDE, 0, 0, 0, 0
        alive, elsewhere, self.peak_elsewhere = set(), {}, {}
        peaks = {name: {"logical": 0, "physical": 0, "total": 0} for name in PHASES + (OUTSIDE,)}
        self.timeline = []
        for record in self.log:
            kind = record[0]
            if kind == "phase":
                phase = record[1]
                continue  # a phase's peak counts what happens inside it
            if kind in ("alloc", "free"):
                sid = record[1]
                size = self.sizes[sid] if kind == "alloc" else -self.sizes[sid]
                if kind == "free" and sid not in alive:
                    continue
                (alive.add if kind == "alloc" else alive.discard)(sid)
                if self.categories.get(sid) == "host":  # host copies: counted apart, whichever device they are on
                    host += size
                    self.peak_host_live = max(self.peak_host_live, host)
                where = self.devices[sid]
                if where != self.device.type:  # another device's memory (a host copy of a CUDA scalar, say)
                    elsewhere[where] = elsewhere.get(where, 0) + size
                    self.peak_elsewhere[where] = max(self.peak_elsewhere.get(where, 0), elsewhere[where])
                    continue  # this device's totals did not move
                total += size
                if sid not in self.categories:
                    physical += size
            else:  # a store event
                logical = record[2]
            peaks[phase]["logical"] = max(peaks[phase]["logical"], logical)
            peaks[phase]["physical"] = max(peaks[phase]["physical"], physical)
            peaks[phase]["total"] = max(peaks[phase]["total"], total)
            self.timeline.append({"kind": kind, "label": record[1] if kind == "event" else kind,
                                  "phase": phase, "logical": logical, "physical": physical, "total": total,
                                  "cuda": record[3] if kind == "event" else None})
        for name in peaks:
            peaks[name]["cuda"] = self.cuda_phase_peak[name] if self.cuda else None
        self.peaks = {name: p for name, p in peaks.items() if any(p.values()) or name in ("forward", "backward")}
        self._alive = alive
