"""How dp x pp x ep x cp x tp processes are arranged, and the process groups each rank talks in.

    layout = Layout(dp=2, pp=2, tp=1)      # 4 processes
    layout.coordinates(rank=3)             # (stage 1, dp rank 1, ep rank 0, cp rank 0, tp rank 0)

Ranks are numbered as Megatron-LM numbers them by default (order "tp-cp-ep-dp-pp"): tensor-parallel
ranks are neighbours (the most traffic, the fastest links on a real machine), then context-parallel
ranks, then expert-parallel ranks, then data-parallel replicas, then pipeline stages:

    rank = (((stage * dp + dp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank

    pp=2, dp=2:  stage 0: ranks 0, 1 (dp 0, 1)    stage 1: ranks 2, 3
    a tensor-parallel group: the tp ranks of one (stage, dp, ep, cp rank); a context-parallel group: the cp
    ranks of one (stage, dp, ep, tp rank); an expert-parallel group: the ep ranks of one (stage, dp, cp, tp
    rank); a pipeline: one (dp, ep, cp, tp rank), its stages in order

Expert parallelism is carved out of the data-parallel ranks, as Megatron-LM carves its expert-parallel
groups: the ep ranks of a group compute different sequences with the same weights but the experts', which
they split. Context-parallel ranks compute different tokens of the same sequences with the same weights.
So every weight but the experts' is replicated over dp x ep x cp ranks (the data-parallel group, over which
the gradients are summed: one (stage, tp rank), its dp * ep * cp ranks, picotron's cp_dp group), and each
expert over the dp x cp ranks holding it (the expert-data-parallel group: one (stage, ep rank, tp rank)).

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
    cp: int = 1

    @property
    def world_size(self):
        return self.dp * self.pp * self.ep * self.cp * self.tp

    def rank_of(self, stage, dp_rank, tp_rank, ep_rank=0, cp_rank=0):
        return (((stage * self.dp + dp_rank) * self.ep + ep_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coordinates(self, rank):
        """(stage, dp rank, ep rank, cp rank, tp rank) of a global rank."""
        tp, cp, ep, dp = self.tp, self.cp, self.ep, self.dp
        return rank // (dp * ep * cp * tp), rank // (ep * cp * tp) % dp, rank // (cp * tp) % ep, rank // tp % cp, \
            rank % tp

    def groups(self):
        """{kind: {key: [global ranks]}} of every group of more than one rank, in the order every rank makes them."""
        out = {"tp": {}, "cp": {}, "ep": {}, "dp": {}, "expert_dp": {}}
        grid = [(s, d, e, c, t) for s in range(self.pp) for d in range(self.dp) for e in range(self.ep)
                for c in range(self.cp) for t in range(self.tp)]
        for s, d, e, c, t in grid:  # each group under its key: the coordinates its ranks share
            rank = self.rank_of(s, d, t, e, c)
            for kind, key in (("tp", (s, d, e, c)), ("cp", (s, d, e, t)), ("ep", (s, d, c, t)), ("dp", (s, t)),
                              ("expert_dp", (s, e, t))):
                out[kind].setdefault(key, []).append(rank)
        return {kind: {key: ranks for key, ranks in made.items() if len(ranks) > 1} for kind, made in out.items()}


def check_layout(dp, pp, tp, world_size=None, ep=1, cp=1):
    """ValueError naming the values unless dp, pp, tp, ep and cp are whole numbers >= 1 whose product is the
    number of processes (when one is given, as torchrun's WORLD_SIZE)."""
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("ep", ep), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: use a whole number of {_WHAT[name]}, 1 or more")
    if world_size is not None and dp * pp * tp * ep * cp != world_size:
        extra = "".join(f" x {name}" for name, n in (("ep", ep), ("cp", cp)) if n > 1)
        values = "".join(f" x {n}" for n in (ep, cp) if n > 1)
        factors = [(d, p, world_size // (d * p)) for d in _divisors(world_size) for p in _divisors(world_size // d)]
        raise ValueError(f"{world_size} processes do not factor into dp x pp x tp{extra} = "
                         f"{dp} x {pp} x {tp}{values} = {dp * pp * tp * ep * cp}; choose dp, pp, "
                         f"tp with product {world_size}, e.g. {', '.join(f'{d}x{p}x{t}' for d, p, t in factors[:4])}")
    return Layout(dp, pp, tp, ep, cp)


_WHAT = {"dp": "data-parallel replicas", "pp": "pipeline stages", "tp": "tensor-parallel ranks",
         "ep": "expert-parallel ranks", "cp": "context-parallel ranks"}


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
    cp_rank: int
    tp_rank: int
    tp_comm: Comm = None
    cp_comm: Comm = None
    ep_comm: Comm = None
    dp_comm: Comm = None         # every weight but the experts': over dp x ep x cp ranks
    expert_dp_comm: Comm = None  # the experts': over the dp x cp ranks that hold the same ones
    previous: int = None  # the global rank of the previous stage (same dp, ep, cp and tp rank), or None
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
    stage, d, e, c, t = layout.coordinates(rank)
    groups = RankGroups(layout, rank, stage, d, e, c, t)
    for kind, key in (("tp", (stage, d, e, c)), ("cp", (stage, d, e, t)), ("ep", (stage, d, c, t)), ("dp", (stage, t)),
                      ("expert_dp", (stage, e, t))):
        if key in group_of[kind]:
            setattr(groups, f"{kind}_comm", Comm(group_of[kind][key], device, timeout=timeout))
    if stage > 0:
        groups.previous = layout.rank_of(stage - 1, d, t, e, c)
    if stage < layout.pp - 1:
        groups.next = layout.rank_of(stage + 1, d, t, e, c)
    return groups
