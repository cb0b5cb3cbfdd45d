"""Causal grouped-query attention that materialises the (T, T) probabilities ("eager").

Shapes: q (B, H, T, hd); k, v (B, KV, T, hd); query head j reads key/value head j // G where G = H / KV (Hugging Face's
repeat_kv order). Instead of copying k and v G times, we view q as (B, KV, G*T, hd): the G query heads of one group
become G*T rows that all attend to the same keys, and one matmul does the whole group.

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
    """P = softmax(q k^T / sqrt(hd) + causal mask): also the one-line rebuild of dropped probs.
    Three passes over the T x T values: the matmul with the causal mask folded in (baddbmm adds a
    0 / -inf bias before it rounds, so the scores are bitwise the matmul's), the scale in place, and
    one softmax that reads the 16-bit scores, computes in stat_dtype (dtype=) and is rounded once.
    The scale stays a separate pass: folded into the matmul (alpha=) it would round once instead of
    twice, more exact but no longer bitwise Hugging Face's eager order (q k^T rounded, then scaled)."""
    B, H, T, hd = q.shape
    KV = k.shape[1]
    future = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)  # (T, T) -inf above the diagonal
    scores = torch.baddbmm(future.repeat(H // KV, 1), _grouped(q, KV).flatten(0, 1),  # (G*T, T) bias, (B*KV, G*T, hd)
                           k.transpose(-1, -2).flatten(0, 1))  # (B*KV, G*T, T) q k^T, future -inf
    scores = scores.view(B, H, T, T).mul_(hd ** -0.5)  # (B, H, T, T) in place: / sqrt(hd)
    return torch.softmax(scores, dim=-1, dtype=stat_dtype).to(q.dtype)  # (B, H, T, T)


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
    # softmax backward, dS = P * (dP - rowsum(dP * P)), in one pass over the T x T values: torch's fused
    # softmax-backward kernel (the one autograd calls), fed the 16-bit dP and P as they are (it accumulates
    # the row sum in fp32) and writing dS in the activation dtype: no fp32 copies of T x T tensors
    dscores = torch._softmax_backward_data(dprobs, probs, -1, q.dtype)  # (B, H, T, T)
    del ddropped, dprobs
    dscores = dscores.mul_(hd ** -0.5)  # (B, H, T, T) in place: / sqrt(hd)
    dq = (_grouped(dscores, kv_heads) @ k).view(B, H, T, hd)  # (B, H, T, hd)
    dk = _grouped(dscores, kv_heads).transpose(-1, -2) @ _grouped(q, kv_heads)  # (B, KV, T, hd)
    return dq, dk, dv
