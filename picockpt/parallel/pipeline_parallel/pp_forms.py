"""Closed forms per pipeline stage: the bytes it stores with its micro-batches in flight, sends and receives, its
FLOPs, and the schedule each micro-batch runs (stage-aware budgets).

A micro-batch of b = B / (dp * M) sequences runs the engine's loop over the stage's layers (and head, if last) under
the policy applied to them alone (the stage's first layer input is always a checkpoint). From its chain: E, what its
first forward leaves stored (end_of_forward_bytes), and peak, its own peak during its step (replay). With w
micro-batches in flight (pp_schedules.in_flight) every backward runs while w - 1 others hold E each: stage peak =
(w - 1) * E + peak, to the byte. budget:SIZE is per stage: for its own w, the least recomputation whose stage peak
fits (pp_plan.py); stage 0 of 1F1B recomputes the most.
"""
import functools
import math
from dataclasses import replace

from ...planning.step_forms import layer_flops
from ...planning.planner import Stage, model_chain, plan_chain, replay
from .pp_orders import w_pending_bytes
from .pp_plan import end_of_forward_bytes, in_flight_peak, plan_chunks, plan_in_flight, walk_peak
from ...recompute.policy import as_policy
from ...recompute.schedule import Mode, Schedule
from ..tensor_parallel.tp_forms import rank_chain, rank_comm_bytes
from .pp_schedules import actions, in_flight, rank_layers
from ...model.config import BYTES
from ..layout import Layout

NO_HEAD = Stage(0, 0, (("all", 0, 0),))  # before the last stage: no head, nothing stored after the layers


def stage_chain(cfg, batch, seq, layers, last, t=1, sp=False, distribute_saved=False, unstored=frozenset()):
    """The chain of one micro-batch of `batch` sequences on a stage of `layers` layers (the head if last)."""
    whole = whole_chain(cfg, batch, seq, t, sp, distribute_saved, frozenset(unstored))
    return whole[:layers] + ((whole[-1],) if last else (NO_HEAD,))


@functools.lru_cache(maxsize=None)  # the layout search asks for the same chain at every stage and variant
def whole_chain(cfg, batch, seq, t, sp, distribute_saved, unstored):
    """The whole model's chain on one of t tensor-parallel ranks (its Stages frozen, so one tuple serves every ask)."""
    return (model_chain(cfg, batch, seq, unstored) if t == 1 else  # sp, distribute_saved: with t > 1 only
            rank_chain(cfg, batch, seq, t, sp, distribute_saved, unstored))


def uniform_schedules(chain):
    """(name, Schedule) of every uniform policy on this chain, named as the policy: every layer kept whole at one op
    level ("none", "selective", ...), or checkpoints every C layers, sweeps at a level ("full", "every:2+selective")."""
    layers, head_modes = len(chain) - 1, {mode for mode, _, _ in chain[-1].variants}
    out = []
    for mode, _, _ in chain[0].variants:
        level = Mode(mode).level or ""
        suffix = f"+{level}" if level else ""
        out.append((level or "none", Schedule(forward=(mode,) * layers, head=mode if mode in head_modes else "all")))
        for C in range(1, layers + 1):
            forward = tuple("input" if k % C == 0 else "none" for k in range(layers))
            sweeps = {target: {k: mode for k in range(target - target % C, target + 1)} for target in range(layers)}
            out.append((f"{'full' if C == 1 else f'every:{C}'}{suffix}", Schedule(forward=forward, sweep_modes=sweeps)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def stage_plan(policy, cfg, batch, seq, layers, last, in_flight_count, layout=Layout(), layer_comm_flops=0, order=None,
               w_layer_bytes=0):
    """(Schedule of one micro-batch in the stage's layer numbers 0.., stage peak, E, own peak, recompute FLOPs, where
    the schedule came from). layout: its tensor parallelism (tp, sp, distribute_saved) alone. layer_comm_flops: the
    communication a recomputed layer forward also costs, as FLOPs of the same time (context parallelism's ring): a
    budget plans with it; the FLOPs returned leave it out. order, w_layer_bytes: the stage's Actions and what each
    layer's B leaves for its W (ZB-H1), for the stage peak (pp_plan.walk_peak)."""
    left = (w_layer_bytes,) * layers if w_layer_bytes else None
    policy = as_policy(policy, cfg)
    chain = stage_chain(cfg, batch, seq, layers, last, layout.tp, layout.sp, layout.distribute_saved, policy.unstored)
    planned = tuple(replace(stage, forward_flops=stage.forward_flops + layer_comm_flops) for stage in chain[:-1]) + \
        chain[-1:] if layer_comm_flops else chain
    if policy.budget is not None and in_flight_count == 1 and layers == cfg.layers:  # no pipeline: one step
        schedule, source = plan_chain(planned, policy.budget).schedule, "the planner (picockpt/planning/planner.py)"
    elif policy.budget is not None:
        schedule, *_, source = plan_in_flight(planned, policy.budget, in_flight_count, uniform_schedules(planned),
                                              order=order, left=left)
    else:
        schedule, source = policy.schedule(cfg.replace(layers=layers), batch, seq), policy.text
    held, (peak, recompute) = end_of_forward_bytes(chain, schedule), replay(chain, schedule, left)
    return schedule, walk_peak(order, in_flight_count, held, peak, left), held, peak, recompute, source


def shifted(schedule, first, total_layers):
    """The stage's schedule in the model's layer numbers (first.. first + n - 1), as the engine indexes it."""
    forward = ("none",) * first + tuple(schedule.forward) + ("none",) * (total_layers - first - len(schedule.forward))
    sweeps = None if schedule.sweep_modes is None else {first + target: {first + k: mode for k, mode in modes.items()}
                                                        for target, modes in schedule.sweep_modes.items()}
    return Schedule(forward, sweeps, schedule.head, schedule.stop_early)


class ChunkForms:
    """Every closed form of one rank of a pipeline job (batch, seq: the whole step's batch); under interleaving
    (virtual > 1) of one of its chunks, virtual stage chunk * pp + stage (InterleavedForms puts them together)."""

    def __init__(self, cfg, batch, seq, policy, layout, stage, layer_comm_flops=0, chunk=0, planned=None):
        pp, microbatches, schedule, virtual = layout.pp, layout.microbatches, layout.schedule, layout.virtual_stages
        self.cfg, self.stage, self.t, self.policy = cfg, stage, layout.tp, as_policy(policy, cfg)
        self.sp, self.distribute_saved = layout.sp and layout.tp > 1, layout.distribute_saved and layout.tp > 1
        self.layers = rank_layers(cfg.layers, pp, stage, virtual)[chunk]
        self.first, self.last = chunk * pp + stage == 0, chunk * pp + stage == pp * virtual - 1
        self.b, self.seq, self.M = batch // (layout.dp * microbatches), seq, microbatches
        self.in_flight = in_flight(schedule, pp, microbatches, stage, virtual)  # micro-batch-chunks, interleaved
        split = schedule == "zb-h1"  # B and W apart: each layer's B leaves what its W reads (pp_orders.py)
        self.w_layer_bytes = w_pending_bytes(cfg, self.b, seq, self.t) if split else 0
        order = tuple(actions(schedule, pp, microbatches, stage)) if split else None
        self.chain = stage_chain(cfg, self.b, seq, len(self.layers), self.last, self.t, self.sp,
                                 self.distribute_saved, self.policy.unstored)
        if planned is None:  # the key of stage_plan's cache: the layout's tensor parallelism alone
            tp_alone = Layout(tp=layout.tp, sp=layout.sp, distribute_saved=layout.distribute_saved)
            (self.local_schedule, self.peak_bytes, self.microbatch_stored_bytes, self.microbatch_peak_bytes,
             self.recompute_flops, self.source) = stage_plan(self.policy, cfg, self.b, seq, len(self.layers),
                                                             self.last, self.in_flight, tp_alone,
                                                             layer_comm_flops, order, self.w_layer_bytes)
        else:  # a chunk of an interleaved rank under a budget, planned with its other chunks (pp_plan.plan_chunks)
            self.local_schedule, self.source = planned
            self.microbatch_peak_bytes, self.recompute_flops = replay(self.chain, self.local_schedule)
            self.microbatch_stored_bytes = end_of_forward_bytes(self.chain, self.local_schedule)
            self.peak_bytes = None  # the rank's, walked over all its chunks (InterleavedForms)
        self.schedule = shifted(self.local_schedule, self.layers[0], cfg.layers)

    chunks = property(lambda self: [self])  # the rank's chunks, as InterleavedForms has them: this stage alone

    def activation_shape(self, rows=None):
        """(b, n, h): what crosses from one stage to the next, per rank (n = T/t under sequence parallelism;
        rows: b / ep under expert parallelism, each ep rank's part of the micro-batch)."""
        return (rows or self.b, self.seq // self.t if self.sp else self.seq, self.cfg.hidden)

    def flops(self):
        """{"forward", "recompute", "backward"}: this rank's matmul FLOPs over its M micro-batches."""
        cfg, b, T, t, parts = self.cfg, self.b, self.seq, self.t, layer_flops(self.cfg, self.b, self.seq)
        head = 2 * b * T * cfg.hidden * cfg.vocab // t if self.last else 0
        forward = len(self.layers) * sum(parts.values()) // t + head
        backward = 2 * forward + (len(self.layers) * parts["scores"] // t if cfg.attention == "fused" else 0)
        return {"forward": self.M * forward, "recompute": self.M * self.recompute_flops, "backward": self.M * backward}

    def action_flops(self):
        """{"F", "B", "W"}: one micro-batch's matmul FLOPs per action on this rank: F its forward; W (ZB-H1) every
        projection's dW, the layers' projection FLOPs again; B the rest of its backward and the recomputation that
        runs first (without ZB-H1 the whole backward, W = 0)."""
        total, parts = self.flops(), layer_flops(self.cfg, self.b, self.seq)
        weights = len(self.layers) * (parts["qkvo"] + parts["mlp"]) // self.t if self.w_layer_bytes else 0
        B = (total["backward"] + total["recompute"]) // self.M - weights
        return {"F": total["forward"] // self.M, "B": B, "W": weights}

    def p2p_bytes(self, state_bytes=0, rows=None):
        """{"forward": {kind: bytes}, "backward": {kind: bytes}} of this rank's sends and receives.
        state_bytes: the generator state the first micro-batch carries (when the model draws random numbers)."""
        S = math.prod(self.activation_shape(rows)) * BYTES[self.cfg.dtype]  # one micro-batch's activation
        forward, backward = {}, {}
        for end, there, back in ((self.first, "receive", "send"), (self.last, "send", "receive")):
            if not end:  # a neighbour that side: the input (the output) there, its gradient back
                forward[there], backward[back] = self.M * S, self.M * S
                if state_bytes:
                    forward["rng_state"] = forward.get("rng_state", 0) + state_bytes
        return {"forward": forward, "backward": backward}

    def tp_comm_bytes(self, rows=None):
        """{"forward", "recompute", "backward"}: this rank's tensor-parallel collectives over its M micro-batches
        (tp_forms.rank_comm_bytes on its layers, embedding, head, sweeps); rows: b / ep under expert parallelism."""
        one = rank_comm_bytes(self.cfg.replace(layers=len(self.layers)), rows or self.b, self.seq, self.policy,
                              self.t, self.sp, self.distribute_saved, self.first, self.last, self.local_schedule)
        return {phase: self.M * n for phase, n in one.items()}


def rank_forms(cfg, batch, seq, policy, layout, stage, layer_comm_flops=0):
    """Stage `stage`'s rank: its ChunkForms, or interleaved its V chunks' InterleavedForms (under a budget the chunks
    planned together, their walk within it: pp_plan.plan_chunks)."""
    parsed = as_policy(policy, cfg)  # the text parsed here, once: every chunk's ChunkForms takes the Policy
    pp, M, V, t = layout.pp, layout.microbatches, layout.virtual_stages, layout.tp
    if V == 1:
        return ChunkForms(cfg, batch, seq, parsed, layout, stage, layer_comm_flops)
    order, planned = actions(layout.schedule, pp, M, stage, V), [None] * V
    if parsed.budget is not None:
        chains = [stage_chain(cfg, batch // (layout.dp * M), seq, len(layers), c == V - 1 and stage == pp - 1,
                              t, layout.sp and t > 1, layout.distribute_saved and t > 1, parsed.unstored)
                  for c, layers in enumerate(rank_layers(cfg.layers, pp, stage, V))]
        planned = plan_chunks(chains, parsed.budget, order, [uniform_schedules(chain) for chain in chains])
    return InterleavedForms([ChunkForms(cfg, batch, seq, parsed, layout, stage, layer_comm_flops, c, planned[c])
                      for c in range(V)], order)


class InterleavedForms:
    """Every closed form of one rank of an interleaved job: its chunks' ChunkForms (chunks[c]: virtual stage
    c P + s), and over them the rank's. Its store peak walks the rank's order, micro-batch-chunk by micro-batch-chunk
    (pp_plan.in_flight_peak); FLOPs and bytes moved add up over the chunks. The rest is chunk 0's: its chain and
    schedule the first layer's (the head's: chunks[-1]), its stored bytes micro-batch 0's after chunk 0's forward."""

    def __init__(self, chunks, order):
        self.chunks, self.last = chunks, chunks[-1].last
        for name in ("cfg", "stage", "t", "sp", "b", "seq", "M", "first", "policy", "in_flight", "chain",
                     "local_schedule", "source", "microbatch_stored_bytes"):
            setattr(self, name, getattr(chunks[0], name))
        self.layers = [k for chunk in chunks for k in chunk.layers]  # not contiguous: V ranges
        self.peak_bytes = in_flight_peak(order, lambda m, c: chunks[c].microbatch_stored_bytes,
                                         lambda m, c: chunks[c].microbatch_peak_bytes)

    activation_shape = ChunkForms.activation_shape  # alike in every chunk

    def flops(self):
        return _summed(chunk.flops() for chunk in self.chunks)

    def p2p_bytes(self, state_bytes=0, rows=None):
        each = [chunk.p2p_bytes(state_bytes, rows) for chunk in self.chunks]
        return {phase: _summed(one[phase] for one in each) for phase in ("forward", "backward")}

    def tp_comm_bytes(self, rows=None):
        return _summed(chunk.tp_comm_bytes(rows) for chunk in self.chunks)


def _summed(tables):  # {key: its sum over the tables}, every key kept (a zero too)
    tables = list(tables)
    return {key: sum(table.get(key, 0) for table in tables) for table in tables for key in table}
