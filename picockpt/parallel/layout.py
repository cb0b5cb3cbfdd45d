"""How dp x pp x ep x tp processes are arranged, and the process groups each rank talks in.

    layout = Layout(dp=2, pp=2, tp=1)      # 4 processes
    layout.coordinates(rank=3)             # (stage 1, dp rank 1, ep rank 0, tp rank 0)

Ranks are numbered as Megatron-LM numbers them by default (order "tp-ep-dp-pp"): tensor-parallel
ranks are neighbours (the most traffic, the fastest links on a real machine), then expert-parallel
ranks, then data-parallel replicas, then pipeline stages:

    rank = ((stage * dp + dp_rank) * ep + ep_rank) * tp + tp_rank

    pp=2, dp=2:  stage 0: ranks 0, 1 (dp 0, 1)    stage 1: ranks 2, 3
    a tensor-parallel group: one (stage, dp rank, ep rank), its tp ranks; an expert-parallel group: one
    (stage, dp rank, tp rank), its ep ranks; a pipeline: one (dp, ep, tp rank), its stages in order

Expert parallelism is carved out of the data-parallel ranks, as Megatron-LM carves its expert-parallel
groups (its data-parallel size is dp * ep here): the ep ranks of
a group compute different sequences with the same weights but the experts', which they split. So every
weight but the experts' is replicated over dp x ep ranks (the data-parallel group: one (stage, tp rank),
its dp * ep ranks), and each expert over the dp ranks holding it (the expert-data-parallel group: one
(stage, ep rank, tp rank), its dp ranks). Without ep both are the plain data-parallel group.

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
    ep: int = 1

    @property
    def world_size(self):
        return self.dp * self.pp * self.ep * self.tp

    def rank_of(self, stage, dp_rank, tp_rank, ep_rank=0):
        return ((stage * self.dp + dp_rank) * self.ep + ep_rank) * self.tp + tp_rank

    def coordinates(self, rank):
        """(stage, dp rank, ep rank, tp rank) of a global rank."""
        tp, ep, dp = self.tp, self.ep, self.dp
        return rank // (dp * ep * tp), rank // (ep * tp) % dp, rank // tp % ep, rank % tp

    def groups(self):
        """{kind: {key: [global ranks]}} of every group of more than one rank, in the order every rank makes them."""
        out = {"tp": {}, "ep": {}, "dp": {}, "expert_dp": {}}
        for s in range(self.pp):
            for d in range(self.dp):
                for e in range(self.ep):
                    out["tp"][s, d, e] = [self.rank_of(s, d, t, e) for t in range(self.tp)]
                for t in range(self.tp):
                    out["ep"][s, d, t] = [self.rank_of(s, d, t, e) for e in range(self.ep)]
            for t in range(self.tp):
                out["dp"][s, t] = [self.rank_of(s, d, t, e) for d in range(self.dp) for e in range(self.ep)]
                for e in range(self.ep):
                    out["expert_dp"][s, e, t] = [self.rank_of(s, d, t, e) for d in range(self.dp)]
        return {kind: {key: ranks for key, ranks in made.items() if len(ranks) > 1} for kind, made in out.items()}


def check_layout(dp, pp, tp, world_size=None, ep=1):
    """ValueError naming the values unless dp, pp, tp and ep are whole numbers >= 1 whose product is the
    number of processes (when one is given, as torchrun's WORLD_SIZE)."""
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: use a whole number of {_WHAT[name]}, 1 or more")
    if world_size is not None and dp * pp * tp * ep != world_size:
        factors = [(d, p, world_size // (d * p)) for d in _divisors(world_size) for p in _divisors(world_size // d)]
        raise ValueError(f"{world_size} processes do not factor into dp x pp x tp{' x ep' if ep > 1 else ''} = "
                         f"{dp} x {pp} x {tp}{f' x {ep}' if ep > 1 else ''} = {dp * pp * tp * ep}; choose dp, pp, "
                         f"tp with product {world_size}, e.g. {', '.join(f'{d}x{p}x{t}' for d, p, t in factors[:4])}")
    return Layout(dp, pp, tp, ep)


_WHAT = {"dp": "data-parallel replicas", "pp": "pipeline stages", "tp": "tensor-parallel ranks",
         "ep": "expert-parallel ranks"}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class RankGroups:
    """What one rank needs of a layout: its coordinates, the Comm of each group it is in (None for a group
    of one: tensor-, expert-, data- and expert-data-parallel), and its pipeline neighbours' global ranks."""
    layout: Layout
    rank: int
    stage: int
    dp_rank: int
    ep_rank: int
    tp_rank: int
    tp_comm: Comm = None
    ep_comm: Comm = None
    dp_comm: Comm = None         # every weight but the experts': over dp x ep ranks
    expert_dp_comm: Comm = None  # the experts': over the dp ranks that hold the same ones
    previous: int = None  # the global rank of the previous stage (same dp, ep and tp rank), or None
    next: int = None


def build_groups(layout, rank, device, made=None, timeout=None):
    """This rank's RankGroups. Every rank must call it with the same layout at the same point.
    made: a dict kept across calls, so a layout's groups are made once per launch. timeout: the
    job's (a timedelta), for every collective in these groups too."""
    made = {} if made is None else made
    if layout not in made:  # every rank makes every group, in one order
        made[layout] = {kind: {key: dist.new_group(ranks, timeout=timeout) for key, ranks in groups.items()}
                        for kind, groups in layout.groups().items()}
    group_of = made[layout]
    stage, d, e, t = layout.coordinates(rank)
    groups = RankGroups(layout, rank, stage, d, e, t)
    for kind, key in (("tp", (stage, d, e)), ("ep", (stage, d, t)), ("dp", (stage, t)), ("expert_dp", (stage, e, t))):
        if key in group_of[kind]:
            setattr(groups, f"{kind}_comm", Comm(group_of[kind][key], device, timeout=timeout))
    if stage > 0:
        groups.previous = layout.rank_of(stage - 1, d, t, e)
    if stage < layout.pp - 1:
        groups.next = layout.rank_of(stage + 1, d, t, e)
    return groups
