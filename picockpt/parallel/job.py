"""The caller's side of every layout, written once: one job holds the whole layout (dp x pp x ep x cp x tp), is
checked before any rank starts and is sent to the ranks on the CPU.

    job = ParallelJob(params, cfg, input_ids, targets, "full", tp=2, sp=True)   # or pp=, microbatches=, dp=, ep=
    job = checked_job(job, "cpu", job.world_size)   # a ValueError naming the argument, before any rank starts
    sent = on_cpu(job)                        # what the ranks receive; each moves it to its own device

Every rank starts from the caller's generator state (or the job's rng_state), so its dropout masks are rows or
slices of the single process's (rng.py). step.py launches the ranks (several jobs per launch: starting ranks costs
about a second each) and puts their results together; each rank runs rank.py.
"""
from dataclasses import KW_ONLY, dataclass, replace

import torch

from ..batch import check_batch
from ..params import check_params
from ..policy import parse_policy
from .context_parallel.cp_check import check_context_job
from .context_parallel.cp_inventory import recompute_comm_flops
from .data_parallel.zero_check import check_zero_job
from .expert_parallel.ep_shard import check_expert_parallel
from .launch import check_rank_count, ranks_generator
from .layout import check_layout
from .pipeline_parallel.pp_inventory import rank_forms
from .pipeline_parallel.pp_schedules import (check_interleaving, check_schedule, check_segment, rank_layers,
                                             stage_layers)
from .tensor_parallel.tp_shard import check_tensor_parallel


@dataclass
class ParallelJob:
    """One step for the ranks to run: the full params and batch, the policy, the layout."""
    params: dict
    cfg: object
    input_ids: torch.Tensor
    targets: torch.Tensor
    policy: str = "full"
    _: KW_ONLY
    tp: int = 1                    # tensor-parallel ranks
    sp: bool = True                # sequence parallel (with tp > 1)
    distribute_saved: bool = False  # each tp rank keeps 1/t of a checkpoint-only layer input (without sp)
    pp: int = 1                    # pipeline stages
    microbatches: int = 1
    schedule: str = "1f1b"         # "afab", "1f1b", "interleaved" or "zb-h1" (pipeline_parallel/pp_schedules.py)
    virtual_stages: int = 1        # interleaved: chunks of layers per rank (virtual stage c * pp + s on rank s)
    recompute_early: bool = False  # a stage recomputes its top segment while it waits for the gradient
    dp: int = 1                    # data-parallel replicas
    overlap: bool = True           # all-reduce each gradient bucket as soon as it is final
    ep: int = 1                    # expert-parallel ranks, carved out of the data-parallel ones
    keep_dispatched: bool = False  # keep the rows a layer dispatched: a recomputation reads them
    cp: int = 1                    # context-parallel ranks: every activation split along the sequence
    cp_layout: str = "zigzag"      # "zigzag" (rank r holds chunks r and 2cp - 1 - r) or "contiguous"
    cp_comm: str = "ring"          # "ring" (K/V passed round), "ring_overlap" (each hop sent while the block before
    #                                computes) or "allgather" (K/V gathered once per layer)
    cp_keep_kv: bool = False       # allgather: keep the other ranks' K/V for the recomputation and backward
    zero: int = 0                  # ZeRO stage over the dp (x ep x cp) ranks: 1, 2 or 3 (0: plain data parallelism)
    keep_gathered: bool = False    # zero=3: a recomputed layer's gather kept for its backward ("step": zero_inventory)
    prefetch: bool = True          # zero=3: the next use's parameters gathered while this one computes
    steps: int = 0                 # zero: AdamW steps on the shards (0: forward and backward only)
    batches: list = None           # zero: one AdamW step on each (input_ids, targets) in turn, in place of steps
    lr: float = 3e-3               # zero, steps > 0: AdamW's (picockpt/train.py: make_optimizer)
    weight_decay: float = 0.0
    measure: bool = True           # live bytes and FLOPs too (slower); False: store bytes and times only
    rng_state: torch.Tensor = None  # the generator state to start from; None: the caller's now

    @property
    def world_size(self):
        return self.dp * self.pp * self.ep * self.tp * self.cp


# ---- the checks, before any rank starts ------------------------------------------------------------------
# What does not stack yet, in one place: (refused when, what it is, why, what works). Every other combination of
# dp, pp, tp (sp), cp, ep and zero runs in the one rank step.
NOT_YET = [
    (lambda job: job.cp > 1 and job.ep > 1, lambda job: f"cp={job.cp} with ep={job.ep}",
     "a rank's experts would receive the tokens of its sequence chunks, and the routing and its closed forms are "
     "by whole rows", "use cp with tp, dp, zero and pp, or ep without cp"),
    (lambda job: job.cp_keep_kv and (job.pp > 1 or job.microbatches > 1 or job.tp > 1),
     lambda job: f"cp_keep_kv=True with {given(job, 'pp', 'microbatches', 'tp')}",
     "the kept K/V are closed-formed for one micro-batch per rank without tp", "use it with pp=1, microbatches=1 "
     "and tp=1"),
    (lambda job: job.ep > 1 and job.distribute_saved, lambda job: f"ep={job.ep} with distribute_saved=True",
     "its closed forms split no expert-parallel checkpoint", "leave distribute_saved out with ep"),
    (lambda job: job.virtual_stages > 1 and (job.zero or job.ep > 1 or job.cp > 1),
     lambda job: f"schedule='interleaved' with {given(job, 'zero', 'ep', 'cp')}",
     "ZeRO's, ep's and cp's closed forms are per stage, not per chunk", "interleave with dp and tp (sp)"),
    (lambda job: job.schedule == "zb-h1" and job.cfg.experts > 0, lambda job: f"schedule='zb-h1' with experts",
     "a mixture of experts' weight gradients are not deferred apart from its input gradient",
     "use zb-h1 with a dense model, or 1f1b"),
    (lambda job: job.zero and (job.steps > 1 or len(job.batches or ()) > 1) and job.pp > 1 and job.cfg.draws_random,
     lambda job: f"{job.steps or len(job.batches)} steps with pp={job.pp} and dropout",
     "the next step's first stage would need the generator state the last stage ends with",
     "train with pp=1, or dropout=0"),
]


def given(job, *names):
    """'ep=2, cp=2': those of the names whose value is not the default (0 or 1), as the caller gave them."""
    return ", ".join(f"{name}={getattr(job, name)}" for name in names if getattr(job, name) not in (0, 1))


# Switches that change only what a recomputation does: under a policy that recomputes nothing they would do nothing.
RECOMPUTE_SWITCHES = {"distribute_saved": "each tp rank keeps 1/t of a checkpoint, all-gathered to recompute",
                      "recompute_early": "a waiting stage recomputes its top segment early",
                      "keep_gathered": "a recomputed layer's gathered parameters are kept for its backward",
                      "keep_dispatched": "a recomputed layer reads the rows it dispatched instead of dispatching again"}


def checked_job(job, device, world_size):
    """The job with its policy parsed and batch checked; a ValueError naming the value before any rank starts."""
    check_flags(job)
    check_schedule(job.schedule, job.virtual_stages, job.pp)
    for refused, what, why, works in NOT_YET:
        if refused(job):
            raise ValueError(f"{what(job)} is not supported yet: {why}; {works}")
    job = checked_batch(job, device)
    cfg, policy, (B, T), M = job.cfg, parse_policy(job.policy, job.cfg), job.input_ids.shape, job.microbatches
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"microbatches={M!r}: use a whole number of micro-batches per step, 1 or more")
    check_layout(job.dp, job.pp, job.tp, None, job.ep, job.cp)  # each a whole number >= 1
    split = [name for name in ("dp", "pp", "ep", "tp", "cp") if getattr(job, name) > 1]
    check_rank_count(split[0] if len(split) == 1 else "dp x pp x ep x tp x cp", job.world_size, device)  # torchrun
    check_layout(job.dp, job.pp, job.tp, world_size, job.ep, job.cp)
    stage_layers(cfg.layers, job.pp)
    if policy.segment is None and policy.budget is None and policy.op_level is None:  # none: nothing recomputed
        for name, what in RECOMPUTE_SWITCHES.items():
            if getattr(job, name):
                raise ValueError(f"{name}=True with policy {policy.text!r}: it changes what a recomputation does "
                                 f"({what}), and policy {policy.text!r} recomputes nothing; use a policy that "
                                 f"recomputes (full, every:C, budget:SIZE), or leave {name} out")
    if job.schedule == "interleaved":
        check_interleaving(job.pp, M, job.virtual_stages, cfg.layers)
    check_segment(policy.segment, policy.text, cfg.layers, job.pp, job.virtual_stages)
    if job.recompute_early and job.pp == 1:
        raise ValueError("recompute_early=True without pp: it recomputes a stage's top segment while the stage "
                         "waits for its gradient; use it with pp >= 2, or leave it out")
    check_context_job(job, policy, device)  # context_parallel/cp_check.py
    check_zero_job(job)  # data_parallel/zero_check.py
    if not job.overlap and job.dp * job.ep * job.cp == 1:
        raise ValueError("overlap=False with dp=1, ep=1 and cp=1: it all-reduces the gradients after the backward "
                         "instead of as each is final, and there are no replicas to reduce over; set dp >= 2, or "
                         "leave overlap out")
    if job.keep_dispatched and job.ep == 1:
        raise ValueError("keep_dispatched=True with ep=1: it keeps the rows an expert-parallel layer dispatched to "
                         "other ranks; set ep > 1, or leave keep_dispatched out")
    if B % (job.dp * M):
        raise ValueError(f"batch={B} is not divisible into dp x microbatches = {job.dp} x {M} = {job.dp * M} "
                         f"micro-batches of equal size; use a batch that is a multiple of {job.dp * M}")
    if job.ep > 1:
        check_expert_parallel(cfg, job.ep, B // (job.dp * M), job.policy, job.dp * M > 1)
    if job.tp > 1:
        check_tensor_parallel(cfg, job.tp, job.sp, T // job.cp, job.distribute_saved, experts=True)  # T/cp tokens
    if job.dp * M > 1:
        if cfg.attention == "tiled" and cfg.dropout > 0:
            raise ValueError(f"attention='tiled' with dropout={cfg.dropout} and dp x microbatches = {job.dp * M}: each "
                             f"tile's mask comes from a generator seeded by the tile's index at a micro-batch's shape, "
                             f"so no micro-batch's masks are rows of the single process's; use attention='eager', "
                             f"dropout=0, or one micro-batch on one replica")
        if cfg.router_jitter > 0:
            raise ValueError(f"router_jitter={cfg.router_jitter} with dp x microbatches = {job.dp * M}: the jitter "
                             f"noise is drawn at a micro-batch's shape, not sliced from the whole batch's; use "
                             f"router_jitter=0 or one micro-batch on one replica")
    failed = []  # an impossible budget says which stage it does not fit, before any rank starts
    for stage in range(job.pp):
        try:
            closed_forms(replace(job, policy=policy.text), stage)
        except ValueError as error:
            if job.pp == 1:
                raise
            failed.append((stage, error))
    if failed:  # the largest need over every stage at once: following it, no other stage fails next
        stage, error = max(failed, key=lambda one: getattr(one[1], "least", -1))
        layers = ", ".join(f"{r[0]}..{r[-1]}" for r in rank_layers(cfg.layers, job.pp, stage, job.virtual_stages))
        others = [s for s, _ in failed if s != stage]
        also = f" (the largest need of the {job.pp} stages; stage{'s' if len(others) > 1 else ''} " \
            f"{', '.join(map(str, others))}, short of this budget too, need{'' if len(others) > 1 else 's'} less)" \
            if others else ""
        raise ValueError(f"stage {stage} (layers {layers}): {error}{also}") from None
    return replace(job, sp=bool(job.sp), distribute_saved=bool(job.distribute_saved))


def closed_forms(job, stage):
    """The closed forms of one stage's rank (pipeline_parallel/pp_inventory.py), on its T/cp tokens; under cp a
    budget plans with the communication a recomputed layer repeats (cp_inventory.recompute_comm_flops); under
    interleaving its chunks' (RankForms)."""
    (B, T), cp, V = job.input_ids.shape, job.cp, job.virtual_stages
    ring = recompute_comm_flops(job.cfg, B // (job.dp * job.microbatches), T, cp, job.cp_comm, job.cp_keep_kv, job.tp)
    return rank_forms(job.cfg, B, T // cp, job.policy, job.pp, job.microbatches, job.schedule, stage, job.dp,
                      job.tp, job.sp, job.distribute_saved, ring, V)


def check_flags(job):
    """Counts are numbers, not True (each layout checks its own values), and switches True or False, not
    "no": a ValueError naming the argument, before anything else."""
    for name in ("tp", "pp", "microbatches", "dp", "ep", "cp", "zero", "steps"):
        if isinstance(getattr(job, name), bool):
            raise ValueError(f"{name}={getattr(job, name)!r}: give a whole number of ranks (micro-batches for "
                             f"microbatches), 1 or more, not True or False")
    for name in ("sp", "distribute_saved", "recompute_early", "overlap", "keep_dispatched", "prefetch",
                 "cp_keep_kv"):
        if not isinstance(getattr(job, name), bool):
            yes, no = (" (keep the dispatched rows)", " (dispatch them again when recomputing)") \
                if name == "keep_dispatched" else ("", "")
            raise ValueError(f"{name}={getattr(job, name)!r}: use True{yes} or False{no}")


def checked_batch(job, device):
    """The job with its policy parsed (canonical text), params and batch checked, and the generator state
    its ranks start from (the caller's now, unless the job names one). ValueError before any rank starts."""
    layout = "a parallel layout"
    policy = parse_policy(job.policy, job.cfg).refuse_offload(layout).refuse_recast(layout)
    check_params(job.params, job.cfg)
    input_ids, targets = check_batch(job.cfg, job.input_ids, job.targets, job.params)
    state = job.rng_state if job.rng_state is not None else ranks_generator(device).get_state()
    batches = None
    if job.batches is not None:  # training: one step per batch, every one of the first batch's shape
        if not isinstance(job.batches, (list, tuple)) or not job.batches:
            raise ValueError(f"batches={type(job.batches).__name__}: give a non-empty list of (input_ids, targets), "
                             f"one (batch, seq) pair per step")
        batches = []
        for step, pair in enumerate(job.batches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"batches[{step}] is a {type(pair).__name__}: each step's batch is one pair "
                                 f"(input_ids, targets)")
            try:
                ids, tgt = check_batch(job.cfg, *pair, job.params)
            except ValueError as error:
                raise ValueError(f"batches[{step}]: {error}") from None
            if ids.shape != input_ids.shape:
                raise ValueError(f"batches[{step}] is {tuple(ids.shape)}, the first {tuple(input_ids.shape)}: every "
                                 f"step's batch must have one (batch, seq) shape (the ranks plan one schedule and "
                                 f"split every batch alike); draw them all at one shape")
            batches.append((ids, tgt))
    return replace(job, input_ids=input_ids, targets=targets, policy=policy.text, rng_state=state, batches=batches)


# ---- what the ranks are sent ----------------------------------------------------------------------------------
def on_cpu(job):
    """The job as the ranks receive it: parameters, batch and generator state on the CPU."""
    params = {name: tensor.detach().cpu() for name, tensor in job.params.items()}
    batches = [(ids.cpu(), tgt.cpu()) for ids, tgt in job.batches] if job.batches else None
    return replace(job, params=params, input_ids=job.input_ids.cpu(), targets=job.targets.cpu(), batches=batches,
                   rng_state=job.rng_state.cpu())
