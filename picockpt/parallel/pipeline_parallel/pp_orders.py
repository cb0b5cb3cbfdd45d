"""Pipeline orders beyond AFAB and 1F1B, and a clock that runs any order (run_orders): interleaved 1F1B and ZB-H1,
modelled.

An Action is (kind, microbatch, chunk): "F" a forward, "B" a backward (the whole backward under AFAB, 1F1B and
interleaving; only the input gradient under ZB-H1), "W" the weight gradients. Chunk c of rank s is virtual stage
c P + s: a micro-batch's forward runs chunk 0 on ranks 0..P-1, then chunk 1, ..., and its backward the reverse.

Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2; Megatron-LM's forward_backward_pipelining_with_interleaving):
rank s warms up with (P - s - 1) 2 + (V - 1) P forwards, M a multiple of P; forward k is micro-batch
(k // (P V)) P + k % P of chunk (k // P) % V, backward k the same micro-batch of chunk V - 1 - (k // P) % V.
Each chunk holds 1/V of the rank's layers, so a forward is 1/V of 1F1B's: the bubble shrinks to
(P - 1) / (V M + P - 1) of the step, for more micro-batch-chunks in flight: 1 + (P - 1) / (P V) times 1F1B's bytes
on stage 0 (Korthikanti et al. 2022, sec. 4.2.3).

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3; the order of sail-sg/zero-bubble-pipeline-
parallelism's ZeroBubbleH1Pipeline, exact semantics): rank s runs 1F1B's P - s - 1 warm-up forwards, then s
pairs F, B whose W waits, then F, B, W together while forwards remain, B, W while backwards remain, and the s
waiting W's last. With equal F, B, W times the bubble falls from 1F1B's (P - 1)(F + B + W) to (P - 1)(F + B - W),
a third of it. It holds 1F1B's activations (a micro-batch's until its B) and, besides, what the waiting W's read:
each linear's input and its output's gradient (w_pending_bytes), for up to s micro-batches on rank s.

Nothing here runs ranks: picockpt's ranks run AFAB and 1F1B (pp_schedules.py); these orders are what a pipeline
would run, timed by the same clock that times those two.
"""
from collections import namedtuple

from ...config import BYTES
from .pp_schedules import actions

Action = namedtuple("Action", "kind microbatch chunk", defaults=(0,))


def check_interleaving(stages, microbatches, virtual):
    for name, value in (("pp", stages), ("microbatches", microbatches), ("virtual_stages", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: give a whole number, 1 or more")
    if microbatches % stages:
        raise ValueError(f"microbatches={microbatches} with pp={stages} and virtual_stages={virtual}: interleaving "
                         f"runs micro-batches in groups of pp (Megatron-LM requires M % pp == 0); use a multiple of "
                         f"{stages}, e.g. {stages * max(1, microbatches // stages)}")


def interleaved_actions(stages, microbatches, virtual, stage):
    """Rank `stage`'s Actions under interleaved 1F1B with `virtual` chunks a rank."""
    check_interleaving(stages, microbatches, virtual)
    P, total = stages, microbatches * virtual

    def which(k, backward):
        chunk = (k // P) % virtual
        return (k // (P * virtual)) * P + k % P, virtual - 1 - chunk if backward else chunk

    warmup = total if microbatches == P else min(total, (P - stage - 1) * 2 + (virtual - 1) * P)
    order = [Action("F", *which(k, False)) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: the next forward, then the oldest backward
        order += [Action("F", *which(warmup + k, False)), Action("B", *which(k, True))]
    return order + [Action("B", *which(k, True)) for k in range(total - warmup, total)]


def one_f_one_b_orders(stages, microbatches, schedule="1f1b"):
    """pp_schedules.actions for every stage, as this module's Actions (chunk 0)."""
    return [[Action(a.kind, a.microbatch) for a in actions(schedule, stages, microbatches, s)] for s in range(stages)]


def _ready(action, s, P, V, done):
    """When `action` of stage s can start: its input's or gradient's arrival (None: not yet known)."""
    kind, m, c = action
    if kind == "F":
        source = None if s == 0 and c == 0 else (("F", m, c - 1), P - 1) if s == 0 else (("F", m, c), s - 1)
    elif kind == "B":
        last = s == P - 1 and c == V - 1
        source = (("F", m, c), s) if last else (("B", m, c + 1), 0) if s == P - 1 else (("B", m, c), s + 1)
    else:
        source = (("B", m, c), s)
    return 0.0 if source is None else done.get((source[1],) + source[0])


def run_orders(orders, stages, virtual=1, times=None, held=(1.0, 1.0)):
    """Run each stage's order on one clock; times {"F", "B", "W"} seconds of one action (a chunk's, under
    interleaving; default 1 each). Returns {"step", "idle": [share per stage], "held": [the most a stage holds:
    held[0] a micro-batch-chunk from its F to its B, held[1] from its B to its W], "spans": [[(kind, m, c, start,
    end)]]}."""
    times = {"F": 1.0, "B": 1.0, "W": 1.0, **(times or {})}
    weight = {"F": held[0], "B": held[1] - held[0], "W": -held[1]}
    if not any(a.kind == "W" for order in orders for a in order):  # a whole backward frees it all
        weight["B"] = -held[0]
    done, free, position = {}, [0.0] * stages, [0] * stages
    holding, most, spans = [0.0] * stages, [0.0] * stages, [[] for _ in range(stages)]
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                arrives = _ready(action, s, stages, virtual, done)
                if arrives is None:
                    break
                start = max(free[s], arrives)
                end = start + times[action.kind]
                done[(s,) + tuple(action)] = free[s] = end
                spans[s].append((*action, start, end))
                holding[s] += weight[action.kind]
                most[s] = max(most[s], holding[s])
                position[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("the orders wait on each other: no stage can run its next action (a deadlock)")
    step = max(free)
    busy = [sum(end - start for *_, start, end in stage) for stage in spans]
    return {"step": step, "idle": [1 - b / step for b in busy], "held": most, "spans": spans}


def zb_h1_actions(stages, microbatches, stage):
    """Rank `stage`'s Actions under ZB-H1: 1F1B's warm-up, then `stage` forward-backward pairs whose W waits,
    then F, B, W together while forwards remain, B and W while backwards remain, and the waiting W's last."""
    P, M, s = stages, microbatches, stage
    order, n = [], {"F": 0, "B": 0, "W": 0}

    def run(*kinds):
        for kind in kinds:
            order.append(Action(kind, n[kind]))
            n[kind] += 1
    for _ in range(min(P - s - 1, M)):
        run("F")
    for _ in range(min(s, M - n["F"])):
        run("F", "B")
    while n["F"] < M:
        run("F", "B", "W")
    while n["B"] < M:
        run("B", "W")
    while n["W"] < M:
        run("W")
    return order


def w_pending_bytes(cfg, batch, seq, t=1):
    """Bytes one layer holds from its B to its W under ZB-H1, on one of t tensor-parallel ranks (sequence
    parallel): each linear's input (x for q, k, v and the MLP's normed input for gate and up, both gathered to all
    seq tokens; the attention context for o and the SwiGLU product for down, 1/t of their width) and the gradient
    of its output (q, k, v's and gate, up's 1/t wide; o's and down's h wide), in the activation dtype."""
    BT, h, f, kv, e = batch * seq, cfg.hidden, cfg.ffn // t, cfg.kv_dim // t, BYTES[cfg.dtype]
    inputs = BT * (h + h // t + h + f)
    output_grads = BT * (h // t + 2 * kv) + BT * h + 2 * BT * f + BT * h
    return e * (inputs + output_grads)
