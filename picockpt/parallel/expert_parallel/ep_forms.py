"""Closed forms per expert-parallel rank r of W, which the tracker equals to the byte: the bytes it stores, the bytes
its all-to-alls move, its FLOPs. What a rank holds depends on the tokens its experts receive, so these take the step's
routing: L lists of E per-expert token counts over the whole batch (picockpt.model.routing.step_routing); rank r
receives M_l, its experts' counts in layer l summed, and sends P = (B/W) T k pairs. A stored layer is step_forms.py's at
batch B/W, its experts' rows sized by every rank's tokens, plus ep_moe.py's table, whose routing every first forward
keeps whatever its mode (always_kept_bytes: segments_peak's `always`). Beside tensor parallelism a rank stores
tp_forms.py's split of the layer, its experts' rows f/t wide; every matmul but the router's is 1/t."""
import math

from ...planning.step_forms import head_inventory, inner_recompute_flops, segments_peak, step_flops, total
from ...model.params import param_shapes
from ...recompute.policy import as_policy
from .ep_layer import ep_drop
from .ep_shard import is_expert
from .ep_moe import DISPATCHED
from ...model.config import BYTES
from ..comm import PHASES
from ..tensor_parallel.tp_forms import rank_head_inventory, rank_layer_inventory


def received_rows(cfg, counts, ep, rank):
    """M: the rows rank r's experts receive in a layer whose per-expert counts (whole batch) are `counts`."""
    local = cfg.experts // ep
    return sum(counts[rank * local:(rank + 1) * local])


def _check(cfg, batch, seq, policy, ep, rank, routing):
    policy = as_policy(policy, cfg)
    if policy.budget is not None:
        raise ValueError(f"policy {policy.text!r}: expert parallelism has no per-rank budget planner; use none, "
                         f"full or every:C with op-level options")
    if routing is None or len(routing) != cfg.layers or any(sum(c) != batch * seq * cfg.experts_per_token
                                                            for c in routing):
        raise ValueError(f"routing: give one list of E={cfg.experts} per-expert token counts per layer (L={cfg.layers})"
                         f" over the whole batch, each summing to B*T*k (picockpt.model.routing.step_routing)")
    if not 0 <= rank < ep:
        raise ValueError(f"rank={rank}: use 0 <= rank < ep={ep}")
    return policy


def ep_layer_inventory(cfg, batch, seq, ep, rank, counts, unstored=frozenset(), keep_dispatched=False, t=1, sp=False):
    """What one layer stored whole keeps on rank `rank` of ep, its input included: name -> (shape, dtype, bytes).
    batch: the whole batch (rank r computes batch/ep sequences); counts: the layer's E ints; t, sp: beside tp."""
    unstored = ep_drop(frozenset(unstored))
    (act, stat, _), local, f, h = cfg.dtype_names, cfg.experts // ep, cfg.ffn // t, cfg.hidden
    plain = rank_layer_inventory(cfg, batch // ep, seq, t, sp, unstored)  # its own sequences (tp's split)
    rows = [(name, shape, dtype) for name, (shape, dtype, _) in plain.items()
            if not name.startswith(("moe.gate_up[", "moe.act["))]
    for e in range(rank * local, (rank + 1) * local):  # its experts, on their rows from every rank
        if counts[e]:
            rows += [(f"moe.gate_up[{e}]", (counts[e], 2 * f), act), (f"moe.act[{e}]", (counts[e], f), act)]
    M = received_rows(cfg, counts, ep, rank)
    rows += [("moe.received_counts", (ep, local), "int64"), ("moe.dispatched", (M, h), act),
             ("moe.dispatched_weights", (M,), stat)]
    kept = {"moe.received_counts"} | (set(DISPATCHED) if keep_dispatched else set())  # whatever the op level
    return {name: (shape, dtype, math.prod(shape) * BYTES[dtype]) for name, shape, dtype in rows
            if name in kept or name.partition("[")[0] not in unstored}


def always_kept_bytes(cfg, batch, seq, ep, rank, counts, keep_dispatched=False):
    """R: what a layer's first forward keeps whatever its mode (ep_moe.py's table: ROUTING, and DISPATCHED too)."""
    (act, stat, _), M = cfg.dtype_names, received_rows(cfg, counts, ep, rank)
    routing = 8 * (batch // ep) * seq * cfg.experts_per_token + 8 * cfg.experts
    return routing + (M * (cfg.hidden * BYTES[act] + BYTES[stat]) if keep_dispatched else 0)


def ep_peak_bytes(cfg, batch, seq, policy, ep, rank, routing, keep_dispatched=False, head=True, t=1, sp=False):
    """The exact peak of rank r's activation store over one step. head=False: a pipeline stage before the last
    (cfg.layers its layers, routing theirs), which has no head."""
    policy = _check(cfg, batch, seq, policy, ep, rank, routing)
    A = [total(ep_layer_inventory(cfg, batch, seq, ep, rank, counts, policy.unstored, keep_dispatched, t, sp))
         for counts in routing]
    F = ep_head_stored_bytes(cfg, batch, seq, policy, ep, t, sp) if head else 0
    if policy.segment is None:
        return sum(A) + F
    X = rank_layer_inventory(cfg, batch // ep, seq, t, sp)["input"][2]  # a layer input: its batch/ep sequences
    R = [always_kept_bytes(cfg, batch, seq, ep, rank, counts, keep_dispatched) for counts in routing]
    return segments_peak([X] * cfg.layers, A, F, policy.segment, always=R)


def ep_layer_stored_bytes(cfg, batch, seq, policy, ep, rank, routing, keep_dispatched=False, layer=0, t=1, sp=False):
    """What one layer holds on rank r at the end of the forward: stored whole, or its checkpoint (its input, under
    every:C the first layer of a segment) and what every first forward keeps."""
    policy = _check(cfg, batch, seq, policy, ep, rank, routing)
    counts = routing[layer]
    if policy.segment is None:
        return total(ep_layer_inventory(cfg, batch, seq, ep, rank, counts, policy.unstored, keep_dispatched, t, sp))
    X = rank_layer_inventory(cfg, batch // ep, seq, t, sp)["input"][2] if layer % policy.segment == 0 else 0
    return X + always_kept_bytes(cfg, batch, seq, ep, rank, counts, keep_dispatched)


def ep_stored_bytes(cfg, batch, seq, policy, ep, rank, routing, keep_dispatched=False, head=True, t=1, sp=False):
    """E: what rank r's store holds at the end of the forward (every layer's share, and the head's)."""
    layers = sum(ep_layer_stored_bytes(cfg, batch, seq, policy, ep, rank, routing, keep_dispatched, k, t, sp)
                 for k in range(cfg.layers))
    return layers + (ep_head_stored_bytes(cfg, batch, seq, policy, ep, t, sp) if head else 0)


def ep_head_stored_bytes(cfg, batch, seq, policy, ep, t=1, sp=False):
    """What the head holds on a rank after the forward: picockpt's head on its batch/ep sequences (tp's, beside)."""
    unstored = as_policy(policy, cfg).unstored
    return total(rank_head_inventory(cfg, batch // ep, seq, t, sp, unstored) if t > 1
                 else head_inventory(cfg, batch // ep, seq, unstored))


def replicated_grad_bytes(cfg):
    """Bytes of the gradients the data-parallel buckets (dp_comm.py) sum over the ranks: every weight but the
    experts', in the master dtype (a tied embedding and LM head are one matrix)."""
    master = BYTES[cfg.dtype_names[2]]
    return sum(math.prod(shape) * master for name, shape in param_shapes(cfg).items() if not is_expert(name))


def ep_layer_comm_bytes(cfg, batch, seq, policy, ep, rank, counts, keep_dispatched=False):
    """{"forward", "recompute", "backward"}: bytes one layer's all-to-alls move on rank r in one step."""
    P, M = (batch // ep) * seq * cfg.experts_per_token, received_rows(cfg, counts, ep, rank)
    return _all_to_all_bytes(cfg, as_policy(policy, cfg), P, M, cfg.experts, keep_dispatched)


def _all_to_all_bytes(cfg, policy, P, M, E, keep_dispatched):
    """The bytes of one layer's all-to-alls for P rows sent, M received and E expert counts exchanged."""
    (act, stat, _), h = (BYTES[name] for name in cfg.dtype_names), cfg.hidden
    dispatch = P * h * act + P * stat  # the tokens and their weights, to the experts' ranks
    combine = M * h * act  # the weighted rows, back to their tokens' ranks
    recompute = 0
    if policy.segment is not None:  # the layer's forward once more (every:C), the routing and its counts kept
        recompute += (0 if keep_dispatched else dispatch) + combine
    if "moe.gate_up" in policy.unstored and not keep_dispatched:  # the backward sends the dropped rows again
        recompute += dispatch
    return {"forward": 8 * E + dispatch + combine, "recompute": recompute,
            "backward": P * h * act + M * stat + M * h * act}


def ep_sent_bytes(cfg, batch, seq, policy, ep, rank, routing_by_rank, keep_dispatched=False):
    """The bytes rank r's all-to-alls send to other ranks: each buffer less the rows it sends itself, the same forms
    with P = M = S and E/W counts. routing_by_rank: every layer's W lists of E counts (step_routing(..., ranks=W))."""
    policy, sent = as_policy(policy, cfg), dict.fromkeys(PHASES, 0)
    for by_rank in routing_by_rank:
        counts = [sum(column) for column in zip(*by_rank)]  # the whole batch's per-expert counts
        buffer = ep_layer_comm_bytes(cfg, batch, seq, policy, ep, rank, counts, keep_dispatched)
        S = received_rows(cfg, by_rank[rank], ep, rank)  # its own tokens' pairs to its own experts: sent to itself
        own = _all_to_all_bytes(cfg, policy, S, S, cfg.experts // ep, keep_dispatched)
        sent = {phase: n + buffer[phase] - own[phase] for phase, n in sent.items()}
    return sent


def ep_comm_bytes(cfg, batch, seq, policy, ep, rank, routing, keep_dispatched=False):
    """{"forward", "recompute", "backward"}: bytes rank r's all-to-alls move in one step, every layer's."""
    policy = _check(cfg, batch, seq, policy, ep, rank, routing)
    return phase_sums(ep_layer_comm_bytes(cfg, batch, seq, policy, ep, rank, counts, keep_dispatched)
                      for counts in routing)


def phase_sums(tables):
    """{phase: the sum over tables} of {phase: count} tables (comm.py's PHASES): layers', micro-batches'."""
    tables = list(tables)
    return {phase: sum(table[phase] for table in tables) for phase in PHASES}


def ep_flops(cfg, batch, seq, policy, ep, rank, routing, keep_dispatched=False, head=True, t=1):
    """Rank r's matmul FLOPs per phase: the single process's step_flops at batch/ep, its experts on the M_l rows they
    receive instead of the P pairs it sends (each row 2h*3f forward, twice that backward, 2h*2f when moe rebuilds
    the projections). head=False: a pipeline stage before the last, without the LM head's matmuls. Beside tp every
    matmul is 1/t but the router's, whole on every rank (h -> E per token: forward, twice in the backward, again in
    a recompute or a rebuild)."""
    policy = _check(cfg, batch, seq, policy, ep, rank, routing)
    b, h, f = batch // ep, cfg.hidden, cfg.ffn
    flops = step_flops(cfg, b, seq, policy)
    if not head:
        logits, (_, inner_head) = 2 * b * seq * h * cfg.vocab, inner_recompute_flops(cfg, b, seq)
        flops = {"forward": flops["forward"] - logits, "recompute": flops["recompute"] - inner_head,
                 "backward": flops["backward"] - 2 * logits}
    extra = [received_rows(cfg, counts, ep, rank) - b * seq * cfg.experts_per_token for counts in routing]  # M_l - P
    forward = sum(2 * n * h * 3 * f for n in extra)
    rebuild = sum(2 * n * h * 2 * f for n in extra) if "moe.gate_up" in policy.unstored else 0  # moe: gate_up again
    experts = {"forward": forward, "backward": 2 * forward,
               "recompute": (forward if policy.segment is not None else 0) + rebuild}
    router = 2 * b * seq * h * cfg.experts * cfg.layers
    again = (policy.segment is not None) + ("moe.router_probs" in policy.unstored)
    whole = {"forward": router, "backward": 2 * router, "recompute": again * router}
    return {phase: (n + experts[phase] - whole[phase]) // t + whole[phase] for phase, n in flops.items()}
