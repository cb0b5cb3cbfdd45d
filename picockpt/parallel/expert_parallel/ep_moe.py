"""A mixture of experts over ep ranks: tokens go to the rank that holds their expert and come back, every all-to-all
written where it happens. Rank r of W holds experts r*E/W .. (r+1)*E/W - 1 (E_l of them) and its B/W sequences,
N_r = B*T/W tokens. The block is picockpt/model/moe.py's, piece by piece, rows moved between ranks in between; a (token,
slot) pair is one row, sent twice for two experts of one rank (DeepSpeed-MoE; Megatron's all-to-all token dispatcher).

    forward (this rank)                                        bytes counted (comm.py: the input's)
    x, index, w  = route(xn)                  own tokens
    counts       = all-to-all of E int64     first forward only  8 E
    rows         = all-to-all of x[pairs]     dispatch (P -> M)   P h e      P = N_r k pairs sent
    row_w        = all-to-all of w[pairs]     their weights       P s        M = rows received here
    y            = expert(rows) * row_w       E_l experts, each on its rows from every rank
    back         = all-to-all of y            combine (M -> P)    M h e
    out[token]  += back                       as moe.py's index_add

    backward: each all-to-all's adjoint, the inverse all-to-all (ep_comm.py's all_to_all_backward)
    grads        = all-to-all of dm[pairs]    the combine's       P h e
    d w[pairs]   = all-to-all of d row_w      the weights'        M s
    dx[pairs]    = all-to-all of d rows       the dispatch's      M h e

The weights travel with the tokens (Megatron-LM's permuted probs): the expert's rank weighs its outputs, and the
backward finds there what expert_backward needs. Kept beyond moe.py's router rows and the experts' tensors:

    name                   shape       bytes    kept
    moe.expert_index       (N_r, k)    8 N_r k  by every layer's first forward, whatever its mode: a recomputed
    moe.received_counts    (W, E_l)    8 E      layer reads them, so no jitter or rounding sends a token elsewhere
    moe.dispatched         (M, h)      M h e    with the layer's activations (the experts' input); dropped by moe;
    moe.dispatched_weights (M,)        M s      every first forward's with keep_dispatched

Without the dispatched rows the dispatch runs again, two all-to-alls; keep_dispatched trades that for memory. A
recomputed layer's combine always runs again."""
from collections import namedtuple

import torch

from ...model.moe import block_input_backward, expert_backward, expert_forward, route
from ...model.moe import routed_input, shared_expert_forward, weigh
from ...ops.router import combine_weights, expert_counts, expert_groups
from .ep_comm import all_to_all_backward, all_to_all_forward

ROUTING = ("moe.expert_index", "moe.received_counts")  # kept by every layer's first forward
DISPATCHED = ("moe.dispatched", "moe.dispatched_weights")  # the rows an expert's rank received

Plan = namedtuple("Plan", "order tokens send receive")


def dispatch_plan(index, received, comm):
    """Where this rank's (token, slot) pairs go: order (P,) the pairs by expert (so by rank), tokens (P,) their rows,
    send (W ints) per rank; receive (W ints) the rows each rank sends here, from the first forward's received."""
    W, k, E_l = comm.world_size, index.shape[1], received.shape[1]
    per_expert = expert_counts(index, W * E_l)  # E ints: this rank's pairs per expert
    order = index.flatten().argsort(stable=True)  # (P,) as expert_groups sorts them: expert by expert
    send = [sum(per_expert[s * E_l:(s + 1) * E_l]) for s in range(W)]  # pairs for rank s's experts
    return Plan(order, order // k, send, received.sum(dim=1).tolist())


def local_groups(received):
    """(e_local, rows) of every local expert with rows: the received rows come grouped by source rank, and within
    each by expert; rows lists e_local's, source by source (in the single process's token order: rank 0's first)."""
    W, E_l = received.shape
    expert_of_row = torch.arange(E_l, device=received.device).repeat(W).repeat_interleave(received.flatten())  # (M,)
    return ((e, rows) for e, rows, _ in expert_groups(expert_of_row[:, None], E_l))


def ep_moe_forward(xn, w, cfg, comm, keep, kept, first_expert, keep_dispatched, tail):
    """xn (B_r, T, h) this rank's normed input -> the block's output (B_r, T, h), or None under SKIP_TAIL
    (block_tail.py). keep: the layer's (the policy's); kept: its KeptRouting (ep_layer.py); w: its E_l experts."""
    (B, T, h), W, E, stat = xn.shape, comm.world_size, cfg.experts, cfg.stat_dtype
    routed = kept.has("moe.expert_index")  # a recomputation: the first forward chose the routing
    x, index, weights = route(xn, w, cfg, lambda name, tensor: (kept.put if name in ROUTING else keep)(name, tensor),
                              kept.get("moe.expert_index") if routed else None)  # (N_r, h), (N_r, k) x2; ROUTING kept
    del xn
    if routed:
        received = kept.get("moe.received_counts")  # (W, E_l)
    else:  # each rank tells each other rank how many of its pairs go to each of that rank's experts
        counts = torch.tensor(expert_counts(index, E), dtype=torch.int64, device=x.device)  # (E,)
        received = all_to_all_forward(counts, comm, [E // W] * W, [E // W] * W).view(W, E // W)  # (W, E_l)
        kept.put("moe.received_counts", received)
    plan = dispatch_plan(index, received, comm)
    if kept.has("moe.dispatched"):  # kept by the first forward (keep_dispatched): nothing moves
        rows, row_weights = kept.get("moe.dispatched"), kept.get("moe.dispatched_weights")  # (M, h), (M,)
    else:  # dispatch: each pair's token row, then its weight, to the rank of its expert (all-to-alls, P rows out, M in)
        rows = all_to_all_forward(x[plan.tokens], comm, plan.send, plan.receive)  # (M, h)
        row_weights = all_to_all_forward(weights.flatten()[plan.order], comm, plan.send, plan.receive)  # (M,)
        for name, tensor in zip(DISPATCHED, (rows, row_weights)):  # every first forward's, or the layer's own
            (kept.put if keep_dispatched else keep)(name, tensor)
    del index, weights
    out_rows = tail(torch.empty_like, rows)  # (M, h) every row is one local expert's
    for e, rows_e in local_groups(received):
        y = expert_forward(lambda: rows[rows_e], w.experts_gate_up[e], w.experts_down[e], keep,  # noqa: B023
                           first_expert + e, tail)  # (n_e, h) on its rows from every rank, or None
        tail(lambda: out_rows.index_copy_(0, rows_e, weigh(y, row_weights, rows_e, stat)))  # noqa: B023 (n_e, h) w * y
        del y
    del rows, row_weights
    # combine: the inverse all-to-all, each weighted row back to its token's rank (M rows out, P in)
    back = tail(all_to_all_forward, out_rows, comm, plan.receive, plan.send)  # (P, h) in this rank's pair order
    del out_rows
    out = tail(lambda: torch.zeros_like(x).index_add_(0, plan.tokens, back))  # (N_r, h) summed over each token's slots
    del back
    if getattr(w, "shared_gate", None) is not None:  # the shared expert: replicated, on this rank's tokens
        shared = shared_expert_forward(x, w, keep, tail)  # (N_r, h), or None: its tail skipped
        tail(lambda: out.add_(shared))  # (N_r, h)
    return tail(lambda: out.view(B, T, h))  # (B_r, T, h)


def ep_moe_backward(grad, normed, w, cfg, comm, take, first_expert):
    """grad() -> dm, normed() -> xn (B_r, T, h); returns dxn and {role: gradient}: the router's and shared expert's
    from this rank's tokens (replicated: summed over ranks later), its experts' (E_l, ...) from every rank's rows."""
    index, received = take("moe.expert_index"), take("moe.received_counts")  # (N_r, k), (W, E_l): always kept
    noise = take("moe.jitter") if cfg.router_jitter > 0 else None  # (B_r, T, h)
    plan = dispatch_plan(index, received, comm)
    dm = grad()  # (B_r, T, h)
    (B, T, h), dm = dm.shape, dm.reshape(-1, dm.shape[-1])  # (N_r, h)
    x, probs = routed_input(normed, noise, w, cfg, take)  # (N_r, h) the input the experts saw, (N_r, E)
    weights = combine_weights(probs, index).flatten()  # (N_r k,) the forward's weights, bitwise
    # the combine's backward: out[token] += back[pair], so d back[pair] = dm[token]; the inverse
    # all-to-all takes each pair's row to the rank whose expert made it (P rows out, M in)
    grads_rows = all_to_all_backward(dm[plan.tokens], comm, plan.receive, plan.send)  # (M, h)
    # the experts' input (M, h) and weights (M,): kept, or dispatched again (a rebuild: counted as recompute)
    rows = take("moe.dispatched", rebuild=lambda: all_to_all_forward(x[plan.tokens], comm, plan.send, plan.receive))
    row_weights = take("moe.dispatched_weights",
                       rebuild=lambda: all_to_all_forward(weights[plan.order], comm, plan.send, plan.receive))
    d_rows, d_row_weights = torch.empty_like(rows), torch.empty_like(row_weights)  # (M, h), (M,): all written below
    d_gate_up, d_down = torch.zeros_like(w.experts_gate_up), torch.zeros_like(w.experts_down)  # 0 if no rows come
    for e, rows_e in local_groups(received):
        d_rows[rows_e] = expert_backward(lambda: grads_rows[rows_e], row_weights, rows_e,  # noqa: B023 (n_e, h)
                                         lambda: rows[rows_e], w.experts_gate_up[e], w.experts_down[e],  # noqa: B023
                                         cfg.stat_dtype, take, first_expert + e, dweights=d_row_weights,
                                         d_gate_up=d_gate_up[e], d_down=d_down[e])
    del grads_rows, rows, row_weights
    # the weights' dispatch backward: each row's d w back to its token's rank (M values out, P in)
    dweights = torch.empty_like(weights)  # (N_r k,)
    dweights[plan.order] = all_to_all_backward(d_row_weights, comm, plan.send, plan.receive)  # (P,) by pair
    del d_row_weights
    # the dispatch's backward: each row's dx back to its token's rank (M rows out, P in)
    dx_pairs = all_to_all_backward(d_rows, comm, plan.send, plan.receive)  # (P, h)
    del d_rows
    dx = torch.zeros_like(x).index_add_(0, plan.tokens, dx_pairs)  # (N_r, h) summed over each token's slots
    del dx_pairs
    # the shared expert (replicated, on this rank's tokens), the router and the jitter, as in one process
    dxn, grads = block_input_backward(dm, dx, dweights, probs, index, x, noise, w, take, (B, T, h))  # (B_r, T, h)
    return dxn, {"experts_gate_up": d_gate_up, "experts_down": d_down, **grads}
