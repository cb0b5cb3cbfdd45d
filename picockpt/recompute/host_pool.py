"""Host buffers for offloaded activations, kept and reused by size (picockpt/recompute/offload.py takes and gives them).

Page-locked (pinned) host memory is what lets a copy run on a side stream, but making it is slow (the driver
pins every page) and the amount a machine can pin is limited, so offloading takes its host buffers from a pool:
a buffer of the right size that an earlier tensor gave back when it came home, or a new one. A step offloads
in its forward and fetches back in its backward, so the buffers come round again in the next step, and, in a
pipeline, in the next micro-batch's forward.

    pool = host_pool(device)                   # one per device kind: pinned on CUDA, ordinary memory on a CPU
    buffer = pool.take(shape, dtype)           # .host (the tensor to copy into), .free (CUDA: an event, or None)
    pool.give(buffer, done)                    # back, once `done` (CUDA: an event after its last read) has run

On CUDA a buffer's writes and reads are copies queued on a side stream; a buffer given back may still be read
by a copy in flight, so it goes back with the event its last copy recorded, and whoever takes it next makes
their stream wait for that event (no host stall) before writing. The pool keeps the buffers of its
MAX_SIZES most recently used sizes; a new size past those lets the oldest size's buffers go.
"""
from collections import OrderedDict, namedtuple

import torch

MAX_SIZES = 16  # distinct buffer sizes kept (a model's offloaded tensors come in a few shapes)


# one host buffer: `host`, the tensor (a view of `flat`, its bytes); `free`, what to wait for before writing
Buffer = namedtuple("Buffer", "flat host free")


class HostPool:
    def __init__(self, pinned):
        self.pinned = pinned
        self.idle = OrderedDict()  # bytes -> [(flat uint8 buffer, event or None)], least recently used size first
        self.made = self.reused = 0  # buffers allocated / handed out again

    def take(self, shape, dtype):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        waiting = self.idle.get(nbytes)
        if waiting:
            flat, free = waiting.pop()
            self.reused += 1
        else:
            flat, free = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned), None  # (nbytes,)
            self.made += 1
        return Buffer(flat, flat.view(dtype).view(shape), free)  # (shape) the same bytes, as the tensor's dtype

    def give(self, buffer, done=None):
        """Back to the pool; `done` (CUDA): the event recorded after the last copy that reads it."""
        nbytes = buffer.flat.numel()
        self.idle.setdefault(nbytes, []).append((buffer.flat, done))
        self.idle.move_to_end(nbytes)
        while len(self.idle) > MAX_SIZES:
            self.idle.popitem(last=False)


_POOLS = {}  # device kind -> HostPool: one per process, as the CUDA caching allocator is


def host_pool(device):
    kind = torch.device(device).type
    if kind not in _POOLS:
        _POOLS[kind] = HostPool(pinned=kind == "cuda")
    return _POOLS[kind]
