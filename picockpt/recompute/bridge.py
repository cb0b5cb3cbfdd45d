"""The autograd bridge: picockpt's segment recomputation around any sequence of nn.Modules.

No torch.utils.checkpoint: the loop is written out, and autograd only ever sees one
segment at a time, driven by torch.autograd.backward (the way picotron drives its
pipeline-parallel backward, one micro-batch's activations at a time).

    forward : run every segment under no_grad, keep only each segment's input (and RNG state)
    backward: for the segments in reverse, recompute the segment with a graph from its kept
              input, push the incoming gradient through it, and pass the input's gradient down
"""
import torch

from .engine import device_generator, replay_rng


def segmented_backward(layers, x, head, segment):
    """layers: a list of modules (B, T, h) -> (B, T, h); x: their input (with a graph above it);
    head(y) -> scalar loss on the last output. Runs forward and backward; returns the loss."""
    layers = list(layers)
    if isinstance(segment, bool) or not isinstance(segment, int) or segment < 1:
        raise ValueError(f"segment={segment!r}: the layers per recomputed segment must be a whole number >= 1 "
                         f"(1: every layer its own checkpoint; {len(layers)} or more: the {len(layers)} layers as one)")
    generator = device_generator(x.device)
    starts = range(0, len(layers), segment)
    kept = []  # (input of the segment, RNG state before it): the checkpoints
    with torch.no_grad():
        y = x.detach()
        for start in starts:
            kept.append((y, generator.get_state()))
            for layer in layers[start:start + segment]:
                y = layer(y)  # (B, T, h), no graph: its activations are freed at once
    top = y.requires_grad_()  # the last output becomes a leaf: the head's graph stops here
    loss = head(top)
    loss.backward()
    grad = top.grad  # (B, T, h) d loss / d output of the last segment
    del top, y
    for start in reversed(starts):
        inp, state = kept.pop()  # the checkpoint leaves the list: it is used once
        inp.requires_grad_()
        with torch.enable_grad(), replay_rng(generator, state):
            out = inp
            for layer in layers[start:start + segment]:
                out = layer(out)  # (B, T, h), this time with a graph
        torch.autograd.backward(out, grad)  # weight grads accumulate; inp.grad is the next grad
        grad = inp.grad
        del out, inp
    x.backward(grad)  # into the embedding
    return loss.detach()
