"""One rank's step of any layout, dp x pp x ep x cp x tp: its stage's micro-batches, forwards and backwards in the
schedule's order, each one the engine's own loop over a model whose layers cross ranks where its layout says
(inner_model: each dimension applied over the ones before); data parallelism or ZeRO wraps the stage alike
(dp_model.py). rank_one_step reads top to bottom as the composition.

A rank holds its stage's layers (the embedding on the first stage, final norm and head on the last), its
tensor-parallel slices of them, its experts, and its rows of the batch: micro-batch m of replica d is the block
d*M + m of B / (dp M) sequences, split over the ep ranks, and under cp its tokens of those rows (cp_layout.py).
recompute_early holds the same peak longer ("mean_activation_bytes") and allocates the received gradient's buffer
before the recomputation (in "peak_live_bytes").
"""
import sys

import torch

from ..recompute.engine import device_generator
from ..ops.cross_entropy import IGNORE_INDEX
from ..model.params import EMBED, HEAD, param_shapes
from .context_parallel.cp_layout import SequenceLayout
from .context_parallel.cp_model import apply_context_parallel
from .data_parallel.dp_model import replicated
from .data_parallel.zero_forms import stage_uses
from .data_parallel.zero_params import unit_names
from .data_parallel.zero_shards import ZeroShards
from .expert_parallel.ep_model import apply_expert_parallel
from .expert_parallel.ep_shard import shard_experts
from .job import layer_forms
from .layout import build_groups
from .measurement import Measurement
from .pipeline_parallel.pp_comm import Pipe
from .pipeline_parallel.pp_runner import run_actions
from .pipeline_parallel.pp_schedules import actions
from .pipeline_parallel.pp_stage import PipelineStage, StageShared
from .rank_model import RankModel
from .tensor_parallel.tp_model import apply_tensor_parallel
from .tensor_parallel.tp_shard import shard_params


def stage_param_names(cfg, layers, first, last):
    """The parameters a stage holds, under the full model's names (a tied LM head: the embedding's matrix,
    held by the last stage as lm_head.weight; the caller sums its gradient into the embedding's)."""
    units = unit_names(list(param_shapes(cfg)), layers, first, last)  # the stage's units (ZeRO's), in order
    return [name for names in units.values() for name in names]


def rank_steps(comm, jobs, trace=False):
    process_groups = {}  # process groups, per layout, made once per launch
    return [rank_step(comm, job, process_groups, trace, index) for index, job in enumerate(jobs)]


def rank_step(comm, job, process_groups, trace=False, index=0):
    """One job on this rank: its steps (one, or under ZeRO with an optimizer one per batch), each rank_one_step,
    each told to the launching process as it ends when it listens (comm.progress: (index, step, this rank's share of
    the step's loss or None, its seconds)); returns CPU tensors and plain numbers only."""
    groups = build_groups(job.layout, comm.rank, comm.device, process_groups, comm.timeout)
    stage_forms = layer_forms(job, groups.stage)
    params = {name: tensor.to(comm.device) for name, tensor in rank_tensors(
        job.params, job.cfg, stage_forms, job.layout.tp, groups.tp_rank, job.layout.ep, groups.ep_rank).items()}
    shards = zero_shards(job, stage_forms, groups, params) if job.layout.zero else None
    generator = device_generator(comm.device)  # the rank's, set where the caller's stood
    generator.set_state(job.rng_state)
    losses, seconds, rng_start = [], [], job.rng_state
    for input_ids, targets in job.batches or [(job.input_ids, job.targets)] * max(job.steps, 1):
        loss, rng_end, report, data = rank_one_step(job, groups, stage_forms, params, shards, input_ids, targets,
                                                    rng_start, trace)
        losses.append(loss.cpu() if stage_forms.last else None)
        seconds.append(report["timeline_seconds"]["total"])
        if comm.progress is not None:  # the step is done here: say so now, not when every step is
            comm.progress((index, len(losses) - 1, losses[-1] if groups.tp_rank == 0 else None, seconds[-1]))
        if job.cfg.draws_random:  # the next step draws on from where this one leaves the generator (pp = 1)
            rng_start = rng_end
    first = groups.dp_rank == groups.cp_rank == 0  # the replicas all hold the same, reduced gradients
    grads = data.grads() if shards is None else shards.whole_tensors(grads=True)  # ZeRO's gathered, unmeasured
    trained = shards.whole_tensors() if shards is not None and (job.steps or job.batches) else None
    report["seconds_per_step"] = seconds  # this rank's, step by step (the report is the last step's)
    cpu = (lambda tensors: {name: t.cpu() for name, t in tensors.items()} if first and tensors is not None else None)
    return {"loss": losses[-1], "losses": losses, "grads": cpu(grads), "params": cpu(trained), "report": report,
            "rng_state": rng_start.cpu() if stage_forms.last and rng_start is not None else None}


def rank_tensors(params, cfg, stage_forms, tp=1, tp_rank=0, ep=1, ep_rank=0):
    """{name: tensor} of the full `params` a rank holds, as the module docstring says (report_forms.py: shapes)."""
    names = stage_param_names(cfg, stage_forms.layers, stage_forms.first, stage_forms.last)
    held = {name: params[EMBED if name == HEAD and cfg.tie_embeddings else name] for name in names}
    held = shard_params(held, tp_rank, tp) if tp > 1 else held  # its slices
    return shard_experts(held, ep_rank, ep) if ep > 1 else held  # its experts (of those slices)


def zero_shards(job, stage_forms, groups, params):
    """ZeRO's state of this rank's stage (data_parallel/zero_shards.py), sharded over its data-parallel groups
    (layout.py), in the order of its stage's uses."""
    layout = job.layout
    uses = stage_uses(actions(layout.schedule, layout.pp, layout.microbatches, groups.stage), stage_forms.layers,
                      stage_forms.first, stage_forms.last, stage_forms.local_schedule) if layout.zero == 3 else None
    return ZeroShards(params, job.cfg, layout, stage_forms, {False: groups.dp_comm, True: groups.expert_dp_comm}, uses,
                      job.lr, job.weight_decay)


def rank_one_step(job, groups, stage_forms, params, shards, input_ids, targets, rng_start, trace=False):
    """One forward and backward of the stage's micro-batches (and under ZeRO with steps, AdamW on the shards):
    (loss share, where it leaves the generator, the report, the gradients' holder: dp's wrap or ZeRO's shards)."""
    layout, cfg, device, T = job.layout, job.cfg, groups.device, input_ids.shape[1]
    input_ids, targets = input_ids.to(device), targets.to(device)
    counted = int((targets != IGNORE_INDEX).sum())  # N: the whole batch's counted targets
    sequence_split = SequenceLayout(layout.cp_layout, layout.cp, T) if layout.cp > 1 else None  # its tokens
    rows = microbatch_rows(job, groups, stage_forms.b, input_ids, targets)  # rows(m): micro-batch m's, this rank's
    model_for_rows = inner_model(job, groups, params, sequence_split)  # its model: each dimension over the ones before
    # trace: the engine's lines, to stderr prefixed with the rank, each in one write (the ranks' lines interleave whole)
    label = f"rank {groups.rank}" + (f" stage {groups.stage}" if layout.pp > 1 else "")
    say = (lambda line: print(f"[{label}] {line}\n", end="", file=sys.stderr, flush=True)) if trace else False
    measured = Measurement(job, groups, stage_forms)  # measurement.py: what the step measures, and its report
    with measured.step() as (tracker, timeline, memory), torch.no_grad():
        pipe = Pipe(*groups.neighbours(ring=layout.virtual_stages > 1), device, timeline, tracker)  # interleaved: ring
        if shards is not None:
            shards.begin(tracker)
        data = shards or replicated(cfg, params, stage_forms, groups, layout.overlap, timeline, tracker)  # dp / ZeRO
        shared = StageShared(cfg, params, pipe, data, counted, layout.microbatches, groups.dp_rank, layout.dp,
                             stage_forms.activation_shape(stage_forms.b // layout.ep), model_for_rows,
                             layout.recompute_early, split_backward=layout.schedule == "zb-h1")
        chunks = [PipelineStage(shared, forms.layers, forms.first, forms.last)
                  for forms in stage_forms.chunks]  # interleaved: the rank's V chunks
        chunks[0].rng_start = rng_start if stage_forms.first else None
        for chunk in chunks:
            chunk.start(tracker, device, T, like=chunks[0])
        timeline.begin()
        order = actions(layout.schedule, layout.pp, layout.microbatches, groups.stage, layout.virtual_stages)
        loss = run_actions(order, chunks, stage_forms.chunks, pipe, rows, memory, say, measured.forward_done)
        pipe.finish()
        data.finish()
        state = optimizer_step(job, shards, tracker)  # ZeRO: the model state the step ends with
        timeline.finish()
        rng_end = chunks[-1].rng_end  # the generator where the single process's step leaves it (last stage)
        del chunks
    return loss, rng_end, measured.report(pipe, data, sequence_split, shards, state), data


def microbatch_rows(job, groups, rows_per_microbatch, input_ids, targets):
    """rows(m): micro-batch m of this replica, block d*M + m of B / (dp M) rows, this ep rank's part of it."""
    M, b = job.layout.microbatches, rows_per_microbatch // job.layout.ep
    def rows(m):
        start = (groups.dp_rank * M + m) * rows_per_microbatch + groups.ep_rank * b
        return input_ids[start:start + b], targets[start:start + b]
    return rows


def inner_model(job, groups, params, sequence_split):
    """model_for_rows(ids, tgt): the layers' model, each dimension applied to what the ones before made."""
    layout = job.layout
    def model_for_rows(ids, tgt):
        model = RankModel(params, job.cfg, ids, tgt)
        if layout.cp > 1:  # its tokens of the rows, attention across the cp ranks
            apply_context_parallel(model, groups.cp_comm, sequence_split, layout.cp_comm, layout.cp_keep_kv)
        if layout.ep > 1:  # its experts: tokens dispatched to them and combined back
            apply_expert_parallel(model, groups.ep_comm, layout.keep_dispatched)
        if layout.tp > 1:  # its slices (of every expert too): the layer's collectives, the vocab-parallel head
            apply_tensor_parallel(model, groups.tp_comm, layout.sp, layout.distribute_saved)
        return model
    return model_for_rows


def optimizer_step(job, shards, tracker):
    """Under ZeRO the model state the step ends with (None without), after AdamW on the shards when the job
    trains (steps or batches): its moments exist from then on."""
    if shards is None:
        return None
    state = shards.bytes()
    if job.steps or job.batches:
        with tracker.phase("optimizer"):
            shards.step(tracker)
        state["optimizer_bytes"] = shards.bytes()["optimizer_bytes"]
    return state

