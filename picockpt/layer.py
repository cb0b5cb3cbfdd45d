"""One Llama decoder layer: its forward, which keeps tensors in the store, and its
hand-written backward, which takes them out again (or rebuilds the dropped ones).

    h   = x + dropout(o_proj(attention(rope(q), rope(k), v)))   q, k, v = projections of rmsnorm(x)
    out = h + dropout(down_proj(silu(gate) * up))                gate, up = projections of rmsnorm(h)

What one layer stores, by name (B batch, T sequence, h hidden, H heads, KV kv heads,
hd head_dim, f ffn, e bytes per activation element, s bytes per statistic):

    name                 shape            bytes        dropped by
    input                (B, T, h)        BTh e        (the layer input: the checkpoint)
    attn_norm.rstd       (B, T, 1)        BT s
    attn_norm.output     (B, T, h)        BTh e        cheap
    attn.q               (B, H, T, hd)    BTh e
    attn.k               (B, KV, T, hd)   BT KV hd e
    attn.v               (B, KV, T, hd)   BT KV hd e
    attn.probs           (B, H, T, T)     BHT^2 e      selective, cheap
    attn.context         (B, T, h)        BTh e
    mlp_norm.input       (B, T, h)        BTh e        (the residual stream after attention)
    mlp_norm.rstd        (B, T, 1)        BT s
    mlp_norm.output      (B, T, h)        BTh e        cheap
    mlp.gate             (B, T, f)        BTf e
    mlp.up               (B, T, f)        BTf e
    mlp.act              (B, T, f)        BTf e        cheap
  with dropout p > 0, also:
    attn.probs_mask      (B, H, T, T)     BHT^2        (bool)
    attn.probs_dropped   (B, H, T, T)     BHT^2 e      selective, cheap
    attn.dropout_mask    (B, T, h)        BTh          (bool)
    mlp.dropout_mask     (B, T, h)        BTh          (bool)

picockpt/inventory.py computes the same table in closed form.
"""
from .ops import (attention_backward, attention_forward, attention_probs, dropout_backward, dropout_forward,
                  dropout_mask, linear_backward, linear_forward, rmsnorm_apply, rmsnorm_backward,
                  rmsnorm_forward, rope_backward, rope_forward, swiglu_backward, swiglu_forward)
from .params import LayerWeights


def layer_forward(x, w, cfg, rope, store=None, i=None, drop=frozenset(), need_output=True):
    """x (B, T, h) -> out (B, T, h). Keeps its tensors in `store` under layer i, except
    the names in `drop`; with store=None keeps nothing (it only carries x forward).
    The layer input itself is stored by the engine, which decides the checkpoints.
    need_output=False stops once the last tensor the backward needs is kept (returns None):
    the down projection and the residual add are skipped."""
    def keep(name, tensor):
        if store is not None and name not in drop:
            store.put(i, name, tensor)

    B, T, h = x.shape
    H, KV, hd, p, stat = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dropout, cfg.stat_dtype
    cos, sin = rope  # (T, hd) each
    # ---- attention block ----
    xn, rstd = rmsnorm_forward(x, w.attn_norm, cfg.norm_eps, stat)  # (B, T, h), (B, T, 1)
    keep("attn_norm.rstd", rstd)
    keep("attn_norm.output", xn)
    q = rope_forward(linear_forward(xn, w.q).view(B, T, H, hd), cos, sin)  # (B, T, H, hd)
    k = rope_forward(linear_forward(xn, w.k).view(B, T, KV, hd), cos, sin)  # (B, T, KV, hd)
    v = linear_forward(xn, w.v).view(B, T, KV, hd)  # (B, T, KV, hd)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # (B, H, T, hd), (B, KV, T, hd) x2
    keep("attn.q", q)
    keep("attn.k", k)
    keep("attn.v", v)
    mask = dropout_mask((B, H, T, T), p, x.device) if p > 0 else None  # (B, H, T, T) bool
    out, probs, dropped = attention_forward(q, k, v, stat, mask, p)  # (B, H, T, hd), (B, H, T, T) x2
    keep("attn.probs", probs)
    if mask is not None:
        keep("attn.probs_mask", mask)
        keep("attn.probs_dropped", dropped)
    context = out.transpose(1, 2).reshape(B, T, h)  # (B, T, h) heads side by side again
    keep("attn.context", context)
    a = linear_forward(context, w.o)  # (B, T, h)
    if p > 0:
        mask = dropout_mask((B, T, h), p, x.device)  # (B, T, h) bool
        keep("attn.dropout_mask", mask)
        a = dropout_forward(a, mask, p)  # (B, T, h)
    h_mid = x + a  # (B, T, h) residual stream after attention
    keep("mlp_norm.input", h_mid)
    # ---- MLP block ----
    xn2, rstd2 = rmsnorm_forward(h_mid, w.mlp_norm, cfg.norm_eps, stat)  # (B, T, h), (B, T, 1)
    keep("mlp_norm.rstd", rstd2)
    keep("mlp_norm.output", xn2)
    gate = linear_forward(xn2, w.gate)  # (B, T, f)
    up = linear_forward(xn2, w.up)  # (B, T, f)
    keep("mlp.gate", gate)
    keep("mlp.up", up)
    act = swiglu_forward(gate, up)  # (B, T, f)
    keep("mlp.act", act)
    if not need_output:
        if p > 0:  # the same draw as below, so the RNG and the mask are as in the first forward
            keep("mlp.dropout_mask", dropout_mask((B, T, h), p, x.device))  # (B, T, h) bool
        return None
    m = linear_forward(act, w.down)  # (B, T, h)
    if p > 0:
        mask = dropout_mask((B, T, h), p, x.device)  # (B, T, h) bool
        keep("mlp.dropout_mask", mask)
        m = dropout_forward(m, mask, p)  # (B, T, h)
    return h_mid + m  # (B, T, h)


def layer_backward(dout, w, cfg, rope, store, i):
    """dout (B, T, h) -> dx (B, T, h) and the LayerWeights of weight gradients.
    Takes (pops) layer i's tensors out of the store as it last uses them; a dropped
    one is rebuilt by the one-line recipe beside it, from tensors it already has.
    `del` marks each tensor's last use: a local name would otherwise keep it alive to
    the end of the function, after the store has let go of it."""
    def take(name, rebuild=None):
        return store.pop(i, name, rebuild)

    B, T, h = dout.shape
    H, KV, hd, p, stat = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dropout, cfg.stat_dtype
    cos, sin = rope  # (T, hd) each
    # ---- MLP block: out = h_mid + dropout(down(silu(gate) * up)) ----
    dm = dout if p == 0 else dropout_backward(dout, take("mlp.dropout_mask"), p)  # (B, T, h)
    gate, up = take("mlp.gate"), take("mlp.up")  # (B, T, f) each
    act = take("mlp.act", rebuild=lambda: swiglu_forward(gate, up))  # (B, T, f)
    dact, d_down = linear_backward(dm, act, w.down)  # (B, T, f), (h, f)
    del dm, act
    dgate, dup = swiglu_backward(dact, gate, up)  # (B, T, f) each
    del dact, gate, up
    h_mid, rstd2 = take("mlp_norm.input"), take("mlp_norm.rstd")  # (B, T, h), (B, T, 1)
    xn2 = take("mlp_norm.output", rebuild=lambda: rmsnorm_apply(h_mid, rstd2, w.mlp_norm))  # (B, T, h)
    dxn2, d_gate = linear_backward(dgate, xn2, w.gate)  # (B, T, h), (f, h)
    del dgate
    dxn2_up, d_up = linear_backward(dup, xn2, w.up)  # (B, T, h), (f, h)
    del dup, xn2
    dxn2 += dxn2_up  # (B, T, h) xn2 feeds both projections: their gradients add
    del dxn2_up
    dh, d_mlp_norm = rmsnorm_backward(dxn2, h_mid, rstd2, w.mlp_norm)  # (B, T, h), (h,)
    del dxn2, h_mid, rstd2
    dh += dout  # (B, T, h) both paths into h_mid: the norm and the residual
    # ---- attention block: h_mid = x + dropout(o_proj(context)) ----
    da = dh if p == 0 else dropout_backward(dh, take("attn.dropout_mask"), p)  # (B, T, h)
    dcontext, d_o = linear_backward(da, take("attn.context"), w.o)  # (B, T, h), (h, h)
    del da
    dout_heads = dcontext.view(B, T, H, hd).transpose(1, 2).contiguous()  # (B, H, T, hd)
    del dcontext
    q, k, v = take("attn.q"), take("attn.k"), take("attn.v")  # (B, H, T, hd), (B, KV, T, hd) x2
    probs = take("attn.probs", rebuild=lambda: attention_probs(q, k, stat))  # (B, H, T, T)
    mask, dropped = None, probs
    if p > 0:
        mask = take("attn.probs_mask")  # (B, H, T, T) bool
        dropped = take("attn.probs_dropped", rebuild=lambda: dropout_forward(probs, mask, p))  # (B, H, T, T)
    dq, dk, dv = attention_backward(dout_heads, q, k, v, probs, dropped, stat, mask, p)
    del dout_heads, q, k, v, probs, dropped, mask
    dq = rope_backward(dq.transpose(1, 2), cos, sin).reshape(B, T, H * hd)  # (B, T, h)
    dk = rope_backward(dk.transpose(1, 2), cos, sin).reshape(B, T, KV * hd)  # (B, T, KV*hd)
    dv = dv.transpose(1, 2).reshape(B, T, KV * hd)  # (B, T, KV*hd)
    x, rstd = take("input"), take("attn_norm.rstd")  # (B, T, h), (B, T, 1)
    xn = take("attn_norm.output", rebuild=lambda: rmsnorm_apply(x, rstd, w.attn_norm))  # (B, T, h)
    dxn, d_q = linear_backward(dq, xn, w.q)  # (B, T, h), (h, h)
    del dq
    dxn_k, d_k = linear_backward(dk, xn, w.k)  # (B, T, h), (KV*hd, h)
    del dk
    dxn += dxn_k  # (B, T, h) xn feeds q, k and v: their gradients add
    del dxn_k
    dxn_v, d_v = linear_backward(dv, xn, w.v)  # (B, T, h), (KV*hd, h)
    del dv, xn
    dxn += dxn_v  # (B, T, h)
    del dxn_v
    dx, d_attn_norm = rmsnorm_backward(dxn, x, rstd, w.attn_norm)  # (B, T, h), (h,)
    del dxn, x, rstd
    dx += dh  # (B, T, h) the norm and the residual path into x
    grads = LayerWeights(attn_norm=d_attn_norm, q=d_q, k=d_k, v=d_v, o=d_o,
                         mlp_norm=d_mlp_norm, gate=d_gate, up=d_up, down=d_down)
    return dx, grads
