"""The vocabulary split over a tensor-parallel rank's neighbours: its embedding rows and its cross-entropy columns
(Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy). Rank r holds the rows
V_r = [r*V/t, (r+1)*V/t) of the embedding and the LM head; picockpt/model/head.py's head runs unchanged on them.

    embedding  x    = all-reduce(x_r) (sp: reduce-scatter), x_r = embed_r[ids] where the id is in V_r, else 0
    LM head    z_r  = ENTER(rmsnorm(x_L)) @ lm_head_r.T    (B, T, V/t) this rank's columns; ENTER as in tp_layer.py
    loss       lse  = m + log all-reduce(sum_v exp(z_r - m)),  m = all-reduce-max(max_v z_r)    (N,) over all V
               loss = mean over counted rows of (lse - all-reduce(z_r[target] where it is in V_r, else 0))

Only one rank's x_r is not 0 at a token, so the sum is exact. No rank holds the (N, V) logits; three numbers per row
move. lm_head.lse (B, T) is stored even when the logits are chunked: the softmax's denominator spans every rank's
columns, so rebuilding it would cost two more all-reduces; with it the loss's backward moves nothing:
dz_r = scale * (exp(z_r - lse) - onehot_r(target)), onehot_r 1 only at targets in V_r."""
import torch

from ...ops import embedding_backward, embedding_forward
from ...ops.cross_entropy import IGNORE_INDEX
from ..comm import all_reduce_max
from .tp_comm import reduce_from_parallel_backward, reduce_from_parallel_forward, scatter_sequence_backward
from .tp_comm import scatter_sequence_forward


def embedding_forward_parallel(ids, weight, comm, sp):
    """ids (B, T) -> the input of layer 0: (B, T, h), or this rank's tokens (B, T/t, h) with sp."""
    size, start = weight.shape[0], comm.rank * weight.shape[0]  # V/t, this rank's first token id
    mine = (ids >= start) & (ids < start + size)  # (B, T) bool: tokens whose row this rank holds
    x = embedding_forward((ids - start) * mine, weight)  # (B, T, h) the rows of this rank's ids (row 0 for others)
    x[~mine] = 0  # (B, T, h) partial: every other rank's tokens are 0 here
    # reduce-scatter: each rank keeps its tokens of the sum (sp) | all-reduce: the whole sum on every rank
    return scatter_sequence_forward(x, comm) if sp else reduce_from_parallel_forward(x, comm)  # (B, n, h)


def embedding_backward_parallel(dx, ids, weight_shape, comm, sp):
    """dx (B, n, h) -> the gradient (V/t, h) of this rank's rows: x_r[b, t] = W_r[ids[b, t] - start] for its ids."""
    # the sum's backward: all-gather every rank's tokens' gradients (sp) | identity (dx is the same everywhere)
    dx = scatter_sequence_backward(dx, comm) if sp else reduce_from_parallel_backward(dx, comm)  # (B, T, h)
    size, start = weight_shape[0], comm.rank * weight_shape[0]  # V/t, this rank's first token id
    mine = (ids >= start) & (ids < start + size)  # (B, T) bool
    if not mine.any():  # no token of the batch has its row here
        return torch.zeros(weight_shape, dtype=torch.promote_types(dx.dtype, torch.float32), device=dx.device)
    return embedding_backward(dx[mine], ids[mine] - start, weight_shape)  # (V/t, h) the same sums as one process


def parallel_cross_entropy_forward(logits, targets, comm, stat_dtype):
    """logits (n, V/t): rank r's columns start..start+V/t-1 of n rows, start = r*V/t; targets (n,).
    -> (sum of the counted rows' losses, lse (n,)), the same on every rank."""
    z, start = logits.to(stat_dtype), comm.rank * logits.shape[1]  # (n, V/t), its first column's token id
    top = all_reduce_max(z.amax(-1), comm)  # (n,) all-reduce (max): each row's largest logit over all V
    total = reduce_from_parallel_forward(torch.exp(z - top[:, None]).sum(-1), comm)  # (n,) all-reduce: sum exp
    lse = top + torch.log(total)  # (n,) logsumexp over the whole vocabulary
    del total
    mine = (targets >= start) & (targets < start + z.shape[1])  # (n,) the targets in this rank's columns
    picked = z.gather(-1, ((targets - start) * mine)[:, None])[:, 0] * mine  # (n,) z[n, y[n]] here, else 0
    picked = reduce_from_parallel_forward(picked, comm)  # (n,) all-reduce: z[n, y[n]] from the rank that has it
    counted = targets != IGNORE_INDEX  # (n,) bool (an ignored target is in no rank's columns)
    return torch.where(counted, lse - picked, 0.0).sum(), lse  # scalar, (n,)


def parallel_cross_entropy_backward(scale, logits, targets, comm, lse, stat_dtype):
    """dz (n, V/t) of loss = (1/N) sum_n [lse_n - z_n[y_n]] for this rank's columns, scale = dloss / N: no comm."""
    z, start = logits.to(stat_dtype), comm.rank * logits.shape[1]  # (n, V/t), its first column's token id
    dz = torch.exp(z - lse[:, None])  # (n, V/t) softmax over the whole vocabulary, this rank's columns
    mine = (targets >= start) & (targets < start + z.shape[1])  # (n,) bool
    minus_one = torch.where(mine, -1.0, 0.0).to(dz.dtype)[:, None]  # (n, 1): the one-hot only where it is here
    dz.scatter_add_(-1, ((targets - start) * mine)[:, None], minus_one)  # (n, V/t)
    dz.mul_(torch.where(targets != IGNORE_INDEX, scale, 0.0)[:, None])  # (n, V/t) ignored rows: 0
    return dz.to(logits.dtype)  # (n, V/t)
