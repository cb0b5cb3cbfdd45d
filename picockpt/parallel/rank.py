"""One rank's step of any layout, dp x pp x ep x cp x tp (step.py shows how each parallelism wraps the engine):
its stage's micro-batches, forwards and backwards in the schedule's order, each one the engine's own loop over a
model whose layers cross ranks where its layout says (make_inner below: each dimension applied over the ones before);
under ZeRO the stage's weights and buckets are its shards' (data_parallel/zero_shards.py).

    for action in actions(schedule, P, M, stage):          # pipeline_parallel/pp_schedules.py; P = M = 1: one step
        if action.kind == "F":                              # a Step per micro-batch (picockpt/engine.py)
            steps[m] = Step(stage.microbatch(m, ...), schedule, drop, memory.for_microbatch(m))
            steps[m].forward()                              # receive x, layers, send y (or head and loss)
        else:
            steps.pop(m).backward()                         # receive dy, recompute, backward, send dx

A rank holds its stage's layers (the embedding on the first stage, final norm and head on the last), its
tensor-parallel slices of them, its experts, and its rows of the batch: micro-batch m of replica d is the block
d*M + m of B / (dp M) sequences, split over the ep ranks, and under cp its tokens of those rows (cp_layout.py).
recompute-early (pp_stage.py: recompute_top) fills a stage's wait for a gradient with the top segment's
recomputation: the same peak, held longer ("mean_activation_bytes", time-weighted), and the received gradient's
buffer allocated before the recomputation (in "peak_live_bytes").
"""
import sys

import torch
import torch.distributed as dist

from ..engine import Step, device_generator
from ..ops.cross_entropy import IGNORE_INDEX
from ..store import ActivationStore
from ..params import EMBED, FINAL_NORM, HEAD, param_shapes
from ..tracker import Tracker
from .comm import PHASES, CommLog
from .context_parallel.cp_layout import SequenceLayout
from .context_parallel.cp_model import apply_context_parallel
from .data_parallel.dp_comm import ExpertAndDenseBuckets, GradientBuckets
from .data_parallel.zero_inventory import stage_uses
from .data_parallel.zero_shards import ZeroShards
from .expert_parallel.ep_model import apply_expert_parallel
from .expert_parallel.ep_shard import is_expert, shard_experts
from .job import closed_forms
from .layout import Layout, build_groups
from .pipeline_parallel.pp_comm import Pipe, neighbours, receives
from .pipeline_parallel.pp_schedules import actions, interleaved_steps
from .pipeline_parallel.pp_stage import PipelineStage, bucket_names
from .rank_model import RankModel
from .tensor_parallel.tp_model import apply_tensor_parallel
from .tensor_parallel.tp_shard import shard_params
from .timeline import StageMemory, Timeline


def stage_param_names(cfg, layers, first, last):
    """The parameters a stage holds, under the full model's names (a tied LM head: the embedding's matrix,
    held by the last stage as lm_head.weight; the caller sums its gradient into the embedding's)."""
    names = [EMBED] if first else []
    prefixes = tuple(f"model.layers.{k}." for k in layers)
    names += [name for name in param_shapes(cfg) if name.startswith(prefixes)]
    if last:
        names += [FINAL_NORM, HEAD]
    return names


def trace_lines(rank_label, trace):
    """The engine's `say` on a rank: each trace line prefixed with the rank, to stderr; False: no trace."""
    def say(line):
        sys.stderr.write(f"[{rank_label}] {line}\n")  # a whole line at once: the ranks' lines interleave, not halves
        sys.stderr.flush()
    return say if trace else False


def rank_steps(comm, jobs, trace=False):
    process_groups = {}  # process groups, per layout, made once per launch
    return [rank_step(comm, job, process_groups, trace, index) for index, job in enumerate(jobs)]


def rank_step(comm, job, process_groups, trace=False, index=0):
    """One job on this rank: its steps (one, or under ZeRO with an optimizer one per batch), each rank_one_step,
    each told to the launching process as it ends when it listens (comm.progress: (index, step, this rank's share of
    the step's loss or None, its seconds)); returns CPU tensors and plain numbers only."""
    layout = Layout(job.dp, job.pp, job.tp, job.ep, job.cp)
    groups = build_groups(layout, comm.rank, comm.device, process_groups, comm.timeout)
    stage_forms = closed_forms(job, groups.stage)
    params = rank_params(job, stage_forms, groups, comm.device)
    shards = zero_shards(job, stage_forms, groups, params) if job.zero else None
    generator = device_generator(comm.device)
    generator.set_state(job.rng_state)
    batches = job.batches or [(job.input_ids, job.targets)] * max(job.steps, 1)
    losses, seconds, rng_start = [], [], job.rng_state
    for input_ids, targets in batches:
        loss, rng_end, report = rank_one_step(job, groups, stage_forms, params, shards, input_ids, targets, rng_start,
                                              trace)
        losses.append(loss.cpu() if stage_forms.last else None)
        seconds.append(report["timeline_seconds"]["total"])
        if comm.progress is not None:  # the step is done here: say so now, not when every step is
            comm.progress((index, len(losses) - 1, losses[-1] if groups.tp_rank == 0 else None, seconds[-1]))
        if job.cfg.draws_random:  # the next step draws on from where this one leaves the generator (pp = 1)
            rng_start = rng_end
    first = groups.dp_rank == groups.cp_rank == 0  # the replicas all hold the same, reduced gradients
    if shards is None:
        grads, trained = report.pop("grads"), None
    else:  # each rank's whole tensors from its group's shards, for the caller's check (after the measured step)
        grads = shards.whole_tensors(grads=True)
        trained = shards.whole_tensors() if job.steps or job.batches else None
    report["seconds_per_step"] = seconds  # this rank's, step by step (the report is the last step's)
    rng_state = rng_start if job.cfg.draws_random else job.rng_state
    cpu = (lambda tensors: {name: t.cpu() for name, t in tensors.items()} if first and tensors is not None else None)
    return {"loss": losses[-1], "losses": losses, "grads": cpu(grads), "params": cpu(trained), "report": report,
            "rng_state": rng_state.cpu() if stage_forms.last and rng_state is not None else None}


def rank_params(job, stage_forms, groups, device):
    """{name: tensor} this rank holds of its stage: its tensor-parallel slices, of them its experts."""
    cfg = job.cfg
    names = stage_param_names(cfg, stage_forms.layers, stage_forms.first, stage_forms.last)
    params = {name: job.params[EMBED if name == HEAD and cfg.tie_embeddings else name] for name in names}
    if job.tp > 1:
        params = shard_params(params, groups.tp_rank, job.tp)  # its slices
    if job.ep > 1:
        params = shard_experts(params, groups.ep_rank, job.ep)  # its experts (of those slices)
    return {name: tensor.to(device) for name, tensor in params.items()}


def zero_shards(job, stage_forms, groups, params):
    """ZeRO's state of this rank's stage (data_parallel/zero_shards.py): every weight but the experts' sharded over
    the data-parallel group (dp x ep x cp), the experts' over theirs, in the order of its stage's uses."""
    order = actions(job.schedule, job.pp, job.microbatches, groups.stage)
    uses = stage_uses(order, stage_forms.layers, stage_forms.first, stage_forms.last, stage_forms.local_schedule) \
        if job.zero == 3 else None
    return ZeroShards(params, job.cfg, job.zero, stage_forms.layers, stage_forms.first, stage_forms.last,
                      {False: groups.dp_comm, True: groups.expert_dp_comm}, is_expert if job.ep > 1 else None, uses,
                      job.keep_gathered, job.prefetch, job.lr, job.weight_decay)


def rank_one_step(job, groups, stage_forms, params, shards, input_ids, targets, rng_start, trace=False):
    """One forward and backward of the stage's micro-batches (and under ZeRO with steps, AdamW on the shards):
    (loss share, the generator where the step leaves it, the report)."""
    cfg, device = job.cfg, groups.device
    B, T = input_ids.shape
    input_ids, targets = input_ids.to(device), targets.to(device)
    counted = int((targets != IGNORE_INDEX).sum())  # N: the whole batch's counted targets
    M, b = job.microbatches, stage_forms.b // job.ep  # b: the rows this rank computes of each micro-batch
    tokens = SequenceLayout(job.cp_layout, job.cp, T) if job.cp > 1 else None  # which tokens of a row it holds

    def rows(m):  # micro-batch m of this replica: block d*M + m of B / (dp M) rows, this ep rank's part of it
        start = (groups.dp_rank * M + m) * stage_forms.b + groups.ep_rank * b
        return input_ids[start:start + b], targets[start:start + b]

    def make_inner(ids, tgt):  # the layers' model: each dimension applied to what the ones before made
        model = RankModel(params, cfg, ids, tgt)
        if job.cp > 1:  # its tokens of the rows, attention across the cp ranks
            apply_context_parallel(model, groups.cp_comm, tokens, job.cp_comm, job.cp_keep_kv)
        if job.ep > 1:  # its experts: tokens dispatched to them and combined back
            apply_expert_parallel(model, groups.ep_comm, job.keep_dispatched)
        if job.tp > 1:  # its slices (of every expert too): the layer's collectives, the vocab-parallel head
            apply_tensor_parallel(model, groups.tp_comm, job.sp, job.distribute_saved)
        return model

    say = trace_lines(f"rank {groups.rank}" + (f" stage {groups.stage}" if job.pp > 1 else ""), trace)
    layer_comms = [group for group in (groups.tp_comm, groups.ep_comm, groups.cp_comm) if group is not None]
    layer_log = CommLog()  # the layers' own collectives (tp, ep, cp), this step's bytes only
    reducing = [group for group in (groups.dp_comm, groups.expert_dp_comm) if group is not None]
    dist.barrier()  # every rank leaves it at the same moment: the zero of every rank's Timeline, across hosts too
    timeline = Timeline(device)  # its times: seconds since now (machines' monotonic clocks share no origin)
    with Tracker(device, physical=job.measure, flops=job.measure) as tracker, torch.no_grad():
        memory = StageMemory(tracker, timeline)
        pipe = Pipe(*neighbours(groups, job.pp, job.virtual_stages), device, timeline, tracker)
        for group in layer_comms:
            group.tracker, group.log = tracker, layer_log
        reduce_log = CommLog()  # the data-parallel groups' collectives (the buckets', or ZeRO's), this step's
        for group in reducing:
            group.tracker, group.log = tracker, reduce_log
        if shards is not None:
            shards.begin(tracker)
        buckets = shards or _buckets(job, stage_forms, groups, params, device, timeline, tracker)
        chunk_forms = stage_forms.chunks  # interleaved: the rank's V chunks
        chunks = [PipelineStage(cfg, params, forms.layers, forms.first, forms.last, pipe, buckets, counted, M,
                                groups.dp_rank, job.dp, stage_forms.activation_shape(b), make_inner,
                                job.recompute_early, shards, split_backward=job.schedule == "zb-h1")
                  for forms in chunk_forms]
        chunks[0].rng_start = rng_start if stage_forms.first else None
        for chunk in chunks:
            chunk.start(tracker, device, T, like=chunks[0])
        timeline.begin()
        steps, waiting, loss, first_stored, received = {}, {}, None, {}, dict.fromkeys(stage_forms.layers, 0)
        order = actions(job.schedule, job.pp, M, groups.stage, job.virtual_stages)
        rng_like = device_generator(device).get_state()  # what a generator state sent between stages looks like
        talking = [action for action in order if action.kind != "W"]  # the actions that send and receive

        def receives_from(action):  # the neighbour this action receives from (its input or its gradient), or None
            chunk = chunks[action.chunk]
            return None if action.kind == "W" or (chunk.first if action.kind == "F" else chunk.last) else \
                pipe.previous if action.kind == "F" else pipe.next
        pipe.stepwise = job.virtual_stages > 1  # interleaved: Megatron-LM's steps (pp_comm.py)
        starts, index = {}, 0  # the index of each step's first action -> the step
        for step_actions in interleaved_steps(order) if pipe.stepwise else ():
            starts[index], index = step_actions, index + len(step_actions)
        for index, action in enumerate(order):
            m, c = action.microbatch, action.chunk
            stage, forms = chunks[c], chunk_forms[c]
            if index in starts:  # the previous step's sends and every receive this step reads, one group
                pipe.exchange([(receives_from(a), shape, dtype, kind) for a in starts[index]
                               if receives_from(a) is not None
                               for kind, shape, dtype in receives(a, cfg, rng_like, forms.activation_shape(b))])
            if action.kind == "W":  # ZB-H1: the weight gradients its B left (no send, no receive)
                waiting.pop((m, c)).weight_backward()
                continue
            talking.pop(0)  # a send just before the next action's receive from the same peer: one group
            pipe.pair_with = receives_from(talking[0]) if talking else None
            if action.kind == "F":
                w_store = ActivationStore(listener=memory.for_microbatch(m, (c, "W"))) if stage.split_backward \
                    else None
                model = stage.microbatch(m, *rows(m), w_store)
                step = model.step = Step(model, forms.schedule, forms.policy.drop, memory.for_microbatch(m, c), say)
                model.rank_model.store = step.store  # where an ep layer keeps its routing, whatever its mode
                part = step.forward()  # this micro-batch's share of the whole batch's mean (last stage)
                loss = part if loss is None else loss + part
                memory.end_of_forward[m, c] = memory.held.get((m, c), 0)
                if m == 0:  # what the rank's first layer and the head hold after a forward
                    first_stored.setdefault("layer_stored_bytes", step.store.layer_bytes(stage_forms.layers[0]))
                    first_stored["head_stored_bytes"] = step.store.layer_bytes(None)
                for k, rows_in in getattr(model.rank_model, "received_rows", {}).items():
                    received[k] += rows_in  # the rows this rank's experts got, over its micro-batches
                steps[m, c] = step
            else:
                step = steps.pop((m, c))
                step.backward()
                if stage.split_backward:
                    waiting[m, c] = step.model
        pipe.finish()
        buckets.finish()
        state = shards.bytes() if shards is not None else None  # the model state the step ends with
        if shards is not None and (job.steps or job.batches):
            with tracker.phase("optimizer"):
                shards.step(tracker)
            state["optimizer_bytes"] = shards.bytes()["optimizer_bytes"]  # AdamW's moments exist from now on
        timeline.finish()
        rng_end = chunks[-1].rng_end  # the generator where the single process's step leaves it (last stage)
        del stage, chunks, steps, waiting
    for group in layer_comms + reducing:
        group.tracker = None
    report = _report(job, stage_forms, groups, tracker, timeline, memory, pipe, buckets, layer_log, reduce_log)
    report.update(first_stored, received_rows=[received[k] for k in stage_forms.layers] if job.ep > 1 else None,
                  chunks=tokens.chunks(groups.cp_rank) if tokens else None,
                  chunk_tokens=tokens.chunk if tokens else None)
    if shards is None:
        report["grads"] = buckets.grads()
    else:
        report.update(state, zero=job.zero, keep_gathered=job.keep_gathered, prefetch=job.prefetch,
                      gathered_peak_bytes=dict(shards.gathered_peak),
                      **{f"zero_{what}_by_kind": {phase: dict(table.get(phase, {})) for phase in PHASES + ("optimizer",)}
                         for what, table in (("bytes", reduce_log.bytes), ("calls", reduce_log.calls))})
    return loss, rng_end, report


def _buckets(job, stage_forms, groups, params, device, timeline, tracker):
    """The stage's gradient buckets, all-reduced over the data-parallel group as they become final; under
    ep the experts' apart, over their expert-data-parallel group (picockpt/parallel/layout.py)."""
    names = bucket_names(job.cfg, params, stage_forms.layers, stage_forms.first, stage_forms.last)
    shapes = {name: tensor.shape for name, tensor in params.items()}

    def make(comm, keep):
        kept = {bucket: [name for name in members if keep(name)] for bucket, members in names.items()}
        return GradientBuckets({bucket: members for bucket, members in kept.items() if members}, shapes,
                               job.cfg.param_dtype, device, comm, job.overlap, timeline, tracker)
    if job.ep == 1:
        return make(groups.dp_comm, lambda name: True)
    return ExpertAndDenseBuckets(make(groups.dp_comm, lambda name: not is_expert(name)),
                                 make(groups.expert_dp_comm, is_expert), is_expert)


def _report(job, stage_forms, groups, tracker, timeline, memory, pipe, buckets, layer_log, reduce_log):
    seconds = timeline.totals()
    busy = seconds["forward"] + seconds["recompute"] + seconds["backward"]
    local = job.cfg.experts // job.ep if job.ep > 1 else 0
    return {
        "rank": groups.rank, "stage": groups.stage, "dp_rank": groups.dp_rank, "ep_rank": groups.ep_rank,
        "cp_rank": groups.cp_rank, "tp_rank": groups.tp_rank, "pp": job.pp, "dp": job.dp, "ep": job.ep, "cp": job.cp,
        "tp": job.tp, "cp_layout": job.cp_layout, "cp_comm": job.cp_comm, "cp_keep_kv": job.cp_keep_kv,
        "sp": job.sp and job.tp > 1, "distribute_saved": job.distribute_saved, "keep_dispatched": job.keep_dispatched,
        "microbatches": job.microbatches, "schedule": job.schedule, "policy": stage_forms.policy.text,
        "stage_schedule": stage_forms.source, "layers": [stage_forms.layers[0], stage_forms.layers[-1]],
        "virtual_stages": job.virtual_stages,
        "chunk_layers": [[forms.layers[0], forms.layers[-1]] for forms in stage_forms.chunks],
        "microbatches_in_flight": stage_forms.in_flight, "recompute_early": job.recompute_early, "overlap": job.overlap,
        "experts": list(range(groups.ep_rank * local, (groups.ep_rank + 1) * local)),
        "peak_activation_bytes": tracker.peak_logical,
        "microbatch_stored_bytes": memory.end_of_forward.get((0, 0), 0),  # micro-batch 0's, after its forward
        "mean_activation_bytes": memory.mean_bytes(),
        "peak_live_bytes": tracker.peak_physical if job.measure else None,
        "flops": {phase: tracker.flops[phase] for phase in PHASES} if job.measure else None,
        "p2p_bytes": {phase: dict(pipe.log.bytes.get(phase, {})) for phase in ("forward", "backward")},
        "p2p_posted": pipe.posted,  # every group of sends and receives, in the order posted
        **layer_log.report(PHASES),  # the layers' collectives (tp, ep or cp): bytes and calls per phase, by kind
        "dp_bytes": reduce_log.total(),
        "timeline_start": timeline.start,
        "timeline": timeline.relative(),
        "timeline_seconds": seconds,
        "computing_seconds": busy,
        "dp_buckets": [(str(bucket), nbytes, start - timeline.start, end - timeline.start)
                       for bucket, nbytes, start, end in buckets.events],
    }
