"""How dp x pp x ep x cp x tp processes are arranged, and the process groups each rank talks in.

    layout = Layout(dp=2, pp=2, microbatches=4)   # 4 processes: stage 0 is ranks 0, 1 (dp 0, 1), stage 1 ranks 2, 3
    layout.coordinates(rank=3)                    # (stage 1, dp rank 1, ep rank 0, cp rank 0, tp rank 0)

A Layout is the whole parallel layout of a step: the five dimensions and each one's options, grouped below by dimension;
what a job carries, the ranks build their groups from and the closed forms read. Ranks are numbered in Megatron-LM's
default order "tp-cp-ep-dp-pp", tensor-parallel ranks neighbours (the most traffic, the fastest links):

    rank = (((stage * dp + dp_rank) * ep + ep_rank) * cp + cp_rank) * tp + tp_rank

A group is the ranks whose other coordinates are equal (Layout.group_keys). Expert parallelism is carved out of the
data-parallel ranks, as in Megatron-LM: ep ranks compute different sequences with the same weights but the experts',
which they split; cp ranks compute different tokens of the same sequences. So every weight but the experts' is
replicated over the dp x ep x cp ranks of the data-parallel group, over which gradients are summed, and each expert over
the dp x cp ranks holding it (the expert-data-parallel group)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Comm


@dataclass(frozen=True)
class Layout:
    dp: int = 1                    # data-parallel replicas
    pp: int = 1                    # pipeline stages
    tp: int = 1                    # tensor-parallel ranks
    ep: int = 1                    # expert-parallel ranks, carved out of the data-parallel ones
    cp: int = 1                    # context-parallel ranks: every activation split along the sequence
    # data parallelism (data_parallel/)
    zero: int = 0                  # ZeRO stage over the dp (x ep x cp) ranks: 1, 2 or 3 (0: plain data parallelism)
    overlap: bool = True           # all-reduce each gradient bucket as soon as it is final
    keep_gathered: bool = False    # zero=3: a recomputed layer's gather kept for its backward ("step": zero_forms)
    prefetch: bool = True          # zero=3: the next use's parameters gathered while this one computes
    # pipeline parallelism (pipeline_parallel/)
    microbatches: int = 1
    schedule: str = "1f1b"         # "afab", "1f1b", "interleaved" or "zb-h1" (pipeline_parallel/pp_schedules.py)
    virtual_stages: int = 1        # interleaved: chunks of layers per rank (virtual stage c * pp + s on rank s)
    recompute_early: bool = False  # a stage recomputes its top segment while it waits for the gradient
    # tensor parallelism (tensor_parallel/)
    sp: bool = True                # sequence parallel (with tp > 1)
    distribute_saved: bool = False  # each tp rank keeps 1/t of a checkpoint-only layer input (without sp)
    # expert parallelism (expert_parallel/)
    keep_dispatched: bool = False  # keep the rows a layer dispatched: a recomputation reads them
    # context parallelism (context_parallel/)
    cp_layout: str = "zigzag"      # "zigzag" (rank r holds chunks r and 2cp - 1 - r) or "contiguous"
    cp_comm: str = "ring"          # "ring" (K/V passed round), "ring_overlap" (each hop sent while the block before
    #                                computes) or "allgather" (K/V gathered once per layer)
    cp_keep_kv: bool = False       # allgather: keep the other ranks' K/V for the recomputation and backward

    @property
    def grid(self):
        """The processes' arrangement alone, (dp, pp, tp, ep, cp): layouts that differ only in options share it,
        and its process groups (build_groups)."""
        return Layout(self.dp, self.pp, self.tp, self.ep, self.cp)

    @property
    def world_size(self):
        return self.dp * self.pp * self.ep * self.cp * self.tp

    def rank_of(self, stage, dp_rank, tp_rank, ep_rank=0, cp_rank=0):
        return (((stage * self.dp + dp_rank) * self.ep + ep_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coordinates(self, rank):
        """(stage, dp rank, ep rank, cp rank, tp rank) of a global rank."""
        t, c, e, d = self.tp, self.cp, self.ep, self.dp
        return rank // (d * e * c * t), rank // (e * c * t) % d, rank // (c * t) % e, rank // t % c, rank % t

    def group_keys(self, rank):
        """{kind: key} of a global rank's groups, each key the coordinates its group's ranks share; the experts' own
        data-parallel group only under ep (with ep = 1 it would be the dp group again, made twice)."""
        s, d, e, c, t = self.coordinates(rank)
        keys = {"tp": (s, d, e, c), "cp": (s, d, e, t), "ep": (s, d, c, t), "dp": (s, t)}
        return {**keys, "expert_dp": (s, e, t)} if self.ep > 1 else keys

    def groups(self):
        """{kind: {key: [global ranks]}} of every group of more than one rank, in the order every rank makes them."""
        out = {}
        for rank in range(self.world_size):
            for kind, key in self.group_keys(rank).items():
                out.setdefault(kind, {}).setdefault(key, []).append(rank)
        return {kind: {key: ranks for key, ranks in by_key.items() if len(ranks) > 1} for kind, by_key in out.items()}


def check_layout(layout, world_size=None):
    """ValueError naming the values unless the layout's micro-batches, dp, pp, tp, ep and cp are whole numbers >= 1,
    the last five's product the number of processes (when one is given, as torchrun's WORLD_SIZE)."""
    for name, what in (("microbatches", "micro-batches per step"), ("dp", "data-parallel replicas"),
                       ("pp", "pipeline stages"), ("tp", "tensor-parallel ranks"), ("ep", "expert-parallel ranks"),
                       ("cp", "context-parallel ranks")):
        if isinstance(value := getattr(layout, name), bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: use a whole number of {what}, 1 or more")
    if world_size is not None and layout.world_size != world_size:
        beyond = {name: getattr(layout, name) for name in ("ep", "cp") if getattr(layout, name) > 1}
        extra, values = "".join(f" x {name}" for name in beyond), "".join(f" x {n}" for n in beyond.values())
        factors = [(d, p, world_size // (d * p)) for d in range(1, world_size + 1)  # d x p divides world_size
                   for p in range(1, world_size // d + 1) if world_size % (d * p) == 0]
        raise ValueError(f"{world_size} processes do not factor into dp x pp x tp{extra} = "
                         f"{layout.dp} x {layout.pp} x {layout.tp}{values} = {layout.world_size}; choose dp, pp, "
                         f"tp with product {world_size}, e.g. {', '.join(f'{d}x{p}x{t}' for d, p, t in factors[:4])}")


@dataclass
class RankGroups:
    """What one rank needs of a layout: its coordinates (from its rank), the Comm of each group it is in (None for a
    group of one: tensor-, expert-, data- and expert-data-parallel), and its pipeline neighbours' global ranks."""
    layout: Layout
    rank: int
    device: object = None  # the rank's torch.device
    tp_comm: Comm = None
    cp_comm: Comm = None
    ep_comm: Comm = None
    dp_comm: Comm = None         # every weight but the experts': over dp x ep x cp ranks
    expert_dp_comm: Comm = None  # the experts': over the dp x cp ranks that hold the same ones (ep > 1 only)

    def __post_init__(self):
        self.stage, self.dp_rank, self.ep_rank, self.cp_rank, self.tp_rank = self.layout.coordinates(self.rank)

    def neighbours(self, ring=False):
        """(previous, next): the global ranks of the stages before and after, with the same dp, ep, cp and tp ranks:
        None past either end, or round a ring (stage mod pp: interleaved, chunk c of the last stage sends to chunk
        c + 1 of the first)."""
        return tuple(self.layout.rank_of(s % self.layout.pp, self.dp_rank, self.tp_rank, self.ep_rank, self.cp_rank)
                     if ring or 0 <= s < self.layout.pp else None for s in (self.stage - 1, self.stage + 1))


def build_groups(layout, rank, device, process_groups=None, timeout=None):
    """This rank's RankGroups; every rank calls it with the same layout at the same point. process_groups: a dict
    kept across calls (a grid's groups made once per launch); timeout: the job's timedelta, for these groups too."""
    process_groups, grid = {} if process_groups is None else process_groups, layout.grid
    if grid not in process_groups:  # every rank makes every group (those it is not in too), in one order
        process_groups[grid] = {kind: {key: dist.new_group(ranks, timeout=timeout) for key, ranks in groups.items()}
                                for kind, groups in grid.groups().items()}
    comms = {f"{kind}_comm": Comm(process_groups[grid][kind][key], device, timeout=timeout)
             for kind, key in layout.group_keys(rank).items() if key in process_groups[grid][kind]}
    return RankGroups(layout, rank, torch.device(device), **comms)
