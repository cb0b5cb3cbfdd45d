"""How dp x pp x tp processes are arranged, and the process groups each rank talks in.

    layout = Layout(dp=2, pp=2, tp=1)      # 4 processes
    layout.coordinates(rank=3)             # (stage 1, dp rank 1, tp rank 0)

Ranks are numbered as Megatron-LM numbers them by default (order "tp-dp-pp"): tensor-parallel
ranks are neighbours (the most traffic, the fastest links on a real machine), then data-parallel
replicas, then pipeline stages:

    rank = (stage * dp + dp_rank) * tp + tp_rank

    pp=2, dp=2, tp=1:  stage 0: ranks 0, 1 (dp 0, 1)    stage 1: ranks 2, 3
    a tensor-parallel group: one (stage, dp rank), its tp ranks; a data-parallel group: one
    (stage, tp rank), its dp ranks; a pipeline: one (dp rank, tp rank), its stages in order

Every group is made by torch.distributed.new_group, which every rank of the job calls for every
group, in the same order (the groups this rank is not in included). Groups of one rank are not
made: nothing crosses them.
"""
from dataclasses import dataclass

import torch.distributed as dist

from .comm import Comm


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def world_size(self):
        return self.dp * self.pp * self.tp

    def rank_of(self, stage, dp_rank, tp_rank):
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def coordinates(self, rank):
        """(stage, dp rank, tp rank) of a global rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def tp_group(self, stage, dp_rank):
        return [self.rank_of(stage, dp_rank, t) for t in range(self.tp)]

    def dp_group(self, stage, tp_rank):
        return [self.rank_of(stage, d, tp_rank) for d in range(self.dp)]


def check_layout(dp, pp, tp, world_size=None):
    """ValueError naming the values unless dp, pp and tp are whole numbers >= 1 whose product is the
    number of processes (when one is given, as torchrun's WORLD_SIZE)."""
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: use a whole number of {_WHAT[name]}, 1 or more")
    if world_size is not None and dp * pp * tp != world_size:
        factors = [(d, p, world_size // (d * p)) for d in _divisors(world_size) for p in _divisors(world_size // d)]
        raise ValueError(f"{world_size} processes do not factor into dp x pp x tp = {dp} x {pp} x {tp} = "
                         f"{dp * pp * tp}; choose dp, pp, tp with product {world_size}, e.g. "
                         f"{', '.join(f'{d}x{p}x{t}' for d, p, t in factors[:4])}")
    return Layout(dp, pp, tp)


_WHAT = {"dp": "data-parallel replicas", "pp": "pipeline stages", "tp": "tensor-parallel ranks"}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class RankGroups:
    """What one rank needs of a layout: its coordinates, the Comm of its tensor-parallel group and of
    its data-parallel group (None for a group of one), and its pipeline neighbours' global ranks."""
    layout: Layout
    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    tp_comm: Comm = None
    dp_comm: Comm = None
    previous: int = None  # the global rank of the previous stage (same dp and tp rank), or None
    next: int = None


def build_groups(layout, rank, device, made=None, timeout=None):
    """This rank's RankGroups. Every rank must call it with the same layout at the same point.
    made: a dict kept across calls, so a layout's groups are made once per launch. timeout: the
    job's (a timedelta), for every collective in these groups too."""
    made = {} if made is None else made
    if layout not in made:
        tp_groups, dp_groups = {}, {}
        for stage in range(layout.pp):  # every rank makes every group, in this order
            for d in range(layout.dp):
                if layout.tp > 1:
                    tp_groups[stage, d] = dist.new_group(layout.tp_group(stage, d), timeout=timeout)
            for t in range(layout.tp):
                if layout.dp > 1:
                    dp_groups[stage, t] = dist.new_group(layout.dp_group(stage, t), timeout=timeout)
        made[layout] = (tp_groups, dp_groups)
    tp_groups, dp_groups = made[layout]
    stage, d, t = layout.coordinates(rank)
    groups = RankGroups(layout, rank, stage, d, t)
    if (stage, d) in tp_groups:
        groups.tp_comm = Comm(tp_groups[stage, d], device, timeout=timeout)
    if (stage, t) in dp_groups:
        groups.dp_comm = Comm(dp_groups[stage, t], device, timeout=timeout)
    if stage > 0:
        groups.previous = layout.rank_of(stage - 1, d, t)
    if stage < layout.pp - 1:
        groups.next = layout.rank_of(stage + 1, d, t)
    return groups
