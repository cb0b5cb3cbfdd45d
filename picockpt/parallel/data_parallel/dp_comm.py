"""Data parallelism: a stage's gradients, accumulated over micro-batches in buckets, summed over the replicas by
all-reduces overlapping the rest of the backward.

Buckets, as in PyTorch's DistributedDataParallel (Li et al. 2020): one layer's gradients (or the head's, or the
embedding's) side by side in one flat buffer, so one all-reduce moves a whole layer. Once a bucket is final (in the
last micro-batch's backward), overlap=True starts its all-reduce (async_op=True): it travels while the layers below
recompute and run their backward. The step ends waiting for what has not arrived (the exposed communication: a
"reduce" span of the Timeline); overlap=False all-reduces every bucket after the backward, all exposed.

Each bucket's (launched, done) times are Timeline marks. On the CPU: the host's clock at the launch, and the first
moment it was seen complete (polled at every later launch and at the end). On CUDA an all-reduce returns once NCCL
has queued it, so the host's clock would time the queueing: launched is an event in the compute stream just before
the launch, done an event in a stream of the buckets' own once work.wait() has made it wait for NCCL's.
"""
import torch
import torch.distributed as dist

from ..comm import all_reduce
from .zero_params import FlatUnit


class GradientBuckets:
    """names: {bucket: [parameter names]} in the order they become final; shapes: {name: shape}."""

    def __init__(self, names, shapes, dtype, device, comm=None, overlap=True, timeline=None, tracker=None):
        self.comm, self.overlap, self.timeline, self.dtype = comm, overlap, timeline, dtype
        self.flat, self.views = {}, {}
        for bucket, members in names.items():
            unit = FlatUnit(members, shapes, 1)  # laid out as a ZeRO unit (zero_params.py), unsharded
            flat = self.flat[bucket] = torch.zeros(unit.padded, dtype=dtype, device=device)  # (n,) side by side
            if tracker is not None:
                tracker.mark(flat, "gradients")
            self.views.update(unit.views(flat))  # {name: (shape) a view into the bucket}
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda and comm is not None and overlap else None  # for `done`
        self.launched, self.marks = {}, []  # bucket -> (work, launch mark); (bucket, bytes, launched, done) marks

    def add(self, name, grad):
        self.views[name] += grad.to(self.dtype)  # (shape) accumulated over micro-batches, in the master dtype

    def ready(self, bucket):
        """Bucket's gradients are final (its last micro-batch's backward is done with them)."""
        if self.comm is None or not self.overlap:
            return
        self._poll()
        flat = self.flat[bucket]
        launched = self.timeline.mark()  # no device synchronisation: it would wait for the work queued so far
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.comm.group, async_op=True)  # sum over replicas
        self.comm.log.record(self.comm.phase, "all_reduce", flat.nbytes)
        self.launched[bucket] = (work, launched)
        if self.cuda:  # done: in the buckets' stream, once NCCL's has run the all-reduce (no host wait)
            with torch.cuda.stream(self.stream):
                work.wait()
                self.marks.append((bucket, flat.nbytes, launched, self.timeline.mark(self.stream)))

    def finish(self):
        """Wait for the overlapped all-reduces still travelling, or (overlap=False) run them all now."""
        if self.comm is None:
            return
        with self.timeline.span("reduce"):
            if not self.overlap:
                for bucket, flat in self.flat.items():  # in the order they became final
                    start = self.timeline.mark()
                    all_reduce(flat, self.comm)  # blocking (NCCL: the stream), in place, counted
                    self.marks.append((bucket, flat.nbytes, start, self.timeline.mark()))
                return
            missing = set(self.flat) - set(self.launched)
            assert not missing, f"gradient buckets {sorted(missing, key=str)} were never final"
            self._poll(wait=True)
        self.launched.clear()

    @property
    def events(self):
        """(bucket, bytes, launched at, done at), in seconds on the Timeline's clock (after its finish())."""
        return [(bucket, nbytes, self.timeline.seconds(start), self.timeline.seconds(end))
                for bucket, nbytes, start, end in self.marks]

    def _poll(self, wait=False):  # CPU: done is the host's clock, the first time it is seen complete (CUDA: ready())
        for bucket, (work, launched) in self.launched.items():
            if wait:
                work.wait()  # NCCL: the compute stream waits (the "reduce" span's end event comes after)
            if not self.cuda and (wait or work.is_completed()) and all(mark[0] != bucket for mark in self.marks):
                self.marks.append((bucket, self.flat[bucket].nbytes, launched, self.timeline.mark()))

