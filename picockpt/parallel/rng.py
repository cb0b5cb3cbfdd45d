"""Dropout masks under tensor and sequence parallelism, equal to the single process's.

A rank applies dropout to its share of a tensor: its heads of the attention probabilities,
(B, H/t, T, T), and, under sequence parallelism, its tokens of a residual branch, (B, T/t, h).
For its results to equal the single-process run's, every rank draws the *whole* mask that the
single process draws, (B, H, T, T) or (B, T, h), from the same generator state, and keeps its own
slice. Every rank starts the step from the caller's generator state (picockpt/parallel/step.py),
so every rank's generator then advances exactly as the single process's does: the next mask, and
every mask a recomputation draws again after the engine's RNG replay, are the same ones too.

    mask = sliced_mask((B, T, h), p, device, comm, dim=1)   # this rank's tokens of the whole mask
    with full_size_draws(comm, dim=1, dropout=p):           # around code that draws its own masks
        a = attention_block_forward(...)                    # eager attention: (B, H/t, T, T) kept of (B, H, T, T)

The price: each rank draws t times the random numbers it keeps (t x B*H*T^2 for the attention
probabilities: cheap next to the q k^T that made them, but not free), and the masks of two ranks
are slices of one mask rather than independent draws.

Megatron-LM does otherwise: a model-parallel RNG tracker (tensor_parallel.random, the
CudaRNGStatesTracker) forks, inside the tensor-parallel region, to a generator seeded per rank
(seed + 2718 + rank), so each rank draws only its slice's size and the ranks' masks are
independent; its recomputation saves and replays both the default and the tracker's states. That
is cheaper, and statistically as good, but the masks depend on t, so its gradients cannot equal
a single process's: here equality is the point (every test compares the two).

Tiled attention draws each tile's mask from its own generator, seeded from one stored seed and the
tile's index, at the shape of the rank's heads: no slice of those equals the single process's
tiles, so tiled attention with dropout is refused under tensor parallelism (shard.py).
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode

from ..ops import dropout_mask


def sliced_mask(shape, p, device, comm, dim=None):
    """The single process's dropout mask of `shape` (True: kept), drawn whole; this rank's slice along
    dim (its 1/t), as a tensor of its own (a view would keep the whole mask's storage alive and
    stored). dim=None: the whole mask (a replicated tensor, without sequence parallelism)."""
    mask = dropout_mask(shape, p, device)  # (shape) bool: the very draw of the single process
    if dim is None:
        return mask
    size = shape[dim] // comm.world_size
    return mask.narrow(dim, comm.rank * size, size).clone()  # (.., shape[dim]/t, ..) bool, compact


class _FullSizeDraws(TorchFunctionMode):
    """Inside it, torch.rand(shape) draws shape with dim `dim` t times larger and returns this
    rank's slice: the mask picockpt/attention.py draws at the shape of a rank's heads becomes the
    single process's mask, sliced. Any other random function inside is refused (none is called)."""

    def __init__(self, comm, dim):
        super().__init__()
        self.comm, self.dim = comm, dim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.rand:
            shape = list(args[0] if len(args) == 1 else args)  # torch.rand((a, b)) or torch.rand(a, b)
            size = shape[self.dim]
            shape[self.dim] = size * self.comm.world_size  # the single process's shape
            whole = func(tuple(shape), **kwargs)  # the whole draw, from the shared generator state
            return whole.narrow(self.dim, self.comm.rank * size, size).clone()  # this rank's slice
        if func in (torch.randn, torch.randint, torch.bernoulli, torch.rand_like, torch.randn_like):
            raise RuntimeError(f"{func.__name__} inside full_size_draws: only torch.rand is sliced here")
        return func(*args, **kwargs)


@contextlib.contextmanager
def full_size_draws(comm, dim, dropout=1.0):
    """Every torch.rand inside draws the single process's tensor and keeps this rank's slice along dim.
    Nothing to do on one rank (its shapes are the single process's), nor when dropout is 0 (no draws)."""
    if comm.world_size == 1 or dropout == 0:
        yield
        return
    with _FullSizeDraws(comm, dim):
        yield
