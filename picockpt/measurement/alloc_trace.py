"""A step's allocation trace: every storage it creates and frees, in order, each with its phase and bytes.

The tracker (picockpt/measurement/tracker.py) already watches every new tensor storage of a step through a
TorchDispatchMode and a weakref.finalize on each, and logs ("alloc", id), ("free", id) and ("phase", name)
records in the order they happen. trace_of() reads that log as Events, the input of the caching allocator
model (picockpt/measurement/allocator.py): an allocator sees exactly these requests, in this order, on a GPU.

    trace, tracker = record_step(params, cfg, input_ids, targets, "full")
    [Event(kind="alloc", key=0, size=131072, phase="forward", category="weights"), ...]
    replay(trace).peak("reserved")

On CUDA, measure_on_cuda(work, device) runs `work` under the same recording, starting the model from the
real allocator's segments (torch.cuda.memory_snapshot()), and returns the model's numbers beside
torch.cuda.memory_stats()'s. What the model cannot see: buffers that kernels take from the pool inside one
op (a reduction's scratch space, a library's workspace the first time it runs), which never become tensor
storages. step_on_cuda() runs one warm-up step first, so the workspaces cuBLAS keeps are in the snapshot.
"""
import gc
import os
from collections import namedtuple

import torch

from .allocator import CachingAllocator, replay
from ..recompute.engine import loss_and_grads
from .tracker import OUTSIDE, Tracker

# kind "alloc" or "free"; key: the storage's id in the tracker; size: the bytes it asked for; phase;
# category: None (activations and working memory) or the tracker's "weights", "gradients", "optimizer"
Event = namedtuple("Event", "kind key size phase category")


def trace_of(tracker, device_type=None):
    """The Events of a finished Tracker, in order: the storages of `device_type` ("cpu", "cuda"; None: every
    device) outside the host tier (host copies are host memory, not the device's pool)."""
    phase, events, alive = OUTSIDE, [], set()
    for record in tracker.log:
        kind = record[0]
        if kind == "phase":
            phase = record[1]
        if kind not in ("alloc", "free"):
            continue
        key = record[1]
        category = tracker.categories.get(key)
        if category == "host" or device_type not in (None, tracker.devices[key]):
            continue
        if (kind == "alloc") == (key in alive):  # a second alloc or free of one storage: not an allocator event
            continue
        (alive.add if kind == "alloc" else alive.discard)(key)
        events.append(Event(kind, key, tracker.sizes[key], phase, category))
    return events


def record_step(params, cfg, input_ids, targets, policy="none"):
    """(trace, tracker) of one loss_and_grads step: its storages on the batch's device, the gradients
    still alive at the end (as before an optimizer step)."""
    device = input_ids.device
    with Tracker(device, flops=False) as tracker:
        result = loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
    trace = trace_of(tracker, device.type)  # before the gradients go: their finalizers still log to the tracker
    del result
    return trace, tracker


def only(trace, categories=(None,)):
    """The events of `trace` whose category is in `categories` (default: activations and working memory,
    the tracker's physical view)."""
    return [event for event in trace if event.category in categories]


def live_peak(events):
    """The most bytes the events' storages hold at once, e.g. live_peak(only(trace, ("weights",))): the
    16-bit weight copies of a mixed-precision step at their highest (params.copy_bytes in closed form)."""
    live = peak = 0
    for event in events:
        live += event.size if event.kind == "alloc" else -event.size
        peak = max(peak, live)
    return peak


# -- on a GPU ------------------------------------------------------------------------------------

def check_native(device):
    """ValueError unless the allocator is the one the model follows: the native backend, no expandable
    segments, no power-of-two rounding."""
    settings = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + ","
                + os.environ.get("PYTORCH_ALLOC_CONF", "")).strip(",")
    changed = [name for name in ("expandable_segments:True", "roundup_power2_divisions", "max_non_split_rounding",
                                 "large_segment_size", "garbage_collection_threshold")
               if name in settings.replace(" ", "")]
    if torch.cuda.get_allocator_backend() != "native" or changed:
        raise ValueError(f"the allocator model follows the native caching allocator with its default rounding "
                         f"and segments; PYTORCH_CUDA_ALLOC_CONF={settings!r} changes them ({changed or 'backend'}): "
                         f"unset it (max_split_size_mb alone is modelled)")


def pool_from_snapshot(snapshot, device_index, max_split_size=-1):
    """A CachingAllocator holding what a real allocator holds: `snapshot` as torch.cuda.memory_snapshot() gives
    it (segments with "device", "address", "segment_type" and their "blocks" in address order, each with
    "size", "state", "requested_size"), the segments of device `device_index` only; every block not
    "inactive" under a key of its own. max_split_size: memory_stats()'s, in bytes (-1 or less: unlimited)."""
    segments = []
    for segment in snapshot:
        if segment["device"] != device_index:
            continue
        if segment.get("is_expandable"):
            raise ValueError("the snapshot holds an expandable segment: the model follows fixed segments; "
                             "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF")
        blocks = [(block["size"], None if block["state"] == "inactive" else ("before", segment["address"], n),
                   block.get("requested_size", block["size"])) for n, block in enumerate(segment["blocks"])]
        segments.append((segment["address"], segment["segment_type"], blocks))
    return CachingAllocator.from_segments(segments, None if max_split_size <= 0 else max_split_size // 2**20)


def measure_on_cuda(work, device):
    """Run work() on `device` (CUDA) under the tracker's recording and compare the model with the allocator:
    {quantity: (model, measured)} and the trace. work() returns what must stay alive until the numbers are
    read (a step's gradients)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: the comparison with torch.cuda.memory_stats() needs a CUDA device")
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    check_native(device)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # only segments with live blocks stay: the model starts from them
    start = torch.cuda.memory_stats(device)
    model = pool_from_snapshot(torch.cuda.memory_snapshot(), device.index, start.get("max_split_size", -1))
    with Tracker(device, flops=False) as tracker:
        kept = work()
        torch.cuda.synchronize(device)
        end = torch.cuda.memory_stats(device)
    trace = trace_of(tracker, "cuda")  # read before `kept` goes (its frees would still be logged)
    del kept
    run = replay(trace, allocator=model)
    # the tracker resets the peak statistics at each phase change: the step's allocated peak is the largest of
    # its phases' peaks; reserved bytes never fall without empty_cache(), so their peak is their last value
    measured_peak = tracker.cuda_base + max(tracker.cuda_phase_peak.values())
    numbers = {
        "allocated peak": (run.peak("allocated"), measured_peak),
        "reserved peak": (run.peak("reserved"), end["reserved_bytes.all.current"]),
        "requested at the end": (run.pool.requested, end["requested_bytes.all.current"]),
        "allocated at the end": (run.pool.allocated, end["allocated_bytes.all.current"]),
        "segments": (len(run.pool.segments), end["segment.all.current"]),
        "cudaMalloc calls": (run.pool.device_mallocs, end["num_device_alloc"] - start["num_device_alloc"]),
    }
    return numbers, trace


def step_on_cuda(params, cfg, input_ids, targets, policy="none"):
    """measure_on_cuda for one loss_and_grads step, after one warm-up step (cuBLAS keeps its workspace from
    the first matmul on, outside any tensor: in the snapshot, not in the trace)."""
    loss_and_grads(params, cfg, input_ids, targets, policy)
    return measure_on_cuda(lambda: loss_and_grads(params, cfg, input_ids, targets, policy), input_ids.device)
