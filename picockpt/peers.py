"""PyTorch's own recomputation, applied to the autograd reference model, for side-by-side runs.

Each peer is a run_layers(layers, x) function for ReferenceLlama.forward:

    autograd        no recomputation: autograd saves what each op's backward needs
    per_layer       torch.utils.checkpoint around every layer            (~ picockpt "full")
    sequential(n)   checkpoint_sequential in n segments; note that it does *not* checkpoint
                    the last segment, whose backward comes first         (~ picockpt "every:C")
    selective(T)    checkpoint with a selective policy (create_selective_checkpoint_contexts)
                    that recomputes only the ops making a (T, T) tensor: q k^T, its scaling and
                    masking, the softmax                                  (~ picockpt "selective")
                    Every other op is MUST_SAVE, and selective checkpointing caches the output
                    of every MUST_SAVE op, needed by the backward or not: more than autograd keeps.
    save_matmuls(T) the policy PyTorch's documentation shows: keep the matmul outputs, recompute
                    everything else (norms, RoPE, softmax, SiLU) and q k^T    (~ picockpt "cheap")
"""
import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

from .reference import run_plain

autograd = run_plain


def per_layer(layers, x):
    for layer in layers:
        x = checkpoint(layer, x, use_reentrant=False)
    return x


def sequential(segments):
    def run(layers, x):
        return checkpoint_sequential(list(layers), segments, x, use_reentrant=False)
    return run


def _makes_square(seq, op, args):
    """Does this op output a (.., T, T) tensor? Decided from its inputs, before it runs."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or tensors[0].dim() < 2:
        return False
    if op in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):  # (n, T, k) @ (n, k, T)
        return tensors[0].shape[-2] == seq and tensors[1].shape[-1] == seq
    return tuple(tensors[0].shape[-2:]) == (seq, seq)  # elementwise, softmax, casts of scores


def _checkpoint_each(policy):
    context = functools.partial(create_selective_checkpoint_contexts, policy)

    def run(layers, x):
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False, context_fn=context)
        return x
    return run


def selective(seq):
    def policy(ctx, op, *args, **kwargs):
        square = _makes_square(seq, op, args)
        return CheckpointPolicy.PREFER_RECOMPUTE if square else CheckpointPolicy.MUST_SAVE
    return _checkpoint_each(policy)


def save_matmuls(seq):
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)

    def policy(ctx, op, *args, **kwargs):
        keep = op in matmuls and not _makes_square(seq, op, args)  # projections and P v; not q k^T
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return _checkpoint_each(policy)
