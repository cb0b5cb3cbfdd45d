"""The model around the layers: token embedding in, final norm + LM head + loss out.

    x0     = embed[ids]                          (B, T, h)   the input of layer 0
    logits = rmsnorm(x_L) @ lm_head.T            (B, T, V)
    loss   = mean cross-entropy(logits, targets)

Stored at model level (layer None): final_norm.input (B,T,h), final_norm.rstd (B,T,1),
final_norm.output (B,T,h, dropped by `cheap`), lm_head.logits (B,T,V). The token ids and
targets are the batch, owned by the caller: they are not activations.
"""
from .ops import (cross_entropy_backward, cross_entropy_forward, linear_backward, linear_forward,
                  rmsnorm_apply, rmsnorm_backward, rmsnorm_forward)
from .params import FINAL_NORM, HEAD


def head_forward(x, weights, cfg, targets, store, drop=frozenset()):
    """x (B, T, h): the last layer's output -> scalar loss."""
    def keep(name, tensor):
        if name not in drop:
            store.put(None, name, tensor)

    keep("final_norm.input", x)
    xn, rstd = rmsnorm_forward(x, weights[FINAL_NORM], cfg.norm_eps, cfg.stat_dtype)  # (B, T, h), (B, T, 1)
    keep("final_norm.rstd", rstd)
    keep("final_norm.output", xn)
    logits = linear_forward(xn, weights[HEAD])  # (B, T, V)
    keep("lm_head.logits", logits)
    return cross_entropy_forward(logits, targets, cfg.stat_dtype)  # scalar


def head_backward(weights, cfg, targets, store):
    """-> d loss / d x_L (B, T, h), and {name: gradient} for the final norm and LM head."""
    def take(name, rebuild=None):
        return store.pop(None, name, rebuild)

    dlogits = cross_entropy_backward(1.0, take("lm_head.logits"), targets, cfg.stat_dtype)  # (B, T, V)
    x, rstd = take("final_norm.input"), take("final_norm.rstd")  # (B, T, h), (B, T, 1)
    xn = take("final_norm.output", rebuild=lambda: rmsnorm_apply(x, rstd, weights[FINAL_NORM]))  # (B, T, h)
    dxn, d_head = linear_backward(dlogits, xn, weights[HEAD])  # (B, T, h), (V, h)
    dx, d_norm = rmsnorm_backward(dxn, x, rstd, weights[FINAL_NORM])  # (B, T, h), (h,)
    return dx, {HEAD: d_head, FINAL_NORM: d_norm}
