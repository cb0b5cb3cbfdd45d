"""How ZeRO shards a model over N_d data-parallel ranks: flat units, padded, cut into N_d equal shards.

A unit is what one all-gather brings back whole (the FSDP unit): "embed", each decoder layer k, or "head" (final norm
and LM head). Its parameters lie side by side in one flat buffer, in state-dict order, padded with zeros to a multiple
of N_d; rank r holds elements r*s .. (r+1)*s - 1 (s = padded / N_d): FSDP1's FlatParameter and DeepSpeed ZeRO's
partitions. (FSDP2 cuts each parameter along dim 0 instead: the same bytes up to padding.)
"""
import torch

from ...model.params import EMBED, FINAL_NORM, HEAD
from ..comm import all_gather_flat


class FlatUnit:
    def __init__(self, names, shapes, world_size):
        self.names, self.world_size = list(names), world_size
        self.shapes = [torch.Size(shapes[name]) for name in self.names]
        self.sizes = [shape.numel() for shape in self.shapes]
        self.numel = sum(self.sizes)  # the unit's parameters, unpadded
        self.shard_numel = -(-self.numel // world_size)  # s = ceil(numel / N_d)
        self.padded = self.shard_numel * world_size  # numel rounded up to a multiple of N_d

    def flatten(self, tensors, dtype):
        """(padded,) the named tensors one after another, then zeros: a new buffer."""
        flat = torch.zeros(self.padded, dtype=dtype, device=tensors[self.names[0]].device)  # (padded,)
        for name, part in zip(self.names, flat[:self.numel].split(self.sizes)):
            part.copy_(tensors[name].reshape(-1))  # (n,)
        return flat

    def views(self, flat):
        return {name: part.view(shape)  # (shape) a view into flat
                for name, shape, part in zip(self.names, self.shapes, flat[:self.numel].split(self.sizes))}

    def shard(self, flat, rank):
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]  # (s,) a view


def unit_names(names, layers, first, last):
    """{key: [names]} of a stage's units in the order a forward uses them: "embed", its layers k, "head"."""
    layer_units = {k: [name for name in names if name.startswith(f"model.layers.{k}.")] for k in layers}
    return ({"embed": [EMBED]} if first else {}) | layer_units | ({"head": [FINAL_NORM, HEAD]} if last else {})


def gather_flat(shard, comm, phase, padded, async_op=False):
    """(padded,) every rank's shard, one after another: the unit whole on every rank, counted as comm.py counts an
    all-gather but booked under `phase`, the phase of the use it serves, so a prefetch moves no bytes from one phase
    to another. async_op=True: returns (work, flat) at once; flat is ready after work.wait()."""
    flat = shard.new_empty(padded)  # (N_d * s,)
    work = all_gather_flat(flat, shard.contiguous(), group=comm.group, async_op=async_op)  # shards in rank order
    comm.log.record(phase, "all_gather", flat.nbytes)
    return (work, flat) if async_op else flat
