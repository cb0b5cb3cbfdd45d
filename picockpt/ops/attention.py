"""Causal grouped-query attention that materialises the (T, T) probabilities ("eager").

Shapes: q (B, H, T, hd); k, v (B, KV, T, hd); query head j reads key/value head
j // G where G = H / KV (Hugging Face's repeat_kv order). Instead of copying k and
v G times, we view q as (B, KV, G*T, hd): the G query heads of one group become
G*T rows that all attend to the same keys, and one matmul does the whole group.

Forward:  S = q k^T / sqrt(hd) (causal: S[i, j] = -inf for j > i)
          P = softmax(S)                      (in fp32, then rounded to the activation dtype)
          D = P * M / (1 - p)                 (dropout on the probabilities; D = P when p = 0)
          O = D v
The probabilities P are the s^2 tensor selective recomputation drops.
"""
import torch

from .dropout import dropout_backward, dropout_forward


def _grouped(x, kv_heads):
    # (B, H, T, n) -> (B, KV, G*T, n): a free view, the G heads of a group stacked as rows
    B, H, T, n = x.shape
    return x.view(B, kv_heads, (H // kv_heads) * T, n)


def attention_probs(q, k, stat_dtype):
    """P = softmax(q k^T / sqrt(hd) + causal mask): also the one-line rebuild of dropped probs."""
    B, H, T, hd = q.shape
    scores = _grouped(q, k.shape[1]) @ k.transpose(-1, -2)  # (B, KV, G*T, T)
    scores = scores.view(B, H, T, T) * hd ** -0.5  # (B, H, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # (T, T) True above the diagonal
    scores = scores.masked_fill(future, float("-inf"))  # (B, H, T, T)
    return torch.softmax(scores.to(stat_dtype), dim=-1).to(q.dtype)  # (B, H, T, T)


def attention_forward(q, k, v, stat_dtype, mask=None, p=0.0):
    # q (B, H, T, hd), k/v (B, KV, T, hd); mask (B, H, T, T) bool or None
    probs = attention_probs(q, k, stat_dtype)  # (B, H, T, T)
    dropped = probs if mask is None else dropout_forward(probs, mask, p)  # (B, H, T, T)
    out = (_grouped(dropped, k.shape[1]) @ v).view(q.shape)  # (B, H, T, hd)
    return out, probs, dropped


def attention_backward(dout, q, k, v, probs, dropped, stat_dtype, mask=None, p=0.0):
    """Gradients of O = D v, D = dropout(P), P = softmax(S), S = q k^T / sqrt(hd).

    dD = dO v^T                        dv = D^T dO   (summed over the G heads of a group)
    dP = dD * M / (1 - p)              (dropout backward; dP = dD when p = 0)
    dS = P * (dP - rowsum(dP * P))     (softmax backward: dS_ij = P_ij (dP_ij - sum_k dP_ik P_ik))
    dq = dS k / sqrt(hd)               dk = dS^T q / sqrt(hd)   (summed over the group)
    Masked (future) entries have P = 0, so dS is 0 there: no mask needed in the backward.
    """
    B, H, T, hd = q.shape
    kv_heads = k.shape[1]
    ddropped = (_grouped(dout, kv_heads) @ v.transpose(-1, -2)).view(B, H, T, T)  # (B, H, T, T)
    dv = _grouped(dropped, kv_heads).transpose(-1, -2) @ _grouped(dout, kv_heads)  # (B, KV, T, hd)
    dprobs = ddropped if mask is None else dropout_backward(ddropped, mask, p)  # (B, H, T, T)
    # softmax backward, dS = P * (dP - rowsum(dP * P)), in statistics precision and in one pass over the
    # T x T values: torch's fused softmax-backward kernel (the one autograd calls) instead of four passes
    dscores = torch._softmax_backward_data(dprobs.to(stat_dtype), probs.to(stat_dtype), -1, stat_dtype)  # (B, H, T, T)
    del ddropped, dprobs
    dscores = dscores.to(q.dtype).mul_(hd ** -0.5)  # (B, H, T, T) in place when no cast: / sqrt(hd)
    dq = (_grouped(dscores, kv_heads) @ k).view(B, H, T, hd)  # (B, H, T, hd)
    dk = _grouped(dscores, kv_heads).transpose(-1, -2) @ _grouped(q, kv_heads)  # (B, KV, T, hd)
    return dq, dk, dv
