"""One Llama decoder layer on one tensor-parallel rank (Megatron-LM; Korthikanti et al. 2022 with
sequence parallelism): picockpt/layer.py's one layer, its crossings (layer.py: Crossings) filled in
with the collectives, each written here where it happens.

    h   = x + dropout(LEAVE(o_proj(attention(q, k, v))))     q, k, v = projections of ENTER(rmsnorm(x))
    out = h + dropout(LEAVE(down(silu(gate) * up)))           gate, up = projections of ENTER(rmsnorm(h))

Rank r holds H/t query heads and KV/t key/value heads (q, k, v column-parallel, o row-parallel)
and f/t of the MLP (gate, up column-parallel, down row-parallel): picockpt/parallel/tensor_parallel/tp_shard.py. The
blocks (attention_block_forward/backward, mlp_block_forward/backward) read their head counts
from the weights, so they run here unchanged on the rank's share and return its *partial* output,
the sum of which over ranks is the single process's. ENTER and LEAVE are conjugate pairs
(picockpt/parallel/comm.py; "f" and "g" in Megatron, "g" and "g-bar" with sequence parallelism):

                   ENTER (before q/k/v, gate/up)              LEAVE (after o, down)
    sp=False       copy_to_parallel: identity | all-reduce    reduce_from_parallel: all-reduce | identity
    sp=True        gather_sequence: all-gather | reduce-scatter  scatter_sequence: reduce-scatter | all-gather
                   (forward | backward)

Without sequence parallelism the norms, residual adds and dropouts run on the whole sequence,
the same on every rank (replicated). With it they run on the rank's T/t tokens: x, h and out are
(B, T/t, h), and only the blocks see all T tokens. What is stored, per rank (n = T/t with sp,
else T): input, norm rstd/output and mlp_norm.input (B, n, h); q (B, H/t, T, hd); k, v
(B, KV/t, T, hd); probs (B, H/t, T, T); context (B, T, h/t); gate, up, act (B, T, f/t); dropout
masks (B, n, h). Under sp the stored norm output is the rank's shard, so the backward all-gathers
it again before the projections' weight gradients (as Megatron does: the gathered tensor is
never kept); that all-gather is counted as backward communication.
"""
from ...layer import Crossings, mlp_block_backward, mlp_block_forward
from ..comm import all_reduce_grads
from ..rng import full_size_draws, sliced_mask
from .tp_comm import (copy_to_parallel_backward, copy_to_parallel_forward, gather_sequence_backward,
                      gather_sequence_forward, reduce_from_parallel_backward, reduce_from_parallel_forward,
                      scatter_sequence_backward, scatter_sequence_forward)


class TensorParallelCrossings(Crossings):
    """Where picockpt/layer.py's layer crosses the t ranks of `comm` (sequence parallel when sp):
    x, h and out are (B, n, h), n = T/t with sp, else T; the blocks see all T tokens."""

    def __init__(self, comm, sp, dropout):
        self.comm, self.sp, self.dropout = comm, sp, dropout

    def attention_draws(self):  # eager attention's mask, (B, H/t, T, T): the single process's, sliced
        return full_size_draws(self.comm, dim=1, dropout=self.dropout)

    def enter(self, xn):
        # ENTER: all-gather the tokens (sp) | identity (its backward all-reduces)
        return gather_sequence_forward(xn, self.comm) if self.sp else copy_to_parallel_forward(xn, self.comm)

    def enter_backward(self, dxn):
        # ENTER's backward: reduce-scatter the ranks' partial gradients (sp) | all-reduce them
        return gather_sequence_backward(dxn, self.comm) if self.sp else copy_to_parallel_backward(dxn, self.comm)

    def leave(self, y):
        # LEAVE: reduce-scatter, each rank keeping its tokens of the sum (sp) | all-reduce (y is partial)
        return scatter_sequence_forward(y, self.comm) if self.sp else reduce_from_parallel_forward(y, self.comm)

    def leave_backward(self, dy):
        # LEAVE's backward: all-gather the tokens' gradients (sp) | identity (dy is the same on every rank)
        return scatter_sequence_backward(dy, self.comm) if self.sp else reduce_from_parallel_backward(dy, self.comm)

    def regather(self, xn):
        # a kept norm output is this rank's tokens under sp: all-gather it again (never kept gathered)
        return gather_sequence_forward(xn, self.comm) if self.sp else xn

    def branch_mask(self, shape, p, device):
        # the single process's (B, T, h) mask; under sp this rank's tokens of it, else all of it
        B, n, h = shape
        whole = (B, n * self.comm.world_size if self.sp else n, h)
        return sliced_mask(whole, p, device, self.comm, 1 if self.sp else None)  # (B, n, h) bool

    def mlp_forward(self, xn2, w, cfg, keep, tail):
        return mlp_block_forward(xn2, w, keep, tail)  # (B, T, h) partial: this rank's f/t, or None

    def mlp_backward(self, grad, normed, w, cfg, take):
        dxn2, (d_gate, d_up, d_down) = mlp_block_backward(grad, normed, w, take)  # (B, T, h) partial
        return dxn2, dict(gate=d_gate, up=d_up, down=d_down)

    def norm_grads(self, d_attn_norm, d_mlp_norm, cfg):
        if not self.sp:  # the norms ran on every token on every rank: the same gradient everywhere
            return d_attn_norm, d_mlp_norm
        # each rank's norm gradients sum over its own tokens only: all-reduce them (in the master dtype)
        norms = all_reduce_grads({"attn_norm": d_attn_norm.to(cfg.param_dtype),
                                  "mlp_norm": d_mlp_norm.to(cfg.param_dtype)}, self.comm)  # (h,) x2, summed
        return norms["attn_norm"], norms["mlp_norm"]
