"""Cross-entropy of the next token, averaged over all B*T positions, in fp32 or wider.

loss = mean over (b, t) of [ logsumexp_v z[b, t, v] - z[b, t, target[b, t]] ]
"""
import torch


def cross_entropy_forward(logits, targets, stat_dtype):
    # logits (B, T, V), targets (B, T) int64
    z = logits.to(stat_dtype)  # (B, T, V)
    logz = torch.logsumexp(z, dim=-1)  # (B, T)
    picked = z.gather(-1, targets[..., None])[..., 0]  # (B, T)
    return (logz - picked).mean()  # scalar


def cross_entropy_backward(dloss, logits, targets, stat_dtype):
    """Forward was loss = (1/N) sum_n [logsumexp(z_n) - z_n[y_n]], N = B*T.

    d/dz_n[v] logsumexp(z_n) = softmax(z_n)[v];  d/dz_n[v] z_n[y_n] = 1 if v == y_n
    dz_n = dloss / N * (softmax(z_n) - onehot(y_n))
    """
    N = targets.numel()
    dz = torch.softmax(logits.to(stat_dtype), dim=-1)  # (B, T, V)
    dz.scatter_add_(-1, targets[..., None], torch.full_like(dz[..., :1], -1.0))  # (B, T, V) subtract the one-hot
    return (dz * (dloss / N)).to(logits.dtype)  # (B, T, V)
