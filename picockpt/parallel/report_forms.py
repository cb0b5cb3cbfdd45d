"""The closed forms beside every rank's measurements, for any layout: predicted(job, report, routing) gives the
predicted_ twin of each count in rank.py's report. A rank's store holds its stage's micro-batches in flight
(pipeline_parallel/pp_forms.py), under cp at its T/cp tokens (context_parallel/cp_forms.py). Under ep what a micro-batch
holds depends on the tokens routed to this rank's experts, so each micro-batch is ep_forms.py's step over its own rows,
and the stage's peak replays the schedule over the micro-batches' unequal sizes."""
import math

import torch

from ..model.config import BYTES
from ..planning.cost import bubble_idle
from ..model.params import param_shapes
from .comm import PHASES
from .context_parallel.cp_forms import cp_flops, cp_peak_bytes, kept_kv_bytes, rank_attention_flops, stage_comm_bytes
from .expert_parallel.ep_forms import (ep_comm_bytes, ep_flops, ep_head_stored_bytes, ep_layer_stored_bytes,
                                           ep_peak_bytes, ep_sent_bytes, ep_stored_bytes, phase_sums, received_rows)
from .data_parallel.zero_forms import gather_forms, reduce_bytes_by_kind, stage_uses, unit_state_bytes
from .data_parallel.zero_shards import stage_units
from .expert_parallel.ep_shard import is_expert
from .job import layer_forms
from .pipeline_parallel.pp_plan import in_flight_peak, variant_bytes
from .pipeline_parallel.pp_schedules import actions
from .rank import rank_tensors


def predicted(job, report, routing=None):
    """The closed forms of one rank's report (its stage, dp and ep rank); routing: run_jobs' single-process routing by
    rows under ep (None otherwise). Composed as rank.py composes the step, each dimension that ran adding or replacing
    its own: the stage's forms (pp and tp), or under ep its experts' per micro-batch; cp's over either; ZeRO's state."""
    layout, stage_forms = job.layout, layer_forms(job, report["stage"])
    state_bytes = job.rng_state.numel() if job.cfg.draws_random else 0
    out = {"predicted_p2p_bytes": stage_forms.p2p_bytes(state_bytes, stage_forms.b // layout.ep),
           "predicted_dp_bytes": reduced_bytes(job, stage_forms),
           "predicted_bubble": bubble_idle(layout.pp, layout.microbatches, layout.schedule, layout.virtual_stages)}
    for applies, forms in ((layout.ep == 1, stage_forms_of), (layout.ep > 1, expert_forms),
                           (layout.cp > 1, context_forms), (layout.zero, zero_forms)):
        if applies:
            out.update(forms(job, stage_forms, report, routing))
    return out


def stage_forms_of(job, stage_forms, report, routing):
    """The stage's own forms (pipeline_parallel/pp_forms.py, tensor-parallel slices included): what a rank of
    dense layers stores, computes and moves."""
    head = stage_forms.chunks[-1]  # interleaved: the rank's last chunk holds any head
    return {"predicted_activation_bytes": stage_forms.peak_bytes,
            "predicted_microbatch_stored_bytes": stage_forms.microbatch_stored_bytes,
            "predicted_layer_stored_bytes": first_layer_bytes(stage_forms),
            "predicted_head_stored_bytes": variant_bytes(head.chain[-1], head.local_schedule.head),
            "predicted_flops": stage_forms.flops(), "predicted_comm_bytes": stage_forms.tp_comm_bytes()}


def context_forms(job, stage_forms, report, routing=None):
    """cp_forms.py's forms on the stage's layers, for its M micro-batches of b whole sequences (seq tokens);
    beside tp, its K/V and matmuls are its heads' (1/t), and the tensor-parallel collectives at T/cp tokens
    (forms.tp_comm_bytes) add to the ring's or all-gather's bytes."""
    layout, seq, rank, M = job.layout, job.input_ids.shape[1], report["cp_rank"], stage_forms.M
    cfg, cp, t = job.cfg.replace(layers=len(stage_forms.layers)), layout.cp, layout.tp
    args, schedule = (cfg, stage_forms.b, seq, stage_forms.policy, cp), stage_forms.local_schedule
    flops = cp_flops(*args, layout.cp_layout, rank, head=stage_forms.last, schedule=schedule, t=t)
    out = {"predicted_comm_bytes": stage_comm_bytes(stage_forms, seq, cp, layout.cp_comm, layout.cp_keep_kv),
           "predicted_flops": {phase: M * n for phase, n in flops.items()},
           "predicted_attention_flops": rank_attention_flops(cfg, stage_forms.b, seq, cp, layout.cp_layout, rank) // t}
    if layout.cp_keep_kv:  # one micro-batch on one stage (job.py): every layer also keeps the other ranks' K/V
        kept = kept_kv_bytes(cfg, stage_forms.b, seq, cp, layout.cp_comm, True)
        peak = cp_peak_bytes(job.cfg, stage_forms.b, seq, stage_forms.policy, cp, layout.cp_comm, True)
        out.update({"predicted_activation_bytes": peak,
                    "predicted_microbatch_stored_bytes": stage_forms.microbatch_stored_bytes + cfg.layers * kept,
                    "predicted_layer_stored_bytes": first_layer_bytes(stage_forms) + kept})
    return out


def first_layer_bytes(stage_forms):
    """What the stage's first layer holds after a micro-batch's forward: stored whole, its input, or nothing."""
    first, mode = stage_forms.chain[0], stage_forms.local_schedule.forward[0]
    return variant_bytes(first, mode) if mode.stored else (first.input_bytes if mode.keeps_input else 0)


def expert_forms(job, stage_forms, report, routing):
    """ep_forms.py's forms, one per micro-batch of this rank, over its stage's layers and its rows; beside tp,
    at its slices, with tp's collectives (forms.tp_comm_bytes) and each layer's router gradient summed over tp."""
    layout, layers, last, kept = job.layout, stage_forms.layers, stage_forms.last, job.layout.keep_dispatched
    cfg, M, ep, e, tp = job.cfg, layout.microbatches, layout.ep, report["ep_rank"], dict(t=layout.tp, sp=layout.sp)
    args = (cfg.replace(layers=len(layers)), stage_forms.b, stage_forms.seq, stage_forms.policy, ep)  # then rank e
    blocks = range(report["dp_rank"] * M, (report["dp_rank"] + 1) * M)  # its rows: run_jobs' slices per (block, ep)
    by_rank = [[routing[k][g * ep:(g + 1) * ep] for k in layers] for g in blocks]  # each micro-batch's
    counts = [[[sum(column) for column in zip(*layer)] for layer in block] for block in by_rank]  # per expert
    stored = [ep_stored_bytes(*args, e, c, kept, head=last, **tp) for c in counts]
    peaks = [ep_peak_bytes(*args, e, c, kept, head=last, **tp) for c in counts]
    comm = phase_sums(ep_comm_bytes(*args, e, c, kept) for c in counts)
    if layout.tp > 1:
        router = M * len(layers) * cfg.experts * cfg.hidden * BYTES[cfg.dtype_names[2]]  # its all-reduces
        tp_comm = stage_forms.tp_comm_bytes(stage_forms.b // ep)
        comm = {phase: n + tp_comm[phase] + (router if phase == "backward" else 0) for phase, n in comm.items()}
    order = actions(layout.schedule, layout.pp, M, report["stage"])
    return {"predicted_activation_bytes": in_flight_peak(order, lambda m, c: stored[m], lambda m, c: peaks[m]),
            "predicted_microbatch_stored_bytes": stored[0],
            "predicted_layer_stored_bytes": ep_layer_stored_bytes(*args, e, counts[0], kept, layer=0, **tp),
            "predicted_head_stored_bytes": ep_head_stored_bytes(*args, **tp) if last else 0,
            "predicted_flops": phase_sums(ep_flops(*args, e, c, kept, head=last, t=layout.tp) for c in counts),
            "predicted_comm_bytes": comm,
            "predicted_all_to_all_sent_bytes": phase_sums(ep_sent_bytes(*args, e, b, kept) for b in by_rank),
            "predicted_received_rows": [sum(received_rows(cfg, n, ep, e) for n in layer) for layer in zip(*counts)]}


def rank_param_shapes(cfg, stage_forms, tp=1, ep=1):
    """{name: shape} of what a rank of the stage holds: its tensor-parallel slices, its E/ep experts."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in param_shapes(cfg).items()}
    return {name: tuple(t.shape) for name, t in rank_tensors(meta, cfg, stage_forms, tp, 0, ep, 0).items()}


def reduced_bytes(job, stage_forms):
    """The bytes the stage's data-parallel groups (layout.py) move: every gradient once, all-reduced where its group
    has more than one rank; under ZeRO every one of its collectives (zero_forms)."""
    layout = job.layout
    if layout.zero:
        return sum(n for kinds in zero_forms(job, stage_forms, None)["predicted_zero_bytes_by_kind"].values()
                   for n in kinds.values())
    groups = {False: layout.dp * layout.ep * layout.cp, True: layout.dp * layout.cp}  # the dense and the experts'
    shapes = rank_param_shapes(job.cfg, stage_forms, layout.tp, layout.ep).items()
    return BYTES[job.cfg.dtype_names[2]] * sum(math.prod(shape) for name, shape in shapes  # in the master dtype
                                               if groups[layout.ep > 1 and is_expert(name)] > 1)


def zero_forms(job, stage_forms, report, routing=None):
    """ZeRO's closed forms on a rank of a job (zero_stage_forms), as its report's predicted_ twins."""
    out = zero_stage_forms(job.cfg, stage_forms, job.layout, job.steps or len(job.batches or ()))
    return {f"predicted_{key}": value for key, value in out.items()}


def zero_stage_forms(cfg, stage_forms, layout, steps=1):
    """ZeRO's closed forms on a rank of stage `forms` (a ChunkForms) of any layout (data_parallel/zero_forms.py on
    its stage's units, over the groups of layout.py): model state, the gathers of every use in the schedule's order
    (recomputation's included), the reductions, and the gathered peak per phase. layout: a Layout."""
    zero, tp, ep, dp, cp = layout.zero, layout.tp, layout.ep, layout.dp, layout.cp
    sizes = {False: dp * ep * cp, True: dp * cp}  # the dense and the experts' groups
    units = stage_units(rank_param_shapes(cfg, stage_forms, tp, ep), stage_forms.layers, stage_forms.first,
                        stage_forms.last, sizes, is_expert if ep > 1 else None)
    every = [unit for parts in units.values() for unit in parts]
    p, c = BYTES[cfg.dtype_names[2]], BYTES[cfg.dtype]
    state = unit_state_bytes(every, zero, p)
    if not steps:  # AdamW's moments exist from its first step on
        state["optimizer_bytes"] = 0
    by_kind = {phase: {} for phase in PHASES + ("optimizer",)} | reduce_bytes_by_kind(every, zero, p, bool(steps))
    peaks = dict.fromkeys(PHASES, 0)
    if zero == 3:
        order = actions(layout.schedule, layout.pp, layout.microbatches, stage_forms.stage)
        uses = stage_uses(order, stage_forms.layers, stage_forms.first, stage_forms.last, stage_forms.local_schedule)
        gathered = {key: sum(u.padded * c for u in parts if u.world_size > 1) for key, parts in units.items()}
        moved, peaks = gather_forms(uses, gathered, layout.keep_gathered, layout.prefetch)
        for phase, nbytes in moved.items():
            by_kind[phase]["all_gather"] = nbytes
    by_kind = {phase: {kind: n for kind, n in kinds.items() if n} for phase, kinds in by_kind.items()}
    return {**state, "zero_bytes_by_kind": by_kind, "gathered_peak_bytes": peaks}
