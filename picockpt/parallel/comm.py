"""The counted collectives: a Comm (one process group as this rank sees it), its log of bytes and calls per phase, and
the collectives; their forward/backward pairs sit beside their layers (tp_comm.py, ep_comm.py, pp_comm.py, dp_comm.py).

Bytes counted (Comm.log), per rank, one number per call: the size of the collective's logical buffer (the size S of
nccl-tests' doc/PERFORMANCE.md, whose algorithm bandwidth is S / time), whatever algorithm runs on the wire:
    all-reduce      the tensor's bytes (= the output's)
    all-gather      the gathered output's = world_size x the input's
    reduce-scatter  the full input's = world_size x the output's
    all-to-all      this rank's input, its own chunk included (CommLog.sent: less that chunk, which stays here)
received=True counts an all-gather or a reduce-scatter as (n-1)/n of that instead, the bytes that reach this rank
from the others (context parallelism's K/V, counted as its ring's). Calls that move nothing are not counted; each
call is booked under the `phase_name` of `comm.tracker` (a Tracker), "outside" without one. An all-reduce is in
place on its contiguous argument, as in torch.distributed.
"""
import collections

import torch
import torch.distributed as dist

OUTSIDE = "outside"  # the phase when no tracker is attached (as picockpt.measurement.tracker.OUTSIDE)
PHASES = ("forward", "recompute", "backward")  # the phases communication and FLOPs are reported by
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older torch's name
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommLog:
    """Bytes and calls per phase and per collective kind, for one rank; total and count sum them over every phase and
    kind unless one is named."""

    def __init__(self):
        self.bytes = collections.defaultdict(collections.Counter)  # phase -> {kind -> bytes}
        self.calls = collections.defaultdict(collections.Counter)  # phase -> {kind -> number of calls}
        self.sent = collections.Counter()  # phase -> an all-to-all's bytes to other ranks (its buffer less rows kept)

    def record(self, phase, kind, nbytes, sent=0):  # sent: an all-to-all's bytes to other ranks
        self.bytes[phase][kind] += nbytes
        self.calls[phase][kind] += 1
        self.sent[phase] += sent

    def total(self, phase=None, kind=None):  # bytes
        return _sum(self.bytes, phase, kind)

    def count(self, phase=None, kind=None):  # calls
        return _sum(self.calls, phase, kind)

    def report(self, phases):
        """What a rank's report says of its communication: bytes and calls per phase, bytes by kind."""
        return {"comm_bytes": {phase: self.total(phase) for phase in phases},
                "comm_calls": {phase: self.count(phase) for phase in phases},
                "comm_bytes_by_kind": {phase: dict(self.bytes.get(phase, {})) for phase in phases},
                "all_to_all_sent_bytes": {phase: self.sent.get(phase, 0) for phase in phases}}


def _sum(table, phase, kind):
    return sum(n for p, per_kind in table.items() if phase in (None, p)
               for k, n in per_kind.items() if kind in (None, k))


class Comm:
    """One process group as this rank sees it: its rank, size, tensors' device, the log of what its collectives moved
    and its job's timeout. group=None: every rank (torch's default group); progress: run_ranks' (progress=) or None."""

    def __init__(self, group=None, device="cpu", tracker=None, timeout=None, progress=None):
        self.group = group if group is not None else dist.group.WORLD
        self.timeout = timeout  # a timedelta: what a group made from this one must wait at most (new_group's timeout)
        self.progress = progress
        self.rank = dist.get_rank(self.group)  # this process's rank inside the group
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device)
        self.tracker = tracker  # read for its phase_name only
        self.log = CommLog()

    @property
    def phase(self):
        return getattr(self.tracker, "phase_name", OUTSIDE)

    def __repr__(self):
        return f"Comm(rank={self.rank}, world_size={self.world_size}, device={self.device})"


# -- the collectives themselves, each counted once ------------------------------------------------
def all_reduce(x, comm, op=dist.ReduceOp.SUM):
    if comm.world_size == 1:  # a group of one: the sum is x itself, and nothing moves (as Megatron returns early)
        return x
    x = x.contiguous()  # no copy when x is contiguous (the usual case); the reduction happens in place
    dist.all_reduce(x, op=op, group=comm.group)  # x (...) = sum (or max) over ranks, on every rank
    comm.log.record(comm.phase, "all_reduce", x.nbytes)
    return x


def all_reduce_max(x, comm):
    """The elementwise max over ranks, in place (an all-reduce, counted as one). No backward pair: it serves where
    its result is a constant of the gradient, as the shift that keeps a softmax's exponentials finite (vocab.py)."""
    return all_reduce(x, comm, dist.ReduceOp.MAX)  # (...) elementwise max over ranks


def all_gather(x, comm, dim, received=False):
    dim = check_dim(x, dim)
    if comm.world_size == 1:  # the one shard is the whole
        return x
    shard, W = x.contiguous(), comm.world_size  # (..., n, ...) copied only if a strided view: sent as a flat buffer
    flat = x.new_empty((W * shard.shape[0],) + tuple(shard.shape[1:]))  # (W*d0, ...)
    all_gather_flat(flat, shard, group=comm.group)  # the shards one after another, along dim 0
    comm.log.record(comm.phase, "all_gather", flat.nbytes - shard.nbytes if received else flat.nbytes)
    gathered = flat.unflatten(0, (W, shard.shape[0]))  # (W, ..., n, ...) a view: gathered[r] = rank r's shard
    return gathered.movedim(0, dim).flatten(dim, dim + 1)  # (..., W*n, ...) a copy when dim > 0, a view for 0


def reduce_scatter(x, comm, dim, received=False):
    dim = check_dim(x, dim, comm)
    if comm.world_size == 1:  # the one chunk, summed over one rank
        return x
    W, n = comm.world_size, x.shape[dim] // comm.world_size
    chunks = x.unflatten(dim, (W, n)).movedim(dim, 0).contiguous()  # (W, ..., n, ...) a copy when dim > 0
    shard = x.new_empty(chunks.shape[1:])  # (..., n, ...)
    flat = chunks.flatten(0, 1)  # (W*d0, ...) a view: chunk r (for rank r) is the r-th block along dim 0
    _reduce_scatter_flat(shard, flat, op=dist.ReduceOp.SUM, group=comm.group)  # shard = sum over ranks of chunk[rank]
    comm.log.record(comm.phase, "reduce_scatter", chunks.nbytes - shard.nbytes if received else chunks.nbytes)
    return shard


def all_to_all(x, comm, send_splits, receive_splits):
    for name, splits in (("send_splits", send_splits), ("receive_splits", receive_splits)):
        if len(splits) != comm.world_size or any(s < 0 for s in splits):
            raise ValueError(f"{name}={list(splits)}: give {comm.world_size} row counts (one per rank), none negative")
    if sum(send_splits) != x.shape[0]:
        raise ValueError(f"send_splits={list(send_splits)} sum to {sum(send_splits)}, but the tensor has "
                         f"{x.shape[0]} rows (dim 0); they must add up to it")
    if comm.world_size == 1:  # every row stays
        return x
    rows = x.contiguous()  # (N_send, ...) a copy only if x is a strided view
    received = x.new_empty((sum(receive_splits),) + tuple(x.shape[1:]))  # (N_receive, ...)
    dist.all_to_all_single(received, rows, output_split_sizes=list(receive_splits),
                           input_split_sizes=list(send_splits), group=comm.group)  # rows for rank s -> rank s
    own = send_splits[comm.rank] * rows[:1].nbytes if rows.shape[0] else 0  # the rows it sends itself
    comm.log.record(comm.phase, "all_to_all", rows.nbytes, sent=rows.nbytes - own)  # the buffer; what leaves
    return received


def check_dim(x, dim, comm=None):  # comm: its ranks must divide the dim's size
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim}: a tensor of shape {tuple(x.shape)} has dims {-x.dim()}..{x.dim() - 1}")
    dim %= x.dim()  # a negative dim counts from the end
    if comm is not None and x.shape[dim] % comm.world_size:
        raise ValueError(f"dim={dim}: size {x.shape[dim]} of a tensor of shape {tuple(x.shape)} is not divisible "
                         f"by the {comm.world_size} ranks; use a length that is a multiple of {comm.world_size}")
    return dim


def all_reduce_grads(grads, comm, mean=False):
    """Sum (mean=True: average) each gradient of {name: tensor} over the ranks, in place, one all-reduce each. mean: the
    ranks' losses are means over equal batches; a sum: replicated weights in a tensor-parallel group (norms under
    sequence parallelism), each rank's gradient a partial one from its own tokens."""
    for name, grad in grads.items():
        reduced = all_reduce(grad, comm)  # (same shape) in place when grad is contiguous
        grads[name] = reduced.div_(comm.world_size) if mean else reduced
    return grads
