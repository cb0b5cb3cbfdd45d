"""Token embedding: a row lookup, y[b, t] = W[ids[b, t]]."""
import torch


def embedding_forward(ids, weight):
    # ids (B, T) int64, weight (V, h)
    return weight[ids]  # (B, T, h)


def embedding_backward(dy, ids, weight_shape):
    """Forward was y[b, t, :] = W[ids[b, t], :].

    Each row of W receives the sum of the gradients of the positions that read it:
    dW[v, :] = sum over (b, t) with ids[b, t] == v of dy[b, t, :]

    A scatter-add (index_add_) would do it in one line, but on CUDA its atomic adds land in any order, so the sums, and
    every "bitwise equal" check built on them, would change from run to run; and in bf16 it would add in bf16. Instead:
    sort the positions by token id (stably, so positions keep their order), sum each run of equal ids in one segment
    reduction, and write each sum to its row once. Same order every time, and in fp32 at least (fp64 in fp64 runs).
    """
    h, accumulate = dy.shape[-1], torch.promote_types(dy.dtype, torch.float32)  # bf16 -> fp32
    flat_ids = ids.reshape(-1)  # (N,) N = B*T
    order = flat_ids.argsort(stable=True)  # (N,) positions grouped by token id, in position order
    rows, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)  # (U,) ids read, (U,) how often
    sums = torch.segment_reduce(dy.reshape(-1, h)[order].to(accumulate), "sum", lengths=counts)  # (U, h)
    dweight = torch.zeros(weight_shape, dtype=accumulate, device=dy.device)  # (V, h)
    dweight[rows] = sums  # (V, h) each row written once; rows never read stay 0
    return dweight
