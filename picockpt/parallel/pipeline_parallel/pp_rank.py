"""One rank's step of a pipeline-parallel (and data-, and tensor-parallel) job: its stage's micro-batches,
forwards and backwards in the schedule's order, each one the engine's own loop.

    for action in actions(schedule, P, M, stage):          # picockpt/parallel/pipeline_parallel/pp_schedules.py
        if action.kind == "F":                              # a Step per micro-batch (picockpt/engine.py)
            steps[m] = Step(stage.microbatch(m, ...), schedule, drop, memory.for_microbatch(m))
            steps[m].forward()                              # receive x, layers, send y (or head and loss)
        else:
            steps.pop(m).backward()                         # receive dy, recompute, backward, send dx

What a rank holds: its stage's layers (and the embedding on the first stage, the final norm and head
on the last), its tensor-parallel slices of them when tp > 1, its data-parallel replica's 1/dp of the
batch. picockpt/parallel/pipeline_parallel/pp_job.py is the caller's side: checks, launch, gradients put together.

recompute-early: a stage before the last, about to wait for a micro-batch's output gradient, first
recomputes that micro-batch's top segment (picockpt/parallel/pipeline_parallel/pp_stage.py: recompute_top), so the
recomputation fills part of the wait. The store holds exactly what it would hold once the gradient
is in (the same peak); the recomputed activations are held during the rest of the wait instead of
not yet existing: the price is in time held, which the report gives as the time-weighted mean of the
stored bytes ("mean_activation_bytes"), and a received gradient's buffer allocated before the
recomputation instead of after it (in "peak_live_bytes").
"""
import torch
import torch.distributed as dist

from ...engine import Model, Step, device_generator
from ...ops.cross_entropy import IGNORE_INDEX
from ...params import EMBED, FINAL_NORM, HEAD, param_shapes
from ...tracker import Tracker
from ..comm import CommLog
from ..job import PHASES, trace_lines
from ..data_parallel.dp_comm import GradientBuckets
from ..layout import Layout, build_groups
from .pp_comm import Pipe
from .pp_inventory import StageForms
from .pp_schedules import actions
from ..tensor_parallel.tp_shard import shard_params
from .pp_stage import PipelineStage, bucket_names
from ..timeline import StageMemory, Timeline
from ..tensor_parallel.tp_model import TensorParallelModel


def stage_param_names(cfg, layers, first, last):
    """The parameters a stage holds, under the full model's names (a tied LM head: the embedding's matrix,
    held by the last stage as lm_head.weight; the caller sums its gradient into the embedding's)."""
    names = [EMBED] if first else []
    prefixes = tuple(f"model.layers.{k}." for k in layers)
    names += [name for name in param_shapes(cfg) if name.startswith(prefixes)]
    if last:
        names += [FINAL_NORM, HEAD]
    return names


def first_receive(action, groups):
    """The neighbour an action first receives from (F: the previous stage, B: the next), None if none:
    a send just before it goes out with that receive, as one group (pp_comm.py)."""
    if action is None:
        return None
    return groups.previous if action.kind == "F" else groups.next


def rank_steps(comm, jobs, trace=False):
    made = {}  # process groups, per layout, made once per launch
    return [rank_step(comm, job, made, trace) for job in jobs]


def rank_step(comm, job, made, trace=False):
    """One job on this rank; returns CPU tensors and plain numbers only."""
    layout = Layout(job.dp, job.pp, job.tp)
    groups = build_groups(layout, comm.rank, comm.device, made, comm.timeout)
    cfg, device = job.cfg, comm.device
    B, T = job.input_ids.shape
    forms = StageForms(cfg, B, T, job.policy, job.pp, job.microbatches, job.schedule, groups.stage, job.dp, job.tp,
                       job.sp, job.distribute_saved)
    names = stage_param_names(cfg, forms.layers, forms.first, forms.last)
    params = {name: job.params[EMBED if name == HEAD and cfg.tie_embeddings else name] for name in names}
    params = shard_params(params, groups.tp_rank, job.tp, device) if job.tp > 1 else \
        {name: tensor.to(device) for name, tensor in params.items()}
    input_ids, targets = job.input_ids.to(device), job.targets.to(device)
    counted = int((targets != IGNORE_INDEX).sum())  # N: the whole batch's counted targets
    b, M = forms.b, job.microbatches

    def rows(m):  # micro-batch m of this replica: rows (d*M + m)*b .. of the whole batch
        start = (groups.dp_rank * M + m) * b
        return input_ids[start:start + b], targets[start:start + b]

    def make_inner(ids, tgt):
        if job.tp == 1:
            return Model(params, cfg, ids, tgt)
        return TensorParallelModel(params, cfg, ids, tgt, groups.tp_comm, job.sp, job.distribute_saved)

    generator = device_generator(device)
    generator.set_state(job.rng_state)
    say = trace_lines(f"rank {comm.rank} stage {groups.stage}", trace)
    dist.barrier()  # every rank's timeline starts at the same moment
    with Tracker(device, physical=job.measure, flops=job.measure) as tracker, torch.no_grad():
        timeline = Timeline(device)
        memory = StageMemory(tracker, timeline)
        pipe = Pipe(groups.previous, groups.next, device, timeline, tracker)
        for group in (groups.tp_comm, groups.dp_comm):
            if group is not None:
                group.tracker, group.log = tracker, CommLog()  # this step's bytes only
        buckets = GradientBuckets(bucket_names(cfg, params, forms.layers, forms.first, forms.last),
                                  {name: tensor.shape for name, tensor in params.items()}, cfg.param_dtype, device,
                                  groups.dp_comm, job.overlap, timeline, tracker)
        stage = PipelineStage(cfg, params, forms.layers, forms.first, forms.last, pipe, buckets, counted, M,
                              groups.dp_rank, job.dp, forms.activation_shape(), make_inner, job.recompute_early)
        stage.rng_start = job.rng_state if forms.first else None
        stage.start(tracker, device, T)
        timeline.begin()
        steps, loss = {}, None
        order = actions(job.schedule, job.pp, M, groups.stage)
        for index, action in enumerate(order):
            m = action.microbatch
            pipe.pair_with = first_receive(order[index + 1] if index + 1 < len(order) else None, groups)
            if action.kind == "F":
                model = stage.microbatch(m, *rows(m))
                step = model.step = Step(model, forms.schedule, forms.policy.drop, memory.for_microbatch(m), say)
                part = step.forward()  # this micro-batch's share of the whole batch's mean (last stage)
                loss = part if loss is None else loss + part
                memory.end_of_forward[m] = memory.held.get(m, 0)
                steps[m] = step
            else:
                steps.pop(m).backward()
        pipe.finish()
        buckets.finish()
        timeline.finish()
        rng_end = stage.rng_end  # the generator where the single process's step leaves it (last stage)
        del stage, steps
    for group in (groups.tp_comm, groups.dp_comm):
        if group is not None:
            group.tracker = None
    report = _report(job, forms, groups, tracker, timeline, memory, pipe, buckets)
    grads = {name: grad.cpu() for name, grad in buckets.grads().items()} if groups.dp_rank == 0 else None
    rng_state = rng_end if cfg.draws_random else job.rng_state
    return {"loss": loss.cpu() if forms.last else None, "grads": grads, "report": report,
            "rng_state": rng_state.cpu() if forms.last and rng_state is not None else None}


def _report(job, forms, groups, tracker, timeline, memory, pipe, buckets):
    seconds = timeline.totals()
    busy = seconds["forward"] + seconds["recompute"] + seconds["backward"]
    tp_log = groups.tp_comm.log if groups.tp_comm is not None else CommLog()
    dp_log = groups.dp_comm.log if groups.dp_comm is not None else CommLog()
    return {
        "rank": groups.rank, "stage": groups.stage, "dp_rank": groups.dp_rank, "tp_rank": groups.tp_rank,
        "pp": job.pp, "dp": job.dp, "tp": job.tp, "sp": job.sp and job.tp > 1, "microbatches": job.microbatches,
        "schedule": job.schedule, "policy": forms.policy.text, "stage_schedule": forms.source,
        "layers": [forms.layers[0], forms.layers[-1]], "microbatches_in_flight": forms.in_flight,
        "recompute_early": job.recompute_early, "overlap": job.overlap,
        "peak_activation_bytes": tracker.peak_logical,
        "microbatch_stored_bytes": memory.end_of_forward.get(0, 0),  # what micro-batch 0 held after its forward
        "mean_activation_bytes": memory.mean_bytes(),
        "peak_live_bytes": tracker.peak_physical if job.measure else None,
        "flops": {phase: tracker.flops[phase] for phase in PHASES} if job.measure else None,
        "p2p_bytes": {phase: dict(pipe.log.bytes.get(phase, {})) for phase in ("forward", "backward")},
        "p2p_posted": pipe.posted,  # every group of sends and receives, in the order posted
        "comm_bytes": {phase: tp_log.total(phase) for phase in PHASES},
        "dp_bytes": dp_log.total(),
        "timeline_start": timeline.start,
        "timeline": timeline.relative(),
        "timeline_seconds": seconds,
        "computing_seconds": busy,
        "dp_buckets": [(str(bucket), nbytes, start - timeline.start, end - timeline.start)
                       for bucket, nbytes, start, end in buckets.events],
    }

