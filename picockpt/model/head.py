"""The model around the layers: token embedding in, final norm + LM head + loss out.

    x0     = embed[ids]                          (B, T, h)   the input of layer 0
    logits = rmsnorm(x_L) @ lm_head.T            (B, T, V)
    loss   = mean cross-entropy(logits, targets) over the targets that are not IGNORE_INDEX

Stored at model level (layer None): final_norm.input (B,T,h), final_norm.rstd (B,T,1),
final_norm.output (B,T,h, dropped by `cheap`), and then either

    lm_head.logits (B,T,V)         Config.loss_chunk = 0: the logits, whole
    lm_head.lse    (B,T) fp32      Config.loss_chunk = n: one log-sum-exp per token. The forward
                                   computes the logits n tokens at a time and keeps none of them; the backward
                                   recomputes each chunk's logits from final_norm.output (counted as recompute), forms
                                   softmax - one-hot with the kept lse, and drops them again, as Cut Cross-Entropy does
                                   (Liger's fused linear cross-entropy is another trade: it computes the gradients chunk
                                   by chunk in the forward and keeps them; lesson 13). At a 128K vocabulary the logits
                                   are the largest activation of a step, and here they never exist whole.

The token ids and targets are the batch, owned by the caller: they are not activations.
"""
import torch

from .layer import ONE_PROCESS
from ..ops import linear_backward, linear_forward, rmsnorm_apply, rmsnorm_backward, rmsnorm_forward
from ..ops.cross_entropy import IGNORE_INDEX
from .params import FINAL_NORM, HEAD


def row_chunks(n, chunk):
    """[(start, end)] of rows 0..n-1, `chunk` at a time."""
    return [(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def head_forward(x, weights, cfg, targets, store, unstored=frozenset(), hooks=ONE_PROCESS):
    """x (B, T, h): the last layer's output -> scalar loss. hooks: where a rank's head crosses the others (layer.py's
    LayerHooks: a tensor-parallel rank's vocabulary-parallel loss, picockpt/parallel/tensor_parallel/tp_layer.py)."""
    def keep(name, tensor):
        if name not in unstored:
            store.put(None, name, tensor)

    keep("final_norm.input", x)
    xn, rstd = rmsnorm_forward(x, weights[FINAL_NORM], cfg.norm_eps, cfg.stat_dtype)  # (B, T, h), (B, T, 1)
    keep("final_norm.rstd", rstd)
    keep("final_norm.output", xn)
    xn = hooks.enter(xn)  # (B, T, h) into the vocabulary's columns (identity here)
    B, T, h = xn.shape
    rows, ys = xn.view(B * T, h), targets.reshape(B * T)  # (N, h), (N,)  N = B*T tokens
    count = (ys != IGNORE_INDEX).sum()  # () the tokens the loss averages over
    if cfg.loss_chunk == 0:
        logits = linear_forward(rows, weights[HEAD])  # (N, V)
        keep("lm_head.logits", logits.view(B, T, -1))
        total, lse = hooks.cross_entropy(logits, ys, cfg.stat_dtype)  # scalar, (N,)
        if hooks.keeps_lse:  # split columns: rebuilding it would cost collectives again
            keep("lm_head.lse", lse.view(B, T))
        return total / count
    lse = torch.empty(B * T, dtype=cfg.stat_dtype, device=x.device)  # (N,)
    total = 0.0
    for start, end in row_chunks(B * T, cfg.loss_chunk):
        logits = linear_forward(rows[start:end], weights[HEAD])  # (n, V) one chunk, dropped at once
        part, lse[start:end] = hooks.cross_entropy(logits, ys[start:end], cfg.stat_dtype)  # scalar, (n,)
        total = total + part
        del logits
    keep("lm_head.lse", lse.view(B, T))
    return total / count


def head_backward(weights, cfg, targets, store, hooks=ONE_PROCESS):
    """-> d loss / d x_L (B, T, h), and {name: gradient} for the final norm and LM head."""
    def take(name, rebuild=None):
        return store.pop(None, name, rebuild)

    x, rstd = take("final_norm.input"), take("final_norm.rstd")  # (B, T, h), (B, T, 1)
    xn = hooks.regather(take("final_norm.output", rebuild=lambda: rmsnorm_apply(x, rstd, weights[FINAL_NORM])))
    B, T, h = xn.shape  # (B, T, h)
    rows, ys, W = xn.view(B * T, h), targets.reshape(B * T), weights[HEAD]  # (N, h), (N,), (V, h)
    scale = 1.0 / (ys != IGNORE_INDEX).sum().to(cfg.stat_dtype)  # () d loss / d (sum of the token losses)
    if cfg.loss_chunk == 0:
        lse = take("lm_head.lse").view(B * T) if hooks.keeps_lse else None  # (N,), or the softmax's own sum
        logits = take("lm_head.logits").view(B * T, -1)  # (N, V)
        dlogits = hooks.cross_entropy_backward(scale, logits, ys, cfg.stat_dtype, lse)  # (N, V)
        del logits, lse
        dxn, d_head = linear_backward(dlogits, rows, W)  # (N, h), (V, h)
        del dlogits
    else:
        lse = take("lm_head.lse").view(B * T)  # (N,)
        dxn = torch.empty_like(rows)  # (N, h)
        d_head = torch.zeros(W.shape, dtype=cfg.param_dtype, device=W.device)  # (V, h) summed over chunks
        for start, end in row_chunks(B * T, cfg.loss_chunk):
            chunk = rows[start:end]  # (n, h)
            logits = store.rebuild(None, "lm_head.logits", lambda: linear_forward(chunk, W))  # (n, V) again
            dlogits = hooks.cross_entropy_backward(scale, logits, ys[start:end], cfg.stat_dtype, lse[start:end],
                                                   inplace=True)  # (n, V) in the logits' memory when it can
            del logits
            dxn[start:end] = dlogits @ W  # (n, h) dx = dy W, as linear_backward
            if d_head.dtype == dlogits.dtype:
                torch.addmm(d_head, dlogits.T, chunk, out=d_head)  # (V, h) dW += dy^T x in place: no (V, h) temporary
            else:  # mixed precision: the chunk's product in 16 bits, summed over chunks in fp32
                d_head += dlogits.T @ chunk  # (V, h)
            del dlogits
    dxn = hooks.enter_backward(dxn.view(B, T, h))  # (B, T, h) out of the vocabulary's columns (identity here)
    dx, d_norm = rmsnorm_backward(dxn, x, rstd, weights[FINAL_NORM])  # (B, T, h), (h,)
    return dx, {HEAD: d_head, FINAL_NORM: hooks.final_norm_grad(d_norm, cfg)}
