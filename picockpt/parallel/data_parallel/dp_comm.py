"""Data parallelism: a stage's gradients, accumulated over micro-batches in buckets, summed over the replicas by
all-reduces overlapping the rest of the backward (per replica: its 1/dp of the batch's share of the mean, pp_stage.py).

Buckets, as in PyTorch's DistributedDataParallel (Li et al. 2020, "PyTorch Distributed"): one layer's gradients (or the
head's, or the embedding's) side by side in one flat buffer, so one all-reduce moves a whole layer, the micro-batches
accumulating into its views in place. Once a bucket is final (in the last micro-batch's backward, right after that
layer's), overlap=True starts its all-reduce (async_op=True): it travels while the layers below recompute and run their
backward (and, in a pipeline, while the stage waits in its cool-down). The step ends waiting for what has not arrived
(the exposed communication: a "reduce" span of the Timeline); overlap=False all-reduces every bucket after the backward,
all exposed. Each bucket's launch and the first moment it was seen complete (polled at every later launch and at the
end) are kept for the timeline figure. Bytes (comm.py's count): the stage's gradients once per step.
"""
import time

import torch
import torch.distributed as dist


class GradientBuckets:
    """names: {bucket: [parameter names]} in the order they become final; shapes: {name: shape}."""

    def __init__(self, names, shapes, dtype, device, comm=None, overlap=True, timeline=None, tracker=None):
        self.comm, self.overlap, self.timeline, self.dtype = comm, overlap, timeline, dtype
        self.flat, self.views = {}, {}
        for bucket, members in names.items():
            sizes = [torch.Size(shapes[name]).numel() for name in members]
            flat = torch.zeros(sum(sizes), dtype=dtype, device=device)  # (n,) one bucket's gradients, side by side
            if tracker is not None:
                tracker.mark(flat, "gradients")
            self.flat[bucket] = flat
            for name, part in zip(members, flat.split(sizes)):
                self.views[name] = part.view(shapes[name])  # (shape) a view into the bucket
        self.launched = {}  # bucket -> (work, launch time)
        self.events = []    # (bucket, bytes, launched at, seen complete at), times on the Timeline's clock

    def add(self, name, grad):
        self.views[name] += grad.to(self.dtype)  # (shape) accumulated over micro-batches, in the master dtype

    def ready(self, bucket):
        """Bucket's gradients are final (its last micro-batch's backward is done with them)."""
        if self.comm is None or not self.overlap:
            return
        self._poll()
        flat = self.flat[bucket]
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.comm.group, async_op=True)  # sum over replicas
        self.comm.log.record(self.comm.phase, "all_reduce", flat.nbytes)
        self.launched[bucket] = (work, time.monotonic())  # no device synchronisation: it would wait for the all-reduce

    def finish(self):
        """Wait for the overlapped all-reduces still travelling, or (overlap=False) run them all now."""
        if self.comm is None:
            return
        with self.timeline.span("reduce"):
            if not self.overlap:
                for bucket, flat in self.flat.items():  # in the order they became final
                    start = time.monotonic()
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.comm.group)  # blocking
                    self.comm.log.record(self.comm.phase, "all_reduce", flat.nbytes)
                    self.events.append((bucket, flat.nbytes, start, time.monotonic()))
                return
            missing = set(self.flat) - set(self.launched)
            assert not missing, f"gradient buckets {sorted(missing, key=str)} were never final"
            for bucket, (work, launched) in self.launched.items():
                work.wait()
                self._seen(bucket, launched)
        self.launched.clear()

    def grads(self):
        return dict(self.views)

    def _poll(self):
        for bucket, (work, launched) in self.launched.items():
            if work.is_completed():
                self._seen(bucket, launched)

    def _seen(self, bucket, launched):
        if not any(event[0] == bucket for event in self.events):
            self.events.append((bucket, self.flat[bucket].nbytes, launched, time.monotonic()))


class ExpertAndDenseBuckets:
    """Under ep: the experts' buckets over the expert-data-parallel group, the rest over the data-parallel one."""

    def __init__(self, dense, experts, is_expert):
        self.parts, self.is_expert = (dense, experts), is_expert

    def add(self, name, grad):
        self.parts[self.is_expert(name)].add(name, grad)

    def ready(self, bucket):
        for part in self.parts:
            if bucket in part.flat:
                part.ready(bucket)

    def finish(self):
        for part in self.parts:
            part.finish()

    def grads(self):
        return {**self.parts[0].grads(), **self.parts[1].grads()}

    @property
    def events(self):
        return self.parts[0].events + self.parts[1].events
