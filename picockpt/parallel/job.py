"""The caller's side of every layout, written once: one job holds the whole layout (dp x pp x ep x cp x tp), is
checked before any rank starts (checked_job: a ValueError naming the argument) and is sent to the ranks on the CPU
(on_cpu). Every rank starts from the caller's generator state (or the job's rng_state), so its dropout masks are
rows or slices of the single process's (rng.py). step.py launches the ranks; each runs rank.py.
"""
from dataclasses import KW_ONLY, dataclass, replace

import torch

from ..model.batch import check_batch
from ..model.params import check_params
from ..recompute.policy import parse_policy
from .context_parallel import cp_check
from .context_parallel.cp_forms import recompute_comm_flops
from .data_parallel import dp_check
from .expert_parallel import ep_check
from .launch import check_rank_count, ranks_generator
from .layout import Layout, check_layout
from .pipeline_parallel import pp_check
from .pipeline_parallel.pp_forms import rank_forms
from .pipeline_parallel.pp_schedules import check_schedule, rank_layers, stage_layers
from .tensor_parallel import tp_check


@dataclass
class ParallelJob:
    """One step for the ranks to run: the full params and batch, the policy, the layout (layout.py: the dimensions
    and their options)."""
    params: dict
    cfg: object
    input_ids: torch.Tensor
    targets: torch.Tensor
    policy: str = "full"
    layout: Layout = Layout()
    _: KW_ONLY
    steps: int = 0                 # zero: AdamW steps on the shards (0: forward and backward only)
    batches: list = None           # zero: one AdamW step on each (input_ids, targets) in turn, in place of steps
    lr: float = 3e-3               # zero, steps > 0: AdamW's (picockpt/measurement/train.py: make_optimizer)
    weight_decay: float = 0.0
    measure: bool = True           # live bytes and FLOPs too (slower); False: store bytes and times only
    rng_state: torch.Tensor = None  # the generator state to start from; None: the caller's now

    @property
    def world_size(self):
        return self.layout.world_size


# The checks, before any rank starts. Each dimension says what it refuses, beside its wrap: its values, its flags
# without it, and what it does not stack with yet (one line naming both dimensions). Every other combination of dp,
# pp, tp (sp), cp, ep and zero runs in the one rank step.
DIMENSIONS = (pp_check, cp_check, dp_check, ep_check, tp_check)

# Switches that change only what a recomputation does: under a policy that recomputes nothing they would do nothing.
RECOMPUTE_SWITCHES = {"distribute_saved": "each tp rank keeps 1/t of a checkpoint, all-gathered to recompute",
                      "recompute_early": "a waiting stage recomputes its top segment early",
                      "keep_gathered": "a recomputed layer's gathered parameters are kept for its backward",
                      "keep_dispatched": "a recomputed layer reads the rows it dispatched instead of dispatching again"}


def checked_job(job, device, world_size):
    """The job with its policy parsed (once) and batch checked; a ValueError naming the value before any rank starts."""
    check_flags(job)
    check_schedule(job.layout.schedule, job.layout.virtual_stages, job.layout.pp)
    policy = parse_policy(job.policy, job.cfg).refuse_offload("a parallel layout").refuse_recast("a parallel layout")
    job = checked_batch(replace(job, policy=policy.text), device)
    check_ranks(job, device, world_size)
    if policy.segment is None and policy.budget is None and policy.op_level is None:  # none: nothing recomputed
        for name, what in RECOMPUTE_SWITCHES.items():
            if getattr(job.layout, name):
                raise ValueError(f"{name}=True with policy {policy.text!r}: it changes what a recomputation does "
                                 f"({what}), and policy {policy.text!r} recomputes nothing; use a policy that "
                                 f"recomputes (full, every:C, budget:SIZE), or leave {name} out")
    for dimension in DIMENSIONS:  # pipeline_parallel/pp_check.py, context_parallel/cp_check.py, ...
        dimension.refuses(job, policy, device)
    check_budget(job, policy)
    return job


def check_ranks(job, device, world_size):
    """Whole numbers of micro-batches and ranks, as many ranks as the layout's product, a layer for every stage."""
    layout = job.layout
    check_layout(layout)  # each a whole number >= 1
    split = [name for name in ("dp", "pp", "ep", "tp", "cp") if getattr(layout, name) > 1]
    check_rank_count(split[0] if len(split) == 1 else "dp x pp x ep x tp x cp", job.world_size, device)  # torchrun
    check_layout(layout, world_size)
    stage_layers(job.cfg.layers, layout.pp)


def check_budget(job, policy):
    """An impossible budget says which stage it does not fit, before any rank starts: the largest need over every
    stage at once (following it, no other stage fails next)."""
    layout, failed = job.layout, []
    for stage in range(layout.pp):
        try:
            layer_forms(replace(job, policy=policy), stage)
        except ValueError as error:
            if layout.pp == 1:
                raise
            failed.append((stage, error))
    if failed:
        stage, error = max(failed, key=lambda one: getattr(one[1], "least", -1))
        layers = ", ".join(f"{r[0]}..{r[-1]}"
                           for r in rank_layers(job.cfg.layers, layout.pp, stage, layout.virtual_stages))
        others = [s for s, _ in failed if s != stage]
        also = f" (the largest need of the {layout.pp} stages; stage{'s' if len(others) > 1 else ''} " \
            f"{', '.join(map(str, others))}, short of this budget too, need{'' if len(others) > 1 else 's'} less)" \
            if others else ""
        raise ValueError(f"stage {stage} (layers {layers}): {error}{also}") from None


def layer_forms(job, stage):
    """The closed forms of one stage's rank (pp_forms.py) on its T/cp tokens; under cp a budget plans with the
    communication a recomputed layer repeats (recompute_comm_flops); interleaved, its chunks' (InterleavedForms)."""
    (B, T), layout = job.input_ids.shape, job.layout
    ring = recompute_comm_flops(job.cfg, B // (layout.dp * layout.microbatches), T, layout.cp, layout.cp_comm,
                                layout.cp_keep_kv, layout.tp)
    return rank_forms(job.cfg, B, T // layout.cp, job.policy, layout, stage, ring)


def check_flags(job):
    """Counts are numbers, not True (each layout checks its own values), and switches True or False, not
    "no": a ValueError naming the argument, before anything else."""
    if not isinstance(job.layout, Layout):
        raise ValueError(f"layout={job.layout!r}: give a picockpt.parallel.Layout, e.g. Layout(tp=2) or "
                         f"Layout(dp=2, pp=2, microbatches=4)")
    fields = {**vars(job.layout), "steps": job.steps}
    for name in ("tp", "pp", "microbatches", "dp", "ep", "cp", "zero", "steps"):
        if isinstance(fields[name], bool):
            raise ValueError(f"{name}={fields[name]!r}: give a whole number of ranks (micro-batches for "
                             f"microbatches), 1 or more, not True or False")
    for name in ("sp", "distribute_saved", "recompute_early", "overlap", "keep_dispatched", "prefetch", "cp_keep_kv"):
        if not isinstance(fields[name], bool):
            yes, no = (" (keep the dispatched rows)", " (dispatch them again when recomputing)") \
                if name == "keep_dispatched" else ("", "")
            raise ValueError(f"{name}={fields[name]!r}: use True{yes} or False{no}")


def checked_batch(job, device):
    """The job with its params and batch checked, and the generator state its ranks start from (the caller's now,
    unless the job names one). ValueError before any rank starts."""
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
    return replace(job, input_ids=input_ids, targets=targets, rng_state=state, batches=batches)


def on_cpu(job):
    """The job as the ranks receive it: parameters, batch and generator state on the CPU."""
    params = {name: tensor.detach().cpu() for name, tensor in job.params.items()}
    batches = [(ids.cpu(), tgt.cpu()) for ids, tgt in job.batches] if job.batches else None
    return replace(job, params=params, input_ids=job.input_ids.cpu(), targets=job.targets.cpu(), batches=batches,
                   rng_state=job.rng_state.cpu())
