"""Dropout masks under tensor and sequence parallelism, equal to the single process's.

A rank applies dropout to its share of a tensor (its heads of the attention probabilities, (B, H/t, T, T); under
sequence parallelism its tokens of a residual branch), but draws the *whole* mask the single process draws and keeps
its slice. Every rank starts from the caller's generator state, so its generator advances as the single process's:
the next mask, and every mask a recomputation draws again after the engine's RNG replay, are equal.

    mask = sliced_mask((B, T, h), p, device, comm, dim=1)   # this rank's tokens of the whole mask
    with full_size_draws(comm, dim=1, dropout=p):           # around code that draws its own masks
        a = attention_block_forward(...)                    # eager attention: (B, H/t, T, T) kept of (B, H, T, T)

The price: each rank draws t times the random numbers it keeps. Megatron-LM instead forks to a generator seeded per
rank (CudaRNGStatesTracker), so each draws only its slice: cheaper, as good statistically, but its gradients cannot
equal a single process's; here equality is the point (every test compares the two).
"""
import collections
import contextlib

import torch
from torch.overrides import TorchFunctionMode

from ..ops import dropout_mask


def sliced_mask(shape, p, device, comm, dim=None):
    """The single process's dropout mask of `shape` (True: kept), drawn whole; this rank's 1/t slice along dim, a
    tensor of its own (a view would keep the whole mask's storage alive and stored). dim=None: the whole mask."""
    mask = dropout_mask(shape, p, device)  # (shape) bool: the very draw of the single process
    if dim is None:
        return mask
    size = shape[dim] // comm.world_size
    return mask.narrow(dim, comm.rank * size, size).clone()  # (.., shape[dim]/t, ..) bool, compact


RowBlock = collections.namedtuple("RowBlock", "rank world_size")  # a slice r of W, where no Comm stands for it


class FullSizeDraws(TorchFunctionMode):
    """Inside it, torch.rand and Tensor.uniform_ draw the single process's tensor, W times as large along `dim`, and
    keep slice part.rank of part.world_size: a mask at the shape of a rank's heads (tp, dim 1), sequences (ep, dim 0)
    or a micro-batch's rows (pp, dim 0) becomes the single process's, sliced. Other random functions are refused."""

    def __init__(self, part, dim):
        super().__init__()
        self.part, self.dim = part, dim

    def whole_then_mine(self, shape, draw):
        shape, size = list(shape), shape[self.dim]
        shape[self.dim] = size * self.part.world_size  # the single process's shape
        whole = draw(tuple(shape))  # the whole draw, from the shared generator state
        return whole.narrow(self.dim, self.part.rank * size, size)  # this rank's slice, a view

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand:  # a dropout mask: torch.rand(shape, device=...)
            shape = args[0] if len(args) == 1 else args  # torch.rand((a, b)) or torch.rand(a, b)
            return self.whole_then_mine(shape, lambda whole: func(whole, **kwargs)).clone()  # compact
        if func is torch.Tensor.uniform_:  # router jitter: torch.empty_like(x).uniform_(low, high)
            tensor, *bounds = args
            return tensor.copy_(self.whole_then_mine(tensor.shape,
                                                     lambda whole: tensor.new_empty(whole).uniform_(*bounds, **kwargs)))
        if func in (torch.randn, torch.randint, torch.bernoulli, torch.rand_like, torch.randn_like, torch.normal):
            raise RuntimeError(f"{func.__name__} inside full_size_draws: only torch.rand and uniform_ are drawn "
                               f"whole and sliced here")
        return func(*args, **kwargs)


def full_size_draws(part, dim, dropout=1.0):
    """FullSizeDraws(part, dim) to put around a block (part: a Comm or a Part); a no-op on one rank or at dropout 0."""
    return FullSizeDraws(part, dim) if part.world_size != 1 and dropout != 0 else contextlib.nullcontext()
