"""Cross-entropy of the next token, averaged over the counted positions, in fp32 or wider.

loss = (1/N) sum over counted n of [ logsumexp_v z[n, v] - z[n, y[n]] ]

A target equal to IGNORE_INDEX (-100, as in torch's and Hugging Face's cross-entropy) is left
out: it adds nothing to the sum, nothing to N, and gets a zero gradient. N counts the others.
The pair works on any rows of logits: all B*T at once, or one chunk of them (picockpt/model/head.py).
"""
import torch

IGNORE_INDEX = -100


def cross_entropy_forward(logits, targets, stat_dtype):
    """logits (n, V), targets (n,) int64 -> (sum of the counted rows' losses, logz (n,) in stat_dtype).
    The caller divides the sum by N; logz = logsumexp_v z[n, v] is what a chunked head keeps."""
    z = logits.to(stat_dtype)  # (n, V)
    logz = torch.logsumexp(z, dim=-1)  # (n,)
    counted = targets != IGNORE_INDEX  # (n,) bool
    picked = z.gather(-1, targets.clamp(min=0)[:, None])[:, 0]  # (n,) z[n, y[n]] (row 0 for ignored rows)
    return torch.where(counted, logz - picked, 0.0).sum(), logz  # scalar, (n,)


def cross_entropy_backward(scale, logits, targets, stat_dtype, logz=None, inplace=False):
    """Forward was loss = (1/N) sum_n [logsumexp(z_n) - z_n[y_n]] over counted rows; scale = dloss / N.

    d/dz_n[v] logsumexp(z_n) = softmax(z_n)[v] = exp(z_n[v] - logz_n);  d/dz_n[v] z_n[y_n] = 1 if v == y_n
    dz_n = scale * (softmax(z_n) - onehot(y_n)) on counted rows, 0 on ignored ones.
    With logz given (kept by the forward), softmax needs no reduction over V: one exp per element.
    inplace=True reuses the logits' own memory for dz (a caller that has no further use for them, as the
    chunked head's recomputed chunk): no second (n, V) tensor.
    """
    z = logits.to(stat_dtype)  # (n, V) the logits themselves when already in stat_dtype
    if logz is None:
        dz = torch.softmax(z, dim=-1)  # (n, V)
    else:
        dz = z.sub_(logz[:, None]).exp_() if inplace and z is logits else torch.exp(z - logz[:, None])  # (n, V)
    counted = targets != IGNORE_INDEX  # (n,) bool
    dz.scatter_add_(-1, targets.clamp(min=0)[:, None], torch.full_like(dz[:, :1], -1.0))  # (n, V) minus the one-hot
    dz.mul_(torch.where(counted, scale, 0.0)[:, None])  # (n, V) ignored rows: 0
    return dz.to(logits.dtype)  # (n, V)
