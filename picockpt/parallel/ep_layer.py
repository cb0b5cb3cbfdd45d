"""One Llama decoder layer with a mixture of experts on one expert-parallel rank: picockpt/layer.py's
layer on this rank's B/W sequences, its experts' block from picockpt/parallel/ep_moe.py.

    h   = x + dropout(o_proj(attention(q, k, v)))       every weight here whole (replicated), own sequences
    out = h + dropout(EP-MoE(rmsnorm(h)))                 tokens to their experts' ranks and back

Everything but the experts is data parallel: the same weights on every rank, each rank's own
sequences, nothing exchanged (the replicated weights' gradients are summed over the ranks at the
end of the step, picockpt/parallel/ep_step.py). The stored names are layer.py's (at batch B/W),
moe.py's, and the expert-parallel block's own (ep_moe.py's table).

Random draws. Dropout masks and router jitter noise must be the single process's, so each rank
draws the whole batch's tensor from the shared generator state and keeps its own sequences (as
picockpt/parallel/rng.py does for tensor parallelism, here along the batch dim): every rank's
generator then advances as the single process's, and the engine's RNG replay gives a recomputed
layer the same draws again.
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode

from ..layer import attention_block_backward, attention_block_forward
from ..ops import dropout_backward, dropout_forward, dropout_mask, rmsnorm_apply, rmsnorm_backward, rmsnorm_forward
from .ep_moe import DISPATCHED, ROUTING, ep_moe_backward, ep_moe_forward


class KeptRouting:
    """What an expert-parallel layer keeps whatever mode the policy gives it (ep_moe.py's ROUTING, and
    with keep_dispatched the dispatched rows), in the step's store under layer i. The engine hands a
    layer a store only when it is stored whole, so the model gives this one the step's own."""

    def __init__(self, store, i, received_rows=None):
        self.store, self.i = store, i
        self.received_rows = received_rows  # {layer: rows its experts received}, filled in for the report

    def has(self, name):
        return self.store.has(self.i, name)

    def get(self, name):
        return self.store.get(self.i, name)

    def put(self, name, tensor):
        self.store.put(self.i, name, tensor)
        if name == "moe.received_counts" and self.received_rows is not None:
            self.received_rows[self.i] = int(tensor.sum())

    def keep_routing(self, keep):
        """moe.route's keep: the routing decision here, everything else the layer's way."""
        return lambda name, tensor: (self.put if name in ROUTING else keep)(name, tensor)


class _BatchDraws(TorchFunctionMode):
    """torch.rand(shape) and Tensor.uniform_ draw the single process's tensor, W times as many rows
    along dim 0 (the batch), and return this rank's rows. Any other random function is refused."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

    def whole_then_mine(self, shape, draw):
        rows = shape[0]
        whole = draw((rows * self.comm.world_size,) + tuple(shape[1:]))  # the single process's draw
        return whole.narrow(0, self.comm.rank * rows, rows)  # this rank's sequences, a view

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand:  # a dropout mask: torch.rand(shape, device=...)
            shape = tuple(args[0] if len(args) == 1 else args)
            return self.whole_then_mine(shape, lambda whole: func(whole, **kwargs)).clone()  # compact
        if func is torch.Tensor.uniform_:  # router jitter: torch.empty_like(x).uniform_(low, high)
            tensor, *bounds = args
            mine = self.whole_then_mine(tensor.shape, lambda whole: tensor.new_empty(whole).uniform_(*bounds, **kwargs))
            return tensor.copy_(mine)
        if func in (torch.randn, torch.randint, torch.bernoulli, torch.rand_like, torch.randn_like, torch.normal):
            raise RuntimeError(f"{func.__name__} in an expert-parallel layer: only torch.rand and uniform_ are "
                               f"drawn whole and sliced here")
        return func(*args, **kwargs)


def batch_draws(comm, cfg):
    """The context a layer's forward runs in: whole-batch draws (nothing to do without random draws)."""
    if comm.world_size == 1 or not cfg.draws_random:
        return contextlib.nullcontext()
    return _BatchDraws(comm)


def ep_drop(drop):
    """The policy's op level on an expert-parallel layer: moe ("drop all the experts keep") drops the
    dispatched rows too, the experts' input."""
    return drop | frozenset(DISPATCHED) if "moe.gate_up" in drop else drop


def ep_layer_forward(x, w, cfg, rope, comm, kept, first_expert, store=None, i=None, drop=frozenset(),
                     need_output=True, keep_dispatched=False):
    """x (B_r, T, h) -> out (B_r, T, h) on this rank; w: its LayerWeights (whole, but E/W experts).
    Keeps its tensors in `store` under layer i except the names in `drop`, as layer_forward does;
    kept: the layer's KeptRouting (the routing, and with keep_dispatched the dispatched rows)."""
    drop = ep_drop(drop)

    def keep(name, tensor):  # an expert's tensor, "moe.act[3]", is dropped with its kind, "moe.act"
        if store is not None and name.partition("[")[0] not in drop:
            store.put(i, name, tensor)

    B, T, h = x.shape
    p, stat = cfg.dropout, cfg.stat_dtype
    with batch_draws(comm, cfg):
        # ---- attention block: h_mid = x + dropout(o_proj(attention(q, k, v))), own sequences ----
        xn, rstd = rmsnorm_forward(x, w.attn_norm, cfg.norm_eps, stat)  # (B_r, T, h), (B_r, T, 1)
        keep("attn_norm.rstd", rstd)
        keep("attn_norm.output", xn)
        a = attention_block_forward(xn, w, cfg, rope, keep)  # (B_r, T, h)
        del xn
        if p > 0:
            mask = dropout_mask((B, T, h), p, x.device)  # (B_r, T, h) bool: the whole batch's, this rank's rows
            keep("attn.dropout_mask", mask)
            a = dropout_forward(a, mask, p)  # (B_r, T, h)
        h_mid = x + a  # (B_r, T, h) residual stream after attention
        del a
        keep("mlp_norm.input", h_mid)
        # ---- experts: out = h_mid + dropout(EP-MoE(rmsnorm(h_mid))) ----
        xn2, rstd2 = rmsnorm_forward(h_mid, w.mlp_norm, cfg.norm_eps, stat)  # (B_r, T, h), (B_r, T, 1)
        keep("mlp_norm.rstd", rstd2)
        keep("mlp_norm.output", xn2)
        m = ep_moe_forward(xn2, w, cfg, comm, keep, kept, first_expert, keep_dispatched, need_output)  # (B_r, T, h)
        del xn2
        if p > 0:  # drawn even when the output is not needed: the generator as in the first forward
            mask = dropout_mask((B, T, h), p, x.device)  # (B_r, T, h) bool
            keep("mlp.dropout_mask", mask)
        if not need_output:
            return None
        if p > 0:
            m = dropout_forward(m, mask, p)  # (B_r, T, h)
    return h_mid + m  # (B_r, T, h)


def ep_layer_backward(dout, w, cfg, rope, comm, store, i, first_expert):
    """dout (B_r, T, h) -> dx (B_r, T, h) and this rank's gradients by role: the replicated weights'
    from its own sequences (partial: summed over the ranks later), its experts' from every rank's rows."""
    def take(name, rebuild=None):
        return store.pop(i, name, rebuild)

    p = cfg.dropout
    # ---- experts: out = h_mid + dropout(EP-MoE(rmsnorm(h_mid))) ----
    dm = lambda: dout if p == 0 else dropout_backward(dout, take("mlp.dropout_mask"), p)  # noqa: E731 (B_r, T, h)
    h_mid, rstd2 = take("mlp_norm.input"), take("mlp_norm.rstd")  # (B_r, T, h), (B_r, T, 1)
    normed = lambda: take("mlp_norm.output", rebuild=lambda: rmsnorm_apply(h_mid, rstd2, w.mlp_norm))  # noqa: E731
    dxn2, mlp_grads = ep_moe_backward(dm, normed, w, cfg, comm, take, first_expert)  # (B_r, T, h), {role: grad}
    dh, d_mlp_norm = rmsnorm_backward(dxn2, h_mid, rstd2, w.mlp_norm)  # (B_r, T, h), (h,)
    del dxn2, h_mid, rstd2
    dh += dout  # (B_r, T, h) both paths into h_mid: the norm and the residual
    # ---- attention block: h_mid = x + dropout(o_proj(attention(q, k, v))) ----
    da = lambda: dh if p == 0 else dropout_backward(dh, take("attn.dropout_mask"), p)  # noqa: E731 (B_r, T, h)
    x, rstd = take("input"), take("attn_norm.rstd")  # (B_r, T, h), (B_r, T, 1)
    normed = lambda: take("attn_norm.output", rebuild=lambda: rmsnorm_apply(x, rstd, w.attn_norm))  # noqa: E731
    dxn, (d_q, d_k, d_v, d_o) = attention_block_backward(da, normed, w, cfg, rope, take, store.recomputing)
    dx, d_attn_norm = rmsnorm_backward(dxn, x, rstd, w.attn_norm)  # (B_r, T, h), (h,)
    del dxn, x, rstd
    dx += dh  # (B_r, T, h) the norm and the residual path into x
    grads = w._replace(attn_norm=d_attn_norm, q=d_q, k=d_k, v=d_v, o=d_o, mlp_norm=d_mlp_norm, **mlp_grads)
    return dx, grads
