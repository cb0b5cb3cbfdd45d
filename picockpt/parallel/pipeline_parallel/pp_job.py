"""The pipeline-, data- and tensor-parallel step, called as the single-process one is: full params and
batch in, the loss, full gradients and one report per rank out.

    from picockpt import parallel
    loss, grads, ranks = parallel.loss_and_grads(params, cfg, ids, targets, policy="full", pp=2, microbatches=4,
                                                 schedule="1f1b", dp=1)
    ranks[r]["peak_activation_bytes"] == ranks[r]["predicted_activation_bytes"]   # to the byte, per stage
    ranks[r]["timeline_seconds"]     # forward, recompute, backward, wait, send, reduce, idle, total

dp x pp x tp processes (picockpt/parallel/layout.py): spawned gloo ranks on 127.0.0.1, or torchrun's.
The caller's process checks everything first (a user mistake is a ValueError before any rank starts),
each rank runs its stage (picockpt/parallel/pipeline_parallel/pp_rank.py), and the caller puts the stages' (and tensor-
parallel ranks') gradients back together under the full model's names; the loss is the sum of the
last stage's micro-batch shares over the data-parallel replicas. A tied LM head's gradient is the sum
of the first stage's (embedding) and the last stage's (head) uses, added here.

A rank's report: rank, stage, dp_rank, tp_rank, pp, dp, tp, sp, microbatches, schedule, policy,
stage_schedule (where a budget's schedule came from), layers [first, last], microbatches_in_flight;
peak_activation_bytes (all its micro-batches' stores at once) and predicted_activation_bytes;
microbatch_stored_bytes (what one micro-batch holds after its forward) and its predicted_; the
time-weighted mean_activation_bytes; peak_live_bytes; flops and predicted_flops by phase; p2p_bytes
and predicted_p2p_bytes (sent and received, forward and backward); comm_bytes and predicted_comm_bytes
(tensor-parallel collectives, by phase); dp_bytes and predicted_dp_bytes; timeline (kind, micro-batch,
start, end), timeline_start, timeline_seconds, computing_seconds (forward + recompute + backward), step_seconds
(the first rank's start to the last rank's end, on one clock) and bubble (1 - computing / step) against
predicted_bubble, (P - 1) / (M + P - 1); dp_buckets (bucket, bytes, launched, seen complete).
"""
import os
from dataclasses import dataclass, replace

import torch

from ...params import EMBED, HEAD
from ...policy import parse_policy
from ..job import checked_batch, on_cpu, ranks_generator
from ..launch import run_ranks, under_torchrun
from ..layout import check_layout
from .pp_rank import rank_steps, stage_param_names
from .pp_inventory import StageForms
from .pp_schedules import bubble_fraction, check_schedule, stage_layers
from ..tensor_parallel.tp_shard import check_tensor_parallel, gather_grads, split_dim


@dataclass
class PipelineJob:
    """One step for the ranks to run: the full params and batch, the policy, the layout and the schedule."""
    params: dict
    cfg: object
    input_ids: torch.Tensor
    targets: torch.Tensor
    policy: str = "full"
    pp: int = 2
    microbatches: int = 1
    schedule: str = "1f1b"
    dp: int = 1
    tp: int = 1
    sp: bool = True
    distribute_saved: bool = False
    recompute_early: bool = False
    overlap: bool = True           # data parallel: all-reduce each bucket as soon as it is final
    measure: bool = True           # live bytes and FLOPs too (slower); False: store bytes and times only
    rng_state: torch.Tensor = None  # the generator state to start from; None: the caller's now


def run_pipeline_steps(jobs, world_size=None, device="cpu", timeout_s=120, port=None, start_method="spawn",
                       trace=False):
    """[(loss, grads, reports)] of every PipelineJob, all run by one launch of world_size ranks (each
    job's dp x pp x tp must be world_size; None: the first job's, or torchrun's WORLD_SIZE)."""
    if not jobs:
        raise ValueError("jobs=[]: give at least one PipelineJob")
    if world_size is None:
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else jobs[0].dp * jobs[0].pp * jobs[0].tp
    jobs = [checked_job(job, device, world_size) for job in jobs]
    sent = [on_cpu(job) for job in jobs]  # what the ranks receive; each moves it to its own device
    results = run_ranks(rank_steps, None if under_torchrun() else world_size, sent, trace, device=device,
                        timeout_s=timeout_s, port=port, start_method=start_method)
    out, state = [], jobs[-1].rng_state
    for index, job in enumerate(jobs):
        per_rank = [rank_results[index] for rank_results in results]
        last = [r for r in per_rank if r["report"]["stage"] == job.pp - 1 and r["report"]["tp_rank"] == 0]
        loss = last[0]["loss"]
        for r in last[1:]:  # the data-parallel replicas' shares of the mean
            loss = loss + r["loss"]
        device_of = job.params[EMBED].device
        grads = _gathered(job, per_rank)
        reports = [dict(r["report"], **_predicted(job, r["report"]["stage"])) for r in per_rank]
        start = min(r["timeline_start"] for r in reports)  # the step: the first rank's start to the last one's end
        step = max(r["timeline_start"] + r["timeline_seconds"]["total"] for r in reports) - start
        for r in reports:  # a rank's bubble counts the whole step: a stage done early idles until the others are
            r["step_seconds"], r["bubble"] = step, 1.0 - r["computing_seconds"] / step if step > 0 else 0.0
        out.append((loss.to(device_of), {name: grad.to(job.params[name].dtype).to(device_of)
                                         for name, grad in grads.items()}, reports))
        state = last[0]["rng_state"] if last[0]["rng_state"] is not None else state
    ranks_generator(device).set_state(state)
    return out


def _gathered(job, per_rank):
    """The full gradients: each stage's from its dp rank 0, tensor-parallel slices put together."""
    cfg, grads, head_copy = job.cfg, {}, None
    for stage, layers in enumerate(stage_layers(cfg.layers, job.pp)):
        names = stage_param_names(cfg, layers, stage == 0, stage == job.pp - 1)
        ranks = sorted((r["report"]["tp_rank"], r["grads"]) for r in per_rank
                       if r["report"]["stage"] == stage and r["report"]["dp_rank"] == 0)
        parts = [g for _, g in ranks]
        whole = gather_grads(parts, dict.fromkeys(names)) if job.tp > 1 else parts[0]
        if cfg.tie_embeddings and stage == job.pp - 1:
            head_copy = whole.pop(HEAD)
        grads.update(whole)
    if cfg.tie_embeddings:  # one matrix read twice: its gradient is the sum of both uses (as the engine adds them)
        grads[EMBED] = grads[EMBED] + head_copy
        grads[HEAD] = grads[EMBED]
    return {name: grads[name] for name in job.params if name in grads}


def _predicted(job, stage):
    B, T = job.input_ids.shape
    forms = StageForms(job.cfg, B, T, job.policy, job.pp, job.microbatches, job.schedule, stage, job.dp, job.tp,
                       job.sp, job.distribute_saved)
    state_bytes = job.rng_state.numel() if job.cfg.draws_random else 0
    names = stage_param_names(job.cfg, forms.layers, forms.first, forms.last)
    param_bytes = sum(job.params[EMBED if name == HEAD and job.cfg.tie_embeddings else name].numel()
                      // (job.tp if job.tp > 1 and split_dim(name) is not None else 1) for name in names)
    param_bytes *= torch.empty((), dtype=job.cfg.param_dtype).element_size()
    return {"predicted_activation_bytes": forms.peak_bytes,
            "predicted_microbatch_stored_bytes": forms.microbatch_stored_bytes,
            "predicted_flops": forms.flops(), "predicted_p2p_bytes": forms.p2p_bytes(state_bytes),
            "predicted_comm_bytes": forms.tp_comm_bytes(),
            "predicted_dp_bytes": param_bytes if job.dp > 1 else 0,
            "predicted_bubble": bubble_fraction(job.pp, job.microbatches)}


def checked_job(job, device, world_size):
    """The job with its policy parsed and batch checked; a ValueError naming the value before any rank starts."""
    job = checked_batch(job, device)
    cfg, policy, input_ids = job.cfg, parse_policy(job.policy, job.cfg), job.input_ids
    check_schedule(job.schedule)
    M = job.microbatches
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"microbatches={M!r}: use a whole number of micro-batches per step, 1 or more")
    check_layout(job.dp, job.pp, job.tp, world_size)
    stage_layers(cfg.layers, job.pp)
    B, T = input_ids.shape
    if B % (job.dp * M):
        raise ValueError(f"batch={B} is not divisible into dp x microbatches = {job.dp} x {M} = {job.dp * M} "
                         f"micro-batches of equal size; use a batch that is a multiple of {job.dp * M}")
    if job.tp > 1:
        check_tensor_parallel(cfg, job.tp, job.sp, T, job.distribute_saved)
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
    for stage, layers in enumerate(stage_layers(cfg.layers, job.pp)):
        try:  # an impossible budget says which stage it does not fit, before any rank starts
            StageForms(cfg, B, T, policy.text, job.pp, M, job.schedule, stage, job.dp, job.tp, job.sp,
                       job.distribute_saved)
        except ValueError as error:
            raise ValueError(f"stage {stage} (layers {layers[0]}..{layers[-1]}): {error}") from None
    return replace(job, sp=bool(job.sp), distribute_saved=bool(job.distribute_saved))

