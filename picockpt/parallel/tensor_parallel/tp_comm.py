"""Tensor and sequence parallelism's collectives as forward/backward pairs, plain functions like picockpt/ops/* (no
autograd) called where the layer crosses ranks: every byte that moves is one visible line. Each backward is its
forward's adjoint (Megatron's "f" and "g", Shoeybi et al. 2019; sp's "g" and "g-bar", Korthikanti et al. 2022 4.2.2):

    pair                  forward                          backward
    copy_to_parallel      identity                         all-reduce          entering a TP region
    reduce_from_parallel  all-reduce                       identity            after a row-parallel linear
    gather_sequence       all-gather along dim             reduce-scatter      entering a TP region (SP)
    scatter_sequence      reduce-scatter along dim         all-gather          leaving it (SP)
    split_sequence        take this rank's shard (no comm) all-gather

"replicated": the same tensor (and gradient) on every rank; "partial": a summand of it on each rank; "sharded": one
slice of it along dim on each rank. comm.py counts the bytes."""
from ..comm import all_gather, all_reduce, check_dim, reduce_scatter


def copy_to_parallel_forward(x, comm):
    return x  # (...) replicated: every rank already holds all of it, so entering the region moves nothing


def copy_to_parallel_backward(dy, comm):
    """Forward was y_r = x, one replicated x feeding every rank's branch: dx = sum_r dy_r, on every rank."""
    return all_reduce(dy, comm)  # (...) sum over ranks, in place


def reduce_from_parallel_forward(x, comm):
    return all_reduce(x, comm)  # (...) partial x_r (a row-parallel linear's x_r @ W_r.T) -> y = sum_r x_r, in place


def reduce_from_parallel_backward(dy, comm):
    """Forward was y = sum_r x_r, replicated: dx_r = dy, already equal on every rank (each runs what follows y)."""
    return dy  # (...)


def gather_sequence_forward(x, comm, dim=1):
    return all_gather(x, comm, dim)  # (B, T/W, h) this rank's shard (along dim) -> (B, T, h) the whole, replicated


def gather_sequence_backward(dy, comm, dim=1):
    """Forward was y = cat(x_0, ..., x_{W-1}), each branch giving a partial dy_r: dx_r = (sum_s dy_s)[slice r]."""
    return reduce_scatter(dy, comm, dim)  # (B, T/W, h)


def scatter_sequence_forward(x, comm, dim=1):
    return reduce_scatter(x, comm, dim)  # (B, T, h) partial (a row-parallel linear's) -> (B, T/W, h) a shard of the sum


def scatter_sequence_backward(dy, comm, dim=1):
    """Forward was y_r = (sum_s x_s)[slice r]: every x_s's gradient is cat(dy_0, ..., dy_{W-1}), on every rank."""
    return all_gather(dy, comm, dim)  # (B, T, h)


def split_sequence_forward(x, comm, dim=1):
    dim = check_dim(x, dim, comm)
    return x.chunk(comm.world_size, dim)[comm.rank]  # (B, T/W, h) slice r of a replicated x, a view: nothing moves


def split_sequence_backward(dy, comm, dim=1):
    """Forward was y_r = x[slice r] of one replicated x: dx = cat(dy_0, ..., dy_{W-1}) on every rank, an all-gather."""
    return all_gather(dy, comm, dim)  # (B, T, h)
