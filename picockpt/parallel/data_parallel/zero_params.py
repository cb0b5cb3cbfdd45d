"""How ZeRO shards a model over N_d data-parallel ranks: flat units, padded, cut into N_d equal shards.

A unit is what one all-gather brings back whole (the FSDP unit): "embed", each decoder layer k, or "head" (final norm
and LM head). Its parameters lie side by side in one flat buffer, in state-dict order, padded with zeros to a
multiple of N_d; rank r holds elements r*s .. (r+1)*s - 1 (s = padded / N_d): FSDP1's FlatParameter and DeepSpeed
ZeRO's partitions. (FSDP2 cuts each parameter along dim 0 instead: the same bytes up to padding.) A piece is a
name's elements in one rank's shard; a parameter is its pieces in rank order.

gather_flat counts as comm.py counts an all-gather, but can run asynchronously (a prefetch) and is booked under the
phase of the use it serves, so a prefetch moves no bytes from one phase to another.
"""
import torch

from ...model.params import EMBED, FINAL_NORM, HEAD, param_shapes
from ..comm import all_gather_flat


class FlatUnit:
    def __init__(self, key, names, shapes, world_size):
        self.key, self.names = key, list(names)
        self.shapes = [torch.Size(shapes[name]) for name in self.names]
        self.sizes = [shape.numel() for shape in self.shapes]
        self.numel = sum(self.sizes)  # the unit's parameters, unpadded
        self.world_size = world_size
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

    def pieces(self, shard, rank):
        """{name: 1-D view of shard}: the elements of each parameter that lie in rank's shard."""
        low, out, start = rank * self.shard_numel, {}, 0
        for name, size in zip(self.names, self.sizes):
            first, last = max(start, low), min(start + size, low + self.shard_numel)  # overlap with the shard
            out[name] = shard[first - low:max(first, last) - low]  # (n_r,) possibly empty
            start += size
        return out


def unit_names(names, layers, first, last):
    """{key: [names]} of a stage's units in the order a forward uses them: "embed", its layers k, "head"."""
    units = {"embed": [EMBED]} if first else {}
    units.update({k: [name for name in names if name.startswith(f"model.layers.{k}.")] for k in layers})
    if last:
        units["head"] = [FINAL_NORM, HEAD]
    return units


def flat_units(cfg, world_size):
    """[FlatUnit] in the order a forward uses them: the embedding, layers 0..L-1, the head."""
    shapes = param_shapes(cfg)
    return [FlatUnit(key, names, shapes, world_size)
            for key, names in unit_names(list(shapes), range(cfg.layers), True, True).items()]


def gather_flat(shard, comm, phase, padded, async_op=False):
    """(padded,) every rank's shard, one after another: the unit whole on every rank, counted (see above) under
    `phase`. async_op=True: returns (work, flat) at once; flat is ready after work.wait()."""
    flat = shard.new_empty(padded)  # (N_d * s,)
    work = all_gather_flat(flat, shard.contiguous(), group=comm.group, async_op=async_op)  # shards in rank order
    comm.log.record(phase, "all_gather", flat.nbytes)
    return (work, flat) if async_op else flat
