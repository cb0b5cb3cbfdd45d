"""One Llama decoder layer on one tensor-parallel rank (Megatron-LM; Korthikanti et al. 2022 with sequence parallelism):
picockpt/model/layer.py's one layer, its hooks (layer.py: LayerHooks) filled in with the collectives.

    h   = x + dropout(LEAVE(o_proj(attention(q, k, v))))     q, k, v = projections of ENTER(rmsnorm(x))
    out = h + dropout(LEAVE(down(silu(gate) * up)))           gate, up = projections of ENTER(rmsnorm(h))

The blocks read their head counts from the weights, so they run here unchanged on the rank's share (tp_shard.py) and
return its *partial* output; the ranks' sum is the single process's. Without sequence parallelism the norms, residual
adds and dropouts run on the whole sequence, the same on every rank; with it on the rank's T/t tokens, and only the
blocks see all T. Under sp the stored norm output is the rank's shard, so the backward all-gathers it again before the
projections' weight gradients (as Megatron does: never kept gathered). A mixture of experts runs between the same ENTER
and LEAVE, each expert on its f/t slice, its router whole: the router's gradient, from partial outputs, is summed over
the ranks."""
from ...model.params import EMBED
from ..comm import all_reduce
from ..rank_model import WrappedHooks
from ..rng import full_size_draws, sliced_mask
from .vocab import (embedding_backward_parallel, embedding_forward_parallel, parallel_cross_entropy_backward,
                    parallel_cross_entropy_forward)
from .tp_comm import (copy_to_parallel_backward, copy_to_parallel_forward, gather_sequence_backward,
                      gather_sequence_forward, reduce_from_parallel_backward, reduce_from_parallel_forward,
                      scatter_sequence_backward, scatter_sequence_forward)


def _by_sp(sequence_parallel, plain):
    """A hook that runs tp_comm.py's sequence-parallel collective under sp, the plain one otherwise."""
    return lambda self, x: sequence_parallel(x, self.comm) if self.sp else plain(x, self.comm)


class TensorParallelHooks(WrappedHooks):
    """Where layer.py's layer crosses t ranks of `comm` (sp: sequence parallel), over inner's; x, h, out: (B, n, h)."""

    def __init__(self, comm, sp, dropout, inner):
        super().__init__(inner)
        self.comm, self.sp, self.dropout = comm, sp, dropout

    def attention_draws(self):  # eager attention's mask, (B, H/t, T, T): the single process's, sliced
        return full_size_draws(self.comm, dim=1, dropout=self.dropout)

    enter = _by_sp(gather_sequence_forward, copy_to_parallel_forward)
    enter_backward = _by_sp(gather_sequence_backward, copy_to_parallel_backward)
    leave = _by_sp(scatter_sequence_forward, reduce_from_parallel_forward)
    leave_backward = _by_sp(scatter_sequence_backward, reduce_from_parallel_backward)
    regather = _by_sp(gather_sequence_forward, lambda xn, comm: xn)  # a kept norm output: this rank's tokens under sp

    def branch_mask(self, shape, p, device):  # the single process's (B, T, h) mask: under sp its tokens of it
        B, n, h = shape
        whole = (B, n * self.comm.world_size if self.sp else n, h)
        return sliced_mask(whole, p, device, self.comm, 1 if self.sp else None)  # (B, n, h) bool

    def embed(self, model):  # the rank model's vocab: vocab.py's embedding on this rank's V/t rows
        return embedding_forward_parallel(model.input_ids, model.weights[EMBED], self.comm, self.sp)  # (B, n, h)

    def embed_backward(self, model, dx):
        return embedding_backward_parallel(dx, model.input_ids, model.weights[EMBED].shape, self.comm, self.sp)

    keeps_lse = True  # the head keeps each row's log-sum-exp: rebuilding it would cost two all-reduces again

    def cross_entropy(self, logits, targets, stat_dtype):  # this rank's V/t columns: the row statistics all-reduced
        return parallel_cross_entropy_forward(logits, targets, self.comm, stat_dtype)  # (sum, lse (n,))

    def cross_entropy_backward(self, scale, logits, targets, stat_dtype, lse=None, inplace=False):  # no comm
        return parallel_cross_entropy_backward(scale, logits, targets, self.comm, lse, stat_dtype)  # (n, V/t)

    def _summed(self, cfg, *grads):  # partial gradients, each in the master dtype, all-reduced in place: their sums
        return tuple(all_reduce(grad.to(cfg.param_dtype), self.comm) for grad in grads)

    def final_norm_grad(self, d_norm, cfg):  # sp: each rank's sums over its own tokens only: all-reduce it
        return self._summed(cfg, d_norm)[0] if self.sp else d_norm

    def mlp_backward(self, grad, normed, w, cfg, take):
        dxn2, grads = self.inner.mlp_backward(grad, normed, w, cfg, take)  # the block (or the experts' ranks')
        if cfg.experts:  # the router is whole here, its gradient from this rank's slice of each expert: partial
            grads["router"], = self._summed(cfg, grads["router"])
        return dxn2, grads

    def norm_grads(self, d_attn_norm, d_mlp_norm, cfg):  # as final_norm_grad's (without sp every rank ran every token)
        return self._summed(cfg, d_attn_norm, d_mlp_norm) if self.sp else (d_attn_norm, d_mlp_norm)  # (h,) x2
