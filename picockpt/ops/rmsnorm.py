"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), statistics in (at least) fp32.

The forward keeps rstd = 1/sqrt(mean(x^2) + eps), one number per token, so the
backward (and a cheap rebuild of y) never has to reduce over the hidden size again.
"""
import torch


def rmsnorm_forward(x, weight, eps, stat_dtype):
    # x (B, T, h), weight (h,)
    rstd = torch.rsqrt(x.to(stat_dtype).pow(2).mean(-1, keepdim=True) + eps)  # (B, T, 1) stat_dtype
    y = rmsnorm_apply(x, rstd, weight)  # (B, T, h)
    return y, rstd


def rmsnorm_apply(x, rstd, weight):
    # the normalisation itself, also the one-line rebuild of a dropped norm output;
    # as Hugging Face: normalise in fp32, round to the activation dtype, then scale.
    return weight * (x.to(rstd.dtype) * rstd).to(x.dtype)  # (B, T, h)


def rmsnorm_backward(dy, x, rstd, weight):
    """Forward was n = x * r, r = (mean_j x_j^2 + eps)^(-1/2), y = w * n  (per token).

    dw    = sum over tokens of dy * n
    dn    = dy * w
    dr/dx_j = -1/2 (ms + eps)^(-3/2) * 2 x_j / h = -r^3 x_j / h
    dx_j  = dn_j * r + sum_i dn_i x_i * (-r^3 x_j / h)
          = r * (dn_j - x_j * r^2 * mean_i(dn_i x_i))

    Every line runs in the statistics precision (fp32 for 16-bit activations) without an fp32 copy of x
    or dy: a 16-bit tensor times an fp32 one is widened inside the kernel (exactly: every 16-bit value is
    an fp32 value), so the only 16-bit result is dx, rounded once, by the last product's kernel.
    """
    n = x * rstd  # (B, T, h) statistics dtype: the normalised input before rounding
    dweight = (dy * n).sum(dim=(0, 1))  # (h,) in statistics precision: a sum over B*T tokens, never rounded
    # to the 16-bit compute dtype on its way to the fp32 master gradient
    dn = dy * weight.to(rstd.dtype)  # (B, T, h) statistics dtype
    mean_dn_x = (dn * x).mean(-1, keepdim=True)  # (B, T, 1) mean_i(dn_i x_i)
    inner = dn - x * rstd.pow(2) * mean_dn_x  # (B, T, h) dn_j - x_j * r^2 * mean_i(dn_i x_i)
    return torch.mul(rstd, inner, out=torch.empty_like(x)), dweight  # (B, T, h) dx = r * inner, rounded to x's dtype
