"""Inverted dropout: keep each element with probability 1-p and scale it by 1/(1-p).

The mask is drawn from torch's default generator of the tensor's device, so a caller that restores that generator's
state replays exactly the same mask: this is what recomputation relies on (picockpt/recompute/engine.py).
"""
import torch


def dropout_mask(shape, p, device):
    # a bool tensor, True where the element is kept; one byte per element
    return torch.rand(shape, device=device) >= p  # (shape) bool


def dropout_forward(x, mask, p):
    return x * mask / (1.0 - p)  # (same as x)


def dropout_backward(dy, mask, p):
    """Forward was y = x * mask / (1-p): elementwise and linear in x, so dx = dy * mask / (1-p)."""
    return dy * mask / (1.0 - p)  # (same as dy)
