"""Rotary position embeddings, rotate-half convention (Hugging Face Llama).

For each head vector x = [x1, x2] (two halves of head_dim/2):
    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x2, x1]
i.e. each pair (x1[i], x2[i]) is rotated by the angle pos * inv_freq[i].
"""
import math

import torch


def rope_tables(cfg, seq, device, dtype):
    """cos and sin of shape (T, hd), computed in fp32 as Hugging Face does, then cast."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if cfg.rope_scaling is not None:  # Llama 3.1 "llama3" long-context frequency scaling
        inv_freq = _llama3_scaling(inv_freq, cfg.rope_scaling)
    positions = torch.arange(seq, device=device).float()  # (T,)
    freqs = positions[:, None] * inv_freq[None, :]  # (T, hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)  # (T, hd), (T, hd)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)  # (..., hd/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., hd)


def rope_forward(x, cos, sin):
    # x (B, T, heads, hd); cos, sin (T, hd) broadcast over batch and heads
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd)
    return x * cos + rotate_half(x) * sin  # (B, T, heads, hd)


def rope_backward(dy, cos, sin):
    """Forward, per pair i: y1 = x1 c - x2 s,  y2 = x2 c + x1 s  (a rotation).

    dx1 = dy1 c + dy2 s,   dx2 = dy2 c - dy1 s   (the inverse rotation), i.e.
    dx  = dy * cos + [ (dy*sin)2, -(dy*sin)1 ]  = dy * cos - rotate_half(dy * sin)

    Computed as the first form, half by half in place: dy * cos, dy * sin, then each half of dx adds or
    subtracts the other half of dy * sin (no negated copy, no concatenation: three passes where the
    rotate_half line takes five). The same roundings as that line, so the same bits. dx comes back
    contiguous, so the layer's reshape of it to (B, T, heads*hd) is a view, not a copy.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd)
    dx = torch.mul(dy, cos, out=dy.new_empty(dy.shape))  # (B, T, heads, hd) dy * cos, contiguous
    dx1, dx2 = dx.chunk(2, dim=-1)  # (B, T, heads, hd/2) each: views into dx
    dy_sin1, dy_sin2 = (dy * sin).chunk(2, dim=-1)  # (B, T, heads, hd/2) each
    dx1.add_(dy_sin2)  # dx1 = dy1 c + dy2 s
    dx2.sub_(dy_sin1)  # dx2 = dy2 c - dy1 s
    return dx  # (B, T, heads, hd)


def _llama3_scaling(inv_freq, scaling):
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # (hd/2,)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)  # long waves slowed down
    smooth = (old_len / wavelen - low) / (high - low)  # (hd/2,) in [0, 1] for the medium band
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)  # (hd/2,)
