"""Data parallelism: a stage's gradients, accumulated over micro-batches in buckets, summed over the
data-parallel replicas with all-reduces that overlap the rest of the backward.

Each replica runs the same stage on its own 1/dp of the batch. Its gradients are those of its
share of the whole batch's mean loss (picockpt/parallel/pipeline_parallel/pp_stage.py scales each micro-batch by
its counted targets over the whole batch's), so the whole batch's gradient is their sum: one
all-reduce (sum) of every gradient over the data-parallel group.

Buckets, as PyTorch's DistributedDataParallel has them (Li et al. 2020, "PyTorch Distributed"):
the gradients of one layer (or of the head, or the embedding) live side by side in one flat buffer,
so one all-reduce moves a whole layer, and the micro-batches accumulate into its views in place.

When a bucket's gradients are final, in the backward of the last micro-batch right after that
layer's backward, overlap=True starts its all-reduce at once, asynchronously
(dist.all_reduce(..., async_op=True)): it travels while the layers below recompute and run their
backward (and, in a pipeline, while the stage waits in its cool-down). At the end of the step the
rank waits for whatever has not arrived yet: that wait is the communication left exposed, a
"reduce" span of the rank's Timeline. overlap=False all-reduces every bucket after the backward,
one after another: all of it exposed. Bucket i's launch and the first moment it was seen complete
(polled at every later bucket's launch, and at the end) are kept for the timeline figure.

Bytes: each all-reduce counts its buffer's size (as picockpt/parallel/comm.py counts): over a step,
every gradient of the stage once.
"""
import time

import torch
import torch.distributed as dist


class GradientBuckets:
    """names: {bucket: [parameter names]} in the order they become final; shapes: {name: shape}."""

    def __init__(self, names, shapes, dtype, device, comm=None, overlap=True, timeline=None, tracker=None):
        self.comm, self.overlap, self.timeline = comm, overlap, timeline
        self.dtype = dtype
        self.flat, self.views, self.bucket_of = {}, {}, {}
        for bucket, members in names.items():
            sizes = [torch.Size(shapes[name]).numel() for name in members]
            flat = torch.zeros(sum(sizes), dtype=dtype, device=device)  # (n,) one bucket's gradients, side by side
            if tracker is not None:
                tracker.mark(flat, "gradients")
            self.flat[bucket] = flat
            for name, part in zip(members, flat.split(sizes)):
                self.views[name] = part.view(shapes[name])  # (shape) a view into the bucket
                self.bucket_of[name] = bucket
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
        self.launched[bucket] = (work, self._now())

    def finish(self):
        """Wait for the overlapped all-reduces still travelling, or (overlap=False) run them all now."""
        if self.comm is None:
            return
        with self.timeline.span("reduce"):
            if not self.overlap:
                for bucket, flat in self.flat.items():  # in the order they became final
                    start = self._now()
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.comm.group)  # blocking
                    self.comm.log.record(self.comm.phase, "all_reduce", flat.nbytes)
                    self.events.append((bucket, flat.nbytes, start, self._now()))
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
            self.events.append((bucket, self.flat[bucket].nbytes, launched, self._now()))

    def _now(self):
        return time.monotonic()  # no device synchronisation: that would wait for the all-reduces themselves


class ExpertAndDenseBuckets:
    """Under expert parallelism, two sets of buckets: the experts' gradients summed over the ranks that hold
    the same experts (the expert-data-parallel group), every other gradient over every replica of it (the
    data-parallel group, dp x ep ranks: picockpt/parallel/layout.py). The same calls as GradientBuckets."""

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
