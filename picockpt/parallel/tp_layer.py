"""One Llama decoder layer on one tensor-parallel rank (Megatron-LM; Korthikanti et al. 2022 with
sequence parallelism): the same two blocks as picockpt/layer.py, between the same norms and
residual adds, with every collective written where it happens.

    h   = x + dropout(LEAVE(o_proj(attention(q, k, v))))     q, k, v = projections of ENTER(rmsnorm(x))
    out = h + dropout(LEAVE(down(silu(gate) * up)))           gate, up = projections of ENTER(rmsnorm(h))

Rank r holds H/t query heads and KV/t key/value heads (q, k, v column-parallel, o row-parallel)
and f/t of the MLP (gate, up column-parallel, down row-parallel): picockpt/parallel/shard.py. The
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
from ..layer import attention_block_backward, attention_block_forward, mlp_block_backward, mlp_block_forward
from ..ops import dropout_backward, dropout_forward, rmsnorm_apply, rmsnorm_backward, rmsnorm_forward
from ..params import LayerWeights
from .comm import (all_reduce_grads, copy_to_parallel_backward, copy_to_parallel_forward, gather_sequence_backward,
                   gather_sequence_forward, reduce_from_parallel_backward, reduce_from_parallel_forward,
                   scatter_sequence_backward, scatter_sequence_forward)
from .rng import full_size_draws, sliced_mask


def tp_layer_forward(x, w, cfg, rope, comm, sp, store=None, i=None, drop=frozenset(), need_output=True):
    """x (B, n, h) -> out (B, n, h) on this rank (n = T/t with sp, else T); w: the rank's LayerWeights.
    Keeps its tensors in `store` under layer i but the names in `drop`, as layer_forward does;
    need_output=False stops after the MLP's product (no down projection, no LEAVE, no residual)."""
    def keep(name, tensor):
        if store is not None and name not in drop:
            store.put(i, name, tensor)

    B, n, h = x.shape
    p, stat = cfg.dropout, cfg.stat_dtype
    whole = (B, n * comm.world_size if sp else n, h)  # a residual branch's shape in the single process
    tokens = 1 if sp else None  # under sp a residual branch's mask is this rank's slice along the tokens
    # ---- attention block: h_mid = x + dropout(LEAVE(o_proj(attention(q, k, v)))) ----
    xn, rstd = rmsnorm_forward(x, w.attn_norm, cfg.norm_eps, stat)  # (B, n, h), (B, n, 1)
    keep("attn_norm.rstd", rstd)
    keep("attn_norm.output", xn)  # under sp: this rank's tokens only
    # ENTER: all-gather the tokens (sp) | identity (its backward all-reduces)
    xn = gather_sequence_forward(xn, comm) if sp else copy_to_parallel_forward(xn, comm)  # (B, T, h)
    with full_size_draws(comm, dim=1, dropout=p):  # eager attention's mask: the single process's, sliced
        a = attention_block_forward(xn, w, cfg, rope, keep)  # (B, T, h) partial: this rank's heads through o_proj
    del xn
    # LEAVE: reduce-scatter, each rank keeping its tokens of the sum (sp) | all-reduce
    a = scatter_sequence_forward(a, comm) if sp else reduce_from_parallel_forward(a, comm)  # (B, n, h)
    if p > 0:
        mask = sliced_mask(whole, p, x.device, comm, tokens)  # (B, n, h) bool
        keep("attn.dropout_mask", mask)
        a = dropout_forward(a, mask, p)  # (B, n, h)
    h_mid = x + a  # (B, n, h) residual stream after attention
    del a
    keep("mlp_norm.input", h_mid)
    # ---- MLP block: out = h_mid + dropout(LEAVE(down(silu(gate) * up))) ----
    xn2, rstd2 = rmsnorm_forward(h_mid, w.mlp_norm, cfg.norm_eps, stat)  # (B, n, h), (B, n, 1)
    keep("mlp_norm.rstd", rstd2)
    keep("mlp_norm.output", xn2)
    # ENTER: all-gather (sp) | identity
    xn2 = gather_sequence_forward(xn2, comm) if sp else copy_to_parallel_forward(xn2, comm)  # (B, T, h)
    m = mlp_block_forward(xn2, w, keep, project=need_output)  # (B, T, h) partial: this rank's f/t, or None
    del xn2
    if not need_output:
        if p > 0:  # the same draw as below, so the generator and the mask are as in the first forward
            keep("mlp.dropout_mask", sliced_mask(whole, p, x.device, comm, tokens))  # (B, n, h) bool
        return None
    # LEAVE: reduce-scatter (sp) | all-reduce
    m = scatter_sequence_forward(m, comm) if sp else reduce_from_parallel_forward(m, comm)  # (B, n, h)
    if p > 0:
        mask = sliced_mask(whole, p, x.device, comm, tokens)  # (B, n, h) bool
        keep("mlp.dropout_mask", mask)
        m = dropout_forward(m, mask, p)  # (B, n, h)
    return h_mid + m  # (B, n, h)


def tp_layer_backward(dout, w, cfg, rope, comm, sp, store, i):
    """dout (B, n, h) -> dx (B, n, h) and the rank's LayerWeights of weight gradients (its slices of
    q, k, v, o, gate, up, down; the whole norm weights' gradients, the same on every rank).
    The forward, restated: each block is LEAVE(block(ENTER(norm(x)))), so its backward is
    ENTER_backward(block_backward(LEAVE_backward(d))), then the norm's backward, then the residual."""
    def take(name, rebuild=None):
        return store.pop(i, name, rebuild)

    p = cfg.dropout
    # ---- MLP block: out = h_mid + dropout(LEAVE(m_partial)) ----
    def dm():  # d m_partial: LEAVE's backward gives every rank the gradient of the whole sum
        d = dout if p == 0 else dropout_backward(dout, take("mlp.dropout_mask"), p)  # (B, n, h)
        # LEAVE's backward: all-gather the tokens' gradients (sp) | identity (d is the same on every rank)
        return scatter_sequence_backward(d, comm) if sp else reduce_from_parallel_backward(d, comm)  # (B, T, h)

    h_mid, rstd2 = take("mlp_norm.input"), take("mlp_norm.rstd")  # (B, n, h), (B, n, 1)

    def normed2():  # the block's input xn2 (B, T, h): the kept (or rebuilt) norm output, all-gathered again under sp
        xn2 = take("mlp_norm.output", rebuild=lambda: rmsnorm_apply(h_mid, rstd2, w.mlp_norm))  # (B, n, h)
        return gather_sequence_forward(xn2, comm) if sp else xn2  # (B, T, h) all-gather again (sp) | as kept

    dxn2, (d_gate, d_up, d_down) = mlp_block_backward(dm, normed2, w, take)  # (B, T, h) partial: through f/t
    # ENTER's backward: reduce-scatter the ranks' partial gradients (sp) | all-reduce them
    dxn2 = gather_sequence_backward(dxn2, comm) if sp else copy_to_parallel_backward(dxn2, comm)  # (B, n, h)
    dh, d_mlp_norm = rmsnorm_backward(dxn2, h_mid, rstd2, w.mlp_norm)  # (B, n, h), (h,)
    del dxn2, h_mid, rstd2
    dh += dout  # (B, n, h) both paths into h_mid: the norm and the residual
    # ---- attention block: h_mid = x + dropout(LEAVE(a_partial)) ----
    def da():
        d = dh if p == 0 else dropout_backward(dh, take("attn.dropout_mask"), p)  # (B, n, h)
        # LEAVE's backward: all-gather the tokens' gradients (sp) | identity (d is the same on every rank)
        return scatter_sequence_backward(d, comm) if sp else reduce_from_parallel_backward(d, comm)  # (B, T, h)

    x, rstd = take("input"), take("attn_norm.rstd")  # (B, n, h), (B, n, 1)

    def normed():
        xn = take("attn_norm.output", rebuild=lambda: rmsnorm_apply(x, rstd, w.attn_norm))  # (B, n, h)
        return gather_sequence_forward(xn, comm) if sp else xn  # (B, T, h) all-gather again (sp) | as kept

    dxn, (d_q, d_k, d_v, d_o) = attention_block_backward(da, normed, w, cfg, rope, take, store.recomputing)
    # ENTER's backward: reduce-scatter (sp) | all-reduce; dxn was (B, T, h), partial: this rank's heads only
    dxn = gather_sequence_backward(dxn, comm) if sp else copy_to_parallel_backward(dxn, comm)  # (B, n, h)
    dx, d_attn_norm = rmsnorm_backward(dxn, x, rstd, w.attn_norm)  # (B, n, h), (h,)
    del dxn, x, rstd
    dx += dh  # (B, n, h) the norm and the residual path into x
    if sp:  # each rank's norm gradients sum over its own tokens only: all-reduce them (in the master dtype)
        norms = all_reduce_grads({"attn_norm": d_attn_norm.to(cfg.param_dtype),
                                  "mlp_norm": d_mlp_norm.to(cfg.param_dtype)}, comm)  # (h,) x2, summed over ranks
        d_attn_norm, d_mlp_norm = norms["attn_norm"], norms["mlp_norm"]
    grads = LayerWeights(attn_norm=d_attn_norm, q=d_q, k=d_k, v=d_v, o=d_o,
                         mlp_norm=d_mlp_norm, gate=d_gate, up=d_up, down=d_down)
    return dx, grads
