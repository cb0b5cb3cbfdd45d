"""One Llama decoder layer: its forward, which keeps tensors in the store, and its hand-written backward, which
takes them out again (or rebuilds the dropped ones).

    h   = x + dropout(o_proj(attention(rope(q), rope(k), v)))   q, k, v = projections of rmsnorm(x)
    out = h + dropout(down_proj(silu(gate) * up))                gate, up = projections of rmsnorm(h)

What one layer stores, by name (B batch, T sequence, h hidden, H heads, KV kv heads, hd head_dim, f ffn, e bytes
per activation element, s bytes per statistic):

    name                 shape            bytes        dropped by
    input                (B, T, h)        BTh e        (the layer input: the checkpoint)
    attn_norm.rstd       (B, T, 1)        BT s
    attn_norm.output     (B, T, h)        BTh e        cheap
    attn.q               (B, H, T, hd)    BTh e
    attn.k               (B, KV, T, hd)   BT KV hd e
    attn.v               (B, KV, T, hd)   BT KV hd e
    attn.probs           (B, H, T, T)     BHT^2 e      selective, cheap   (eager attention only)
    attn.lse             (B, H, T)        BHT s                           (tiled, fused: instead of probs)
    attn.context         (B, T, h)        BTh e        (also the attention output tiled/fused read back)
    mlp_norm.input       (B, T, h)        BTh e        (the residual stream after attention)
    mlp_norm.rstd        (B, T, 1)        BT s
    mlp_norm.output      (B, T, h)        BTh e        cheap
    mlp.gate             (B, T, f)        BTf e
    mlp.up               (B, T, f)        BTf e
    mlp.act              (B, T, f)        BTf e        cheap
  with dropout p > 0, also:
    attn.probs_mask      (B, H, T, T)     BHT^2        (bool; eager)
    attn.probs_dropped   (B, H, T, T)     BHT^2 e      selective, cheap (eager)
    attn.dropout_seed    ()               8            (int64; tiled: every tile's mask comes from it)
    attn.dropout_mask    (B, T, h)        BTh          (bool)
    mlp.dropout_mask     (B, T, h)        BTh          (bool)

The attention core (picockpt/model/attention.py) keeps what its kind (Config.attention) needs: eager the
probabilities, tiled and fused one log-sum-exp per row, recomputing the probabilities tile by tile in the backward
(FlashAttention: selective recomputation inside the op). With Config.experts > 0 a mixture of experts
(picockpt/model/moe.py) takes the MLP's place, and keeps moe.* tensors instead of mlp.gate, mlp.up, mlp.act (one
set per expert: moe.act[3] is expert 3's). picockpt/planning/step_forms.py computes the same table in closed form.
"""
import contextlib

from .attention import attention_core_backward, attention_core_forward
from ..ops import (cross_entropy_backward, cross_entropy_forward, dropout_backward, dropout_forward, dropout_mask,
                  linear_backward, linear_forward, rmsnorm_apply, rmsnorm_backward, rmsnorm_forward, rope_backward,
                  rope_forward, swiglu_backward, swiglu_forward)
from .moe import moe_block_backward, moe_block_forward
from .block_tail import RUN_TAIL


class LayerHooks:
    """The layer's hooks: the named points where a layer split over ranks talks to the other ranks; in one process
    every one is the identity (or the plain draw, or the plain MLP). A tensor-parallel rank's collectives go here
    (picockpt/parallel/tensor_parallel/tp_layer.py), as do an expert-parallel rank's experts and its whole-batch
    draws (picockpt/parallel/expert_parallel/ep_layer.py): the layer is written once.

        enter(xn) / enter_backward(dxn)   into a block's projections: identity | all-reduce (TP), all-gather |
                                          reduce-scatter (SP)
        leave(y) / leave_backward(dy)     out of a block's last projection: identity | the reverse pair
        regather(xn)                      a kept block input, back to the block's tokens (SP: all-gather)
        branch_mask(shape, p, device)     a residual branch's dropout mask (split ranks: their slice of the
                                          single process's)
        layer_draws(), attention_draws()  contexts around random draws (the whole tensor drawn, a slice kept)
        mlp_forward / mlp_backward        the MLP block, or the mixture of experts (moe.py, or over ranks),
                                          its tail run or skipped as the layer's tail says (block_tail.py)
        norm_grads(d_attn, d_mlp, cfg)    the norm weights' gradients (SP: summed over the ranks' tokens)
        attention_core / _backward        the attention core (picockpt/model/attention.py), or attention over ranks
                                          that hold the sequence's other tokens (context parallel: a ring)
    and the head's (picockpt/model/head.py), around the same enter / enter_backward / regather:
        cross_entropy / _backward         the loss over the vocabulary, or over its columns split over ranks
                                          (tensor parallel: the row statistics all-reduced); keeps_lse: the
                                          head keeps each row's log-sum-exp for its backward even unchunked
        final_norm_grad(d, cfg)           the final norm's gradient (SP: summed over the ranks' tokens)
    """
    keeps_lse = False

    def plain_draws(self):  # in one process a random draw is the plain draw: nothing around it
        return contextlib.nullcontext()

    def identity(self, x):  # in one process a tensor passes every named point unchanged
        return x

    layer_draws = attention_draws = plain_draws
    enter = enter_backward = leave = leave_backward = regather = identity
    # and in one process the plain functions themselves:
    branch_mask = staticmethod(dropout_mask)  # (shape) bool
    attention_core = staticmethod(attention_core_forward)  # (B, H, T, hd) keeps what its kind needs
    attention_core_backward = staticmethod(attention_core_backward)  # dq, dk, dv as q, k, v
    cross_entropy = staticmethod(cross_entropy_forward)  # (sum of the counted rows' losses, lse (n,))
    cross_entropy_backward = staticmethod(cross_entropy_backward)  # (n, V)

    def mlp_forward(self, xn2, w, cfg, keep, tail):
        if cfg.experts:  # a mixture of experts in the MLP's place (picockpt/model/moe.py)
            return moe_block_forward(xn2, w, cfg, keep, tail)  # (B, T, h), or None: its tail skipped
        return mlp_block_forward(xn2, w, keep, tail)  # (B, T, h), or None: its tail skipped

    def mlp_backward(self, grad, normed, w, cfg, take):  # -> dxn2 (B, T, h), {role: gradient}
        if cfg.experts:  # the router's and experts' gradients, by role (picockpt/model/moe.py)
            return moe_block_backward(grad, normed, w, cfg, take)
        return mlp_block_backward(grad, normed, w, take)

    def norm_grads(self, d_attn_norm, d_mlp_norm, cfg):
        return d_attn_norm, d_mlp_norm

    def final_norm_grad(self, d_norm, cfg):
        return d_norm


ONE_PROCESS = LayerHooks()


def layer_forward(x, w, cfg, rope, store=None, i=None, unstored=frozenset(), tail=RUN_TAIL, hooks=ONE_PROCESS):
    """x (B, T, h) -> out (B, T, h). Keeps its tensors in `store` under layer i, except the names in `unstored`; with
    store=None keeps nothing (it only carries x forward). The layer input itself is stored by the engine, which decides
    the checkpoints, and the tail (picockpt/model/block_tail.py): SKIP_TAIL stops once the last tensor the backward
    needs is kept (returns None): the MLP block's down projection(s), its dropout and the residual add are skipped, its
    mask still drawn. hooks: where a rank of a parallel layout crosses to the others (LayerHooks above; the identity in
    one process)."""
    def keep(name, tensor):  # an expert's tensor, "moe.act[3]", is dropped with its kind, "moe.act"
        if store is not None and name.partition("[")[0] not in unstored:
            store.put(i, name, tensor)

    p, stat = cfg.dropout, cfg.stat_dtype
    with hooks.layer_draws():
        # ---- attention block: h_mid = x + dropout(o_proj(attention(q, k, v))), q, k, v of rmsnorm(x) ----
        xn, rstd = rmsnorm_forward(x, w.attn_norm, cfg.norm_eps, stat)  # (B, T, h), (B, T, 1)
        keep("attn_norm.rstd", rstd)
        keep("attn_norm.output", xn)
        xn = hooks.enter(xn)  # (B, T, h) entering the heads' region (identity here)
        with hooks.attention_draws():
            a = attention_block_forward(xn, w, cfg, rope, keep, hooks)  # (B, T, h)
        del xn
        a = hooks.leave(a)  # (B, T, h) leaving it (identity here)
        if p > 0:
            mask = hooks.branch_mask(x.shape, p, x.device)  # (B, T, h) bool
            keep("attn.dropout_mask", mask)
            a = dropout_forward(a, mask, p)  # (B, T, h)
        h_mid = x + a  # (B, T, h) residual stream after attention
        del a
        keep("mlp_norm.input", h_mid)
        # ---- MLP block: out = h_mid + dropout(down(silu(gate) * up)), gate, up of rmsnorm(h_mid) ----
        xn2, rstd2 = rmsnorm_forward(h_mid, w.mlp_norm, cfg.norm_eps, stat)  # (B, T, h), (B, T, 1)
        keep("mlp_norm.rstd", rstd2)
        keep("mlp_norm.output", xn2)
        xn2 = hooks.enter(xn2)  # (B, T, h)
        m = hooks.mlp_forward(xn2, w, cfg, keep, tail)  # (B, T, h), or None: its tail skipped
        del xn2
        m = tail(hooks.leave, m)  # (B, T, h)
        if p > 0:  # drawn with the tail skipped too: the RNG and the mask are as in the first forward
            mask = hooks.branch_mask(h_mid.shape, p, x.device)  # (B, T, h) bool
            keep("mlp.dropout_mask", mask)
            m = tail(dropout_forward, m, mask, p)  # (B, T, h)
    return tail(lambda: h_mid + m)  # (B, T, h)


def layer_backward(dout, w, cfg, rope, store, i, hooks=ONE_PROCESS):
    """dout (B, T, h) -> dx (B, T, h) and the weight gradients, by role (the same namedtuple as w). Takes (pops) layer
    i's tensors out of the store as it last uses them; a dropped one is rebuilt by the one-line recipe beside it, from
    tensors it already has. `del` marks each tensor's last use: a local name would otherwise keep it alive to the end of
    the function, after the store has let go of it. Each block is leave(block(enter(norm(x)))), so its backward is
    enter_backward(block_backward(leave_backward(d)))."""
    def take(name, rebuild=None):
        return store.pop(i, name, rebuild)

    p = cfg.dropout
    # ---- MLP block: out = h_mid + dropout(down(silu(gate) * up)) ----
    # the block's incoming gradient and its input come as one-line recipes, run where the block first
    # needs them, so that it holds each only from its first use to its last
    def dm():  # (B, T, h) the gradient of the block's output
        return hooks.leave_backward(dout if p == 0 else dropout_backward(dout, take("mlp.dropout_mask"), p))

    h_mid, rstd2 = take("mlp_norm.input"), take("mlp_norm.rstd")  # (B, T, h), (B, T, 1)

    def normed():  # (B, T, h) the block's input: kept, or rebuilt from h_mid and its rstd
        return hooks.regather(take("mlp_norm.output", rebuild=lambda: rmsnorm_apply(h_mid, rstd2, w.mlp_norm)))

    dxn2, mlp_grads = hooks.mlp_backward(dm, normed, w, cfg, take)  # (B, T, h), {role: gradient}
    dxn2 = hooks.enter_backward(dxn2)  # (B, T, h)
    dh, d_mlp_norm = rmsnorm_backward(dxn2, h_mid, rstd2, w.mlp_norm)  # (B, T, h), (h,)
    del dxn2, h_mid, rstd2
    dh += dout  # (B, T, h) both paths into h_mid: the norm and the residual
    # ---- attention block: h_mid = x + dropout(o_proj(attention(q, k, v))) ----
    def da():  # (B, T, h)
        return hooks.leave_backward(dh if p == 0 else dropout_backward(dh, take("attn.dropout_mask"), p))

    x, rstd = take("input"), take("attn_norm.rstd")  # (B, T, h), (B, T, 1)

    def normed_x():  # (B, T, h)
        return hooks.regather(take("attn_norm.output", rebuild=lambda: rmsnorm_apply(x, rstd, w.attn_norm)))

    dxn, (d_q, d_k, d_v, d_o) = attention_block_backward(da, normed_x, w, cfg, rope, take, store.recomputing, hooks)
    dxn = hooks.enter_backward(dxn)  # (B, T, h)
    dx, d_attn_norm = rmsnorm_backward(dxn, x, rstd, w.attn_norm)  # (B, T, h), (h,)
    del dxn, x, rstd
    dx += dh  # (B, T, h) the norm and the residual path into x
    d_attn_norm, d_mlp_norm = hooks.norm_grads(d_attn_norm, d_mlp_norm, cfg)
    grads = w._replace(attn_norm=d_attn_norm, q=d_q, k=d_k, v=d_v, o=d_o, mlp_norm=d_mlp_norm, **mlp_grads)
    return dx, grads


# ---- the two blocks, between a norm and the residual add ------------------------------------------
# Head counts come from the weights (H = rows of q_proj / head_dim), so the same blocks run on a
# tensor-parallel rank's share of the heads and of the MLP (picockpt/parallel/).

def attention_block_forward(xn, w, cfg, rope, keep, hooks=ONE_PROCESS):
    """xn (B, T, h) the normed input -> o_proj(attention(rope(q), rope(k), v)) (B, T, h)."""
    B, T, _ = xn.shape
    hd = cfg.head_dim
    H, KV = w.q.shape[0] // hd, w.k.shape[0] // hd  # query and key/value heads held here
    cos, sin = rope  # (T, hd) each
    q = rope_forward(linear_forward(xn, w.q).view(B, T, H, hd), cos, sin)  # (B, T, H, hd)
    k = rope_forward(linear_forward(xn, w.k).view(B, T, KV, hd), cos, sin)  # (B, T, KV, hd)
    v = linear_forward(xn, w.v).view(B, T, KV, hd)  # (B, T, KV, hd)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, H, T, hd), (B, KV, T, hd) x2
    keep("attn.q", q)
    keep("attn.k", k)
    keep("attn.v", v)
    out = hooks.attention_core(q, k, v, cfg, keep)  # (B, H, T, hd) keeps what its kind needs (attention.py)
    context = out.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, h) heads side by side again (fused: a view)
    del out
    keep("attn.context", context)
    return linear_forward(context, w.o)  # (B, T, h)


def attention_block_backward(grad, normed, w, cfg, rope, take, recomputing, hooks=ONE_PROCESS):
    """grad() -> da (B, T, h), the gradient of the block's output; returns dxn (B, T, h) and (d_q, d_k,
    d_v, d_o). normed() gives xn, the block's input, when the projections need it (the layer takes it
    from the store, or rebuilds it)."""
    hd = cfg.head_dim
    H, KV = w.q.shape[0] // hd, w.k.shape[0] // hd
    cos, sin = rope  # (T, hd) each
    context = take("attn.context")  # (B, T, h)
    B, T, _ = context.shape
    dcontext, d_o = linear_backward(grad(), context, w.o)  # (B, T, h), (h, h)
    # tiled and fused read the output O in the backward (D = rowsum(dO * O)); eager does not
    out = context.view(B, T, H, hd).transpose(1, 2) if cfg.attention != "eager" else None  # (B, H, T, hd) a view
    del context
    dout_heads = dcontext.view(B, T, H, hd).transpose(1, 2).contiguous()  # (B, H, T, hd)
    del dcontext
    q, k, v = take("attn.q"), take("attn.k"), take("attn.v")  # (B, H, T, hd), (B, KV, T, hd) x2
    dq, dk, dv = hooks.attention_core_backward(dout_heads, q, k, v, out, cfg, take, recomputing)  # as q, k, v
    del dout_heads, q, k, v, out
    dq = rope_backward(dq.transpose(1, 2), cos, sin).reshape(B, T, H * hd)  # (B, T, h)
    dk = rope_backward(dk.transpose(1, 2), cos, sin).reshape(B, T, KV * hd)  # (B, T, KV*hd)
    dv = dv.transpose(1, 2).reshape(B, T, KV * hd)  # (B, T, KV*hd)
    xn = normed()  # (B, T, h)
    dxn, d_q = linear_backward(dq, xn, w.q)  # (B, T, h), (h, h)
    del dq
    dxn_k, d_k = linear_backward(dk, xn, w.k)  # (B, T, h), (KV*hd, h)
    del dk
    dxn += dxn_k  # (B, T, h) xn feeds q, k and v: their gradients add
    del dxn_k
    dxn_v, d_v = linear_backward(dv, xn, w.v)  # (B, T, h), (KV*hd, h)
    del dv, xn
    dxn += dxn_v  # (B, T, h)
    return dxn, (d_q, d_k, d_v, d_o)


def mlp_block_forward(xn2, w, keep, tail=RUN_TAIL):
    """xn2 (B, T, h) the normed input -> down(silu(gate) * up) (B, T, h); its tail is the down projection:
    with SKIP_TAIL it stops after the product (the last tensor the backward needs) and returns None."""
    gate = linear_forward(xn2, w.gate)  # (B, T, f)
    up = linear_forward(xn2, w.up)  # (B, T, f)
    keep("mlp.gate", gate)
    keep("mlp.up", up)
    act = swiglu_forward(gate, up)  # (B, T, f)
    keep("mlp.act", act)
    return tail(linear_forward, act, w.down)  # (B, T, h)


def mlp_block_backward(grad, normed, w, take):
    """grad() -> dm (B, T, h), the gradient of the block's output; returns dxn2 (B, T, h) and
    {role: gradient} of gate, up and down. normed() gives xn2 when the projections need it."""
    gate, up = take("mlp.gate"), take("mlp.up")  # (B, T, f) each
    act = take("mlp.act", rebuild=lambda: swiglu_forward(gate, up))  # (B, T, f)
    dact, d_down = linear_backward(grad(), act, w.down)  # (B, T, f), (h, f)
    del act
    dgate, dup = swiglu_backward(dact, gate, up)  # (B, T, f) each
    del dact, gate, up
    xn2 = normed()  # (B, T, h)
    dxn2, d_gate = linear_backward(dgate, xn2, w.gate)  # (B, T, h), (f, h)
    del dgate
    dxn2_up, d_up = linear_backward(dup, xn2, w.up)  # (B, T, h), (f, h)
    del dup, xn2
    dxn2 += dxn2_up  # (B, T, h) xn2 feeds both projections: their gradients add
    return dxn2, dict(gate=d_gate, up=d_up, down=d_down)
