"""The host tier: activations moved to host memory in the forward and fetched back for the backward.

A put the schedule sends to the host (Schedule.host: the names of each layer's first forward that go
there) is copied off the device at once; the store then holds the host copy, and counts its bytes as
host bytes, not device bytes. Before the backward needs it, the engine asks for it back (a prefetch):
a device buffer is filled from the host copy, and the store counts it as device bytes again.

    on CUDA   the host copies are pinned (page-locked) buffers, so the copies run asynchronously on a
              side stream of their own, never on the compute stream:
                  offload   the side stream waits for an event recorded where the tensor was made,
                            copies device -> host, records its own event; the device tensor is
                            marked as used by the side stream (record_stream), so the allocator
                            does not hand its memory out again before the copy has read it
                  prefetch  the side stream copies host -> device into a buffer allocated on it and
                            records an event; the compute stream waits for that event (wait_event,
                            no host stall) the first time the tensor is read
              torch.autograd.graph.save_on_cpu(pin_memory=True), by contrast, copies on the current
              (compute) stream, in its pack and unpack hooks (torch/autograd/graph.py).
    on a CPU  the same calls, with the host tier in ordinary memory: every copy is real (a new buffer
              filled element by element), and there is no second engine to overlap it with; its time
              is modelled from a bandwidth (picockpt/planning/host_walk.py), never measured.

Host buffers come from a pool (picockpt/recompute/host_pool.py: by size, pinned on CUDA), each given back when its
tensor comes home, so the next step, or micro-batch, reuses it; on CUDA it goes back with the event of the
copy that last reads it, and the next offload into it waits for that event (on the GPU) before writing.

The host copies are marked "host" in the Tracker (released when given back), which counts them apart from
device activations. On CUDA, every read of a prefetched tensor records when the compute stream asked for
it; after the step, (time the copy finished - time it was asked for), where positive, is the copy time the
compute stream waited for: the exposed copy time, measured with CUDA events.
"""
import contextlib
from collections import namedtuple

import torch

from .host_pool import host_pool


class HostTier:
    """Where a store's host-bound tensors go. rule(layer, name) -> True: that put goes to the host."""

    def __init__(self, device, listener=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.listener = listener
        self.rule = None  # set while a first forward offloads (offloading()); None: every put stays
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None  # the copies' own stream
        self.waits = []  # CUDA: (asked, done) event pairs of every read of a prefetched tensor
        self.pool = host_pool(self.device)  # the host buffers, reused by size

    def wants(self, layer, name):
        return self.rule is not None and self.rule(layer, name)

    def to_host(self, tensor):
        """A host copy of `tensor` (device -> host); on CUDA asynchronous, on the side stream."""
        buffer = self.pool.take(tensor.shape, tensor.dtype)  # (shape) CUDA: page-locked, DMA-able
        host = buffer.host
        if self.listener is not None:
            self.listener.mark(host, "host")
        if not self.cuda:
            return Copy(host.copy_(tensor), None, buffer)  # a real copy, ordinary memory
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.device))  # where the tensor was made
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(made)  # not before the compute stream has written it
            if buffer.free is not None:
                self.stream.wait_event(buffer.free)  # nor before the copy that last read this buffer has
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory is not reused before this copy has read it
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        return Copy(host, done, buffer)

    def to_device(self, copy):
        """(device tensor, event or None): the host copy back on the device; CUDA: issued on the side stream."""
        if not self.cuda:
            tensor = torch.empty(copy.host.shape, dtype=copy.host.dtype, device=self.device).copy_(copy.host)
            self._give(copy, None)
            return tensor, None
        with torch.cuda.stream(self.stream):  # after the offload of the same copy: one stream, in order
            tensor = torch.empty(copy.host.shape, dtype=copy.host.dtype, device=self.device)  # (side stream's memory)
            tensor.copy_(copy.host, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        self._give(copy, done)  # its last read: the copy just queued, which `done` follows
        return tensor, Arrival(tensor, done, copy.host)

    def ready(self, arrival):
        """The compute stream's first read of a prefetched tensor: it waits for the copy's event, on the GPU."""
        compute = torch.cuda.current_stream(self.device)
        asked = torch.cuda.Event(enable_timing=True)
        asked.record(compute)
        compute.wait_event(arrival.done)  # ordered after the copy: never read before its event
        arrival.tensor.record_stream(compute)  # allocated on the side stream, used (and freed) on this one
        self.waits.append((asked, arrival.done))
        return arrival.tensor

    def exposed_seconds(self):
        """CUDA, after the step: the seconds the compute stream waited on copies (sum over reads)."""
        if not self.waits:
            return 0.0
        torch.cuda.synchronize(self.device)
        return sum(max(0.0, asked.elapsed_time(done)) for asked, done in self.waits) / 1e3

    def _give(self, copy, done):  # the buffer back to the pool: no longer a live host copy
        self.pool.give(copy.buffer, done)
        if hasattr(self.listener, "release"):
            self.listener.release(copy.host)


# a tensor's host copy; `done` (CUDA) is the event its device -> host copy records; `buffer`, its pool's
Copy = namedtuple("Copy", "host done buffer")
# a prefetch in flight (CUDA): the device buffer, the event its copy records, and the host copy, held until the
# compute stream has waited for that event
Arrival = namedtuple("Arrival", "tensor done host")


def host_tier(schedule, device, listener):
    """The HostTier a step under `schedule` needs (None when nothing is offloaded). A Tracker listening
    is told of it (watch_host), to read the exposed copy time once the step ends."""
    if schedule.host is None or not any(schedule.host):
        return None
    tier = HostTier(device, listener)
    if hasattr(listener, "watch_host"):
        listener.watch_host(tier)
    return tier


@contextlib.contextmanager
def offloading(store, schedule):
    """`with offloading(store, schedule):` the first forward: the puts schedule.host names go to the host (per layer,
    the names whose first-forward puts go there; "*": all of them). An expert's tensor, "moe.act[3]", goes with its
    kind, "moe.act"."""
    def rule(layer, name):
        names = schedule.host[layer] if layer is not None else ()
        return "*" in names or name.partition("[")[0] in names

    if store.host is None:
        yield
        return
    store.host.rule = None if schedule.host is None else rule
    try:
        yield
    finally:
        store.host.rule = None


def prefetch_for(store, whole, layers, i):
    """Start bringing back from the host what the backward of layer i needs next: its own tensors when it
    is stored whole, else the checkpoint its recompute will start from (the nearest stored input at or
    below i). Issued one layer ahead, so each copy runs while the layer above computes its backward."""
    if store.host is None or i < layers[0]:
        return
    if i in whole:
        store.prefetch(i)
        return
    j = next((k for k in range(i, layers[0] - 1, -1) if store.has(k, "input")), None)
    if j is not None:
        store.prefetch(j, names=("input",))
