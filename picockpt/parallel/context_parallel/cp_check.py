"""What context parallelism refuses before any rank starts (picockpt/parallel/job.py's checked_job calls `refuses`)."""
from ...recompute.policy import as_policy
from ..launch import check_rank_count
from ..refusals import given, not_yet
from .cp_layout import check_layout


def check_context_parallel(cfg, cp, seq, layout="zigzag", cp_comm="ring", keep_kv=False, policy="none", device="cpu"):
    """ValueError naming the parameter, the value and what would work, before any work starts. device: where cp ranks
    alone would run, their count checked (torchrun's WORLD_SIZE, a GPU each); None where the caller has checked the
    whole layout's (a job: job.py's check_ranks, cp beside tp being cp x tp ranks)."""
    check_layout(layout, cp, seq)  # cp a whole number >= 1 too
    if cp_comm not in ("ring", "ring_overlap", "allgather"):
        raise ValueError(f"cp_comm={cp_comm!r}: use 'ring' (K/V passed round, cp - 1 steps), 'ring_overlap' (the "
                         f"same ring, each step sent while a block is computed) or 'allgather' (K/V all-gathered "
                         f"once per layer)")
    if not isinstance(keep_kv, bool):
        raise ValueError(f"keep_kv={keep_kv!r}: use True or False")
    if keep_kv and cp_comm != "allgather":
        raise ValueError(f"keep_kv=True with cp_comm={cp_comm!r}: it keeps the all-gathered K/V of the other ranks; "
                         "use cp_comm='allgather', or leave keep_kv out (the ring passes the blocks round again)")
    if cfg.attention == "eager":
        raise ValueError("Config.attention='eager' under context parallelism: eager attention keeps the "
                         "probabilities and has no log-sum-exp to merge the ranks' blocks with; use "
                         "attention='tiled' or 'fused'")
    if cfg.experts or cfg.router_jitter:
        raise ValueError(f"Config.experts={cfg.experts} under context parallelism: not supported here; use a "
                         f"dense MLP (experts=0), or expert parallelism (ep)")
    parsed = as_policy(policy, cfg)
    if parsed.offload is not None:
        raise ValueError(f"policy={parsed.text!r} under context parallelism: offloading is not planned per "
                         f"context-parallel rank; use none, full, every:C, selective, cheap or budget:SIZE")
    if cfg.dropout > 0:
        raise ValueError(f"Config.dropout={cfg.dropout} under context parallelism: the masks of blocks spread "
                         f"over ranks are not made equal to the single process's here; use dropout=0")
    if device is not None:
        check_rank_count("cp", cp, device)


def refuses(job, policy, device):
    """The context-parallel fields of a picockpt.parallel job (job.py: ParallelJob), with its parsed policy: cp's own
    values, its flags without it, and what it does not stack with yet."""
    layout = job.layout
    if layout.cp_keep_kv and (layout.pp > 1 or layout.microbatches > 1 or layout.tp > 1):
        not_yet(f"cp_keep_kv=True with {given(job, 'pp', 'microbatches', 'tp')}",
                "the kept K/V are closed-formed for one micro-batch per rank without tp",
                "use it with pp=1, microbatches=1 and tp=1")
    if layout.cp == 1:
        flags = [f"{name}={value!r}" for name, value, default in (("cp_layout", layout.cp_layout, "zigzag"), (
            "cp_comm", layout.cp_comm, "ring"), ("cp_keep_kv", layout.cp_keep_kv, False)) if value != default]
        if flags:
            raise ValueError(f"{', '.join(flags)} without cp: {'they choose' if len(flags) > 1 else 'it chooses'} how "
                             f"context-parallel ranks split the sequence and share K/V, and there are none here; add "
                             f"cp >= 2, or leave {'them' if len(flags) > 1 else flags[0].split('=')[0]} out")
        return
    if layout.ep > 1:
        not_yet(f"cp={layout.cp} with ep={layout.ep}", "a rank's experts would receive the tokens of its sequence "
                "chunks, and the routing and its closed forms are by whole rows",
                "use cp with tp, dp, zero and pp, or ep without cp")
    if layout.cp_keep_kv and policy.budget is not None:
        not_yet(f"cp_keep_kv=True with policy={policy.text!r}", "the planner's chain does not hold the kept K/V",
                "use a budget without cp_keep_kv, or keep_kv with none, full, every:C, selective or cheap")
    check_context_parallel(job.cfg, layout.cp, job.input_ids.shape[1], layout.cp_layout, layout.cp_comm,
                           layout.cp_keep_kv, policy, device=None)  # the ranks: check_ranks counted them all
