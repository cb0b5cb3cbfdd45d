"""The collectives of tensor and sequence parallelism as forward/backward pairs, two plain functions side by side
like picockpt/ops/* (no autograd): the layer calls each where its forward or backward crosses ranks, so every byte
that moves is one visible line. As in Megatron-LM (Shoeybi et al. 2019, "f" and "g") and Korthikanti et al. 2022
(sec. 4.2.2, "g" and "g-bar"), each backward is the adjoint of its forward:

    pair                  forward                          backward
    copy_to_parallel      identity                         all-reduce          entering a TP region
    reduce_from_parallel  all-reduce                       identity            after a row-parallel linear
    gather_sequence       all-gather along dim             reduce-scatter      entering a TP region (SP)
    scatter_sequence      reduce-scatter along dim         all-gather          leaving it (SP)
    split_sequence        take this rank's shard (no comm) all-gather

"replicated": the same logical tensor (and gradient) on every rank; "partial": each rank holds a summand of it;
"sharded": each rank holds one slice of it along dim. Bytes are counted by comm.py.
"""
from ..comm import all_gather, all_reduce, check_dim, check_divisible, reduce_scatter


def copy_to_parallel_forward(x, comm):
    # x (...) replicated: every rank already holds all of it, so entering the region moves nothing
    return x  # (...)


def copy_to_parallel_backward(dy, comm):
    """Forward was y_r = x on every rank r (one replicated x feeds W column-parallel branches). x is used W times,
    once per rank's branch, so its gradient is the sum of the W uses':
        dx = sum_r dy_r          -> all-reduce of dy (every rank needs dx: x is replicated)"""
    return all_reduce(dy, comm)  # (...) sum over ranks, in place


def reduce_from_parallel_forward(x, comm):
    # x (...) partial: this rank's summand (a row-parallel linear's x_r @ W_r.T)
    return all_reduce(x, comm)  # (...) y = sum_r x_r, replicated, in place


def reduce_from_parallel_backward(dy, comm):
    """Forward was y = sum_r x_r, then y is replicated. dy/dx_r = identity, so dx_r = dy; and dy is already the same
    on every rank (what follows y is computed redundantly on every rank), so nothing moves."""
    return dy  # (...)


# -- sequence parallel: between sequence shards and the full sequence ------------------------------
def gather_sequence_forward(x, comm, dim=1):
    # x (B, T/W, h) this rank's shard of the sequence (along dim) -> the full, replicated sequence
    return all_gather(x, comm, dim)  # (B, T, h)


def gather_sequence_backward(dy, comm, dim=1):
    """Forward was y = cat(x_0, ..., x_{W-1}) along dim, the same y on every rank, each rank's tensor-parallel branch
    using it. Each branch gives a partial gradient dy_r of the full y; y's gradient is their sum, and x_r is slice r:
        dx_r = (sum_s dy_s)[slice r]     -> reduce-scatter of dy along dim"""
    return reduce_scatter(dy, comm, dim)  # (B, T/W, h)


def scatter_sequence_forward(x, comm, dim=1):
    # x (B, T, h) partial (a row-parallel linear's summand) -> this rank's shard of the sum
    return reduce_scatter(x, comm, dim)  # (B, T/W, h)


def scatter_sequence_backward(dy, comm, dim=1):
    """Forward was y_r = (sum_s x_s)[slice r]: rank r keeps slice r of the sum. d y_r / d x_s is "take slice r" for
    every s, so x_s's gradient is every slice's gradient put back in place, the same on every rank:
        dx_s = cat(dy_0, ..., dy_{W-1}) along dim   -> all-gather of dy"""
    return all_gather(dy, comm, dim)  # (B, T, h)


def split_sequence_forward(x, comm, dim=1):
    # x (B, T, h) replicated: rank r keeps slice r; nothing moves
    dim = check_divisible(x, comm, check_dim(x, dim))
    return x.chunk(comm.world_size, dim)[comm.rank]  # (B, T/W, h) a view of x, no copy


def split_sequence_backward(dy, comm, dim=1):
    """Forward was y_r = x[slice r], one replicated x. x's gradient holds every slice's gradient in its place, and
    every rank needs it (x is replicated):
        dx = cat(dy_0, ..., dy_{W-1}) along dim     -> all-gather of dy"""
    return all_gather(dy, comm, dim)  # (B, T, h)
