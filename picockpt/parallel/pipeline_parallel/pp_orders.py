"""A clock that runs any pipeline order (run_orders), and what ZB-H1's waiting W's hold (w_pending_bytes).

The orders are pp_schedules.py's Actions; chunk c of rank s is virtual stage c P + s. The clock starts each action
when its rank is free and its input (or gradient) has arrived, and times the step; the ranks run the same orders
(pp_runner.py) and their timelines measure what this models. ZB-H1 holds 1F1B's activations and, besides, what the
waiting W's read (w_pending_bytes), for up to s micro-batches on rank s (pp_forms.py walks the order with them).
"""
from ...model.config import BYTES
from .pp_schedules import actions


def one_f_one_b_orders(stages, microbatches, schedule="1f1b"):
    """pp_schedules.actions for every stage (chunk 0)."""
    return [actions(schedule, stages, microbatches, s) for s in range(stages)]


def _ready(action, s, P, V, done):
    """When `action` of stage s can start: its input's or gradient's arrival (None: not yet known)."""
    kind, m, c = action  # done: {(stage, kind, m, c): its end}
    if kind == "W":
        return done.get((s, "B", m, c))
    if kind == "F":
        return 0.0 if s == 0 and c == 0 else done.get((P - 1, "F", m, c - 1) if s == 0 else (s - 1, "F", m, c))
    last = s == P - 1 and c == V - 1
    return done.get((s, "F", m, c) if last else (0, "B", m, c + 1) if s == P - 1 else (s + 1, "B", m, c))


def run_orders(orders, stages, virtual=1, times=None, held=(1.0, 1.0), seconds=None):
    """Run each stage's order on one clock; times {"F", "B", "W"} seconds of one action (a chunk's, under
    interleaving; default 1 each), or seconds(stage, action) each its own (unequal stages, chunks). Returns
    {"step", "idle": [share per stage], "held": [the most a stage holds: held[0] a micro-batch-chunk from its F to its
    B, held[1] from its B to its W], "spans": [[(kind, m, c, start, end)]]}."""
    times = {"F": 1.0, "B": 1.0, "W": 1.0, **(times or {})}
    seconds = seconds or (lambda stage, action: times[action.kind])
    weight = {"F": held[0], "B": held[1] - held[0], "W": -held[1]}
    if not any(a.kind == "W" for order in orders for a in order):  # a whole backward frees it all
        weight["B"] = -held[0]
    done, free, holding, most = {}, [0.0] * stages, [0.0] * stages, [0.0] * stages
    spans = [[] for _ in range(stages)]  # also how far each stage has got in its order
    while any(len(spans[s]) < len(orders[s]) for s in range(stages)):
        before = sum(map(len, spans))
        for s in range(stages):
            while len(spans[s]) < len(orders[s]):
                action = orders[s][len(spans[s])]
                arrives = _ready(action, s, stages, virtual, done)
                if arrives is None:
                    break
                start = max(free[s], arrives)
                done[(s,) + tuple(action)] = free[s] = end = start + seconds(s, action)
                spans[s].append((*action, start, end))
                holding[s] += weight[action.kind]
                most[s] = max(most[s], holding[s])
        if sum(map(len, spans)) == before:
            raise ValueError("the orders wait on each other: no stage can run its next action (a deadlock)")
    step = max(free)
    busy = [sum(end - start for *_, start, end in stage) for stage in spans]
    return {"step": step, "idle": [1 - b / step for b in busy], "held": most, "spans": spans}


def w_pending_bytes(cfg, batch, seq, t=1):
    """Bytes one layer holds from its B to its W under ZB-H1, on one of t tensor-parallel ranks (sequence
    parallel): each linear's input (x for q, k, v and the MLP's normed input for gate and up, both gathered to all
    seq tokens; the attention context for o and the SwiGLU product for down, 1/t of their width) and the gradient
    of its output (q, k, v's and gate, up's 1/t wide; o's and down's h wide), in the activation dtype."""
    BT, h, f, kv, e = batch * seq, cfg.hidden, cfg.ffn // t, cfg.kv_dim // t, BYTES[cfg.dtype]
    inputs = BT * (h + h // t + h + f)
    output_grads = BT * (h // t + 2 * kv) + BT * h + 2 * BT * f + BT * h
    return e * (inputs + output_grads)
