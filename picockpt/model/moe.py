"""A Mixtral-style mixture of experts in place of a layer's MLP: its forward, which keeps tensors in
the store, and its hand-written backward (picockpt/model/layer.py calls them when Config.experts > 0).

    x       = xn * noise                 noise ~ U(1 - j, 1 + j) (B, T, h), only with router_jitter j > 0
    probs   = softmax(x Wr^T)            (N, E) N = B*T tokens, E experts; fp32 (the statistics dtype)
    idx, w  = top-k of probs, renormalised                               (N, k) each (ops/router.py)
    out[n]  = sum_j w[n, j] * expert_{idx[n, j]}(x[n])  (+ shared(x[n]))
    expert_e(x) = silu(x G_e^T) * (x U_e^T)  then  @ D_e^T      G_e, U_e: rows 0..f-1, f..2f-1 of gate_up_proj[e]

As Hugging Face's MixtralSparseMoeBlock: the jitter multiplies the block's input (router and
experts see the same noisy x), the softmax is taken in fp32, and each expert runs only on the n_e
tokens routed to it (gathered, projected, weighted, scatter-added back): no dense compute over
all experts. An optional shared expert (Config.shared_expert_ffn) is a SwiGLU MLP every token goes
through, added to the routed experts' sum (an ungated shared expert, as in DeepSeek-V2/V3).

What the block keeps, by name (n_e: tokens routed to expert e, sum_e n_e = N k; e, s: bytes per
activation element and per statistic; fs: the shared expert's width):

    name                 shape          bytes         dropped by
    moe.jitter           (B, T, h)      BTh e         (router_jitter > 0 only: the noise itself)
    moe.router_probs     (N, E)         N E s         router (the router output: its linear run again)
    moe.expert_index     (N, k)         8 N k         (int64: the routing decision, never recomputed)
    moe.gate_up[e]       (n_e, 2f)      2 n_e f e     moe
    moe.act[e]           (n_e, f)       n_e f e       moe_act, moe, cheap
    moe.shared_gate      (N, fs)        N fs e        shared_experts
    moe.shared_up        (N, fs)        N fs e        shared_experts
    moe.shared_act       (N, fs)        N fs e        shared_experts, cheap

An expert without tokens keeps nothing. Every token is kept k times whichever experts it goes to, so a layer's total
does not depend on the routing, only how it splits among the experts (what an expert-parallel rank holding expert e
would keep). The backward reuses the stored routing: a dropped gate_up[e] is projected again from the same tokens, never
routed again. A layer that is recomputed whole (full, every:C) runs its router again on the same input; with jitter the
same noise needs the generator state of the first forward, which the engine replays.
"""
import torch

from ..ops import linear_backward, linear_forward, swiglu_backward, swiglu_forward
from ..ops.router import combine_weights, expert_groups, router_backward, router_forward


def moe_block_forward(xn, w, cfg, keep, tail):
    """xn (B, T, h) the normed input -> the weighted sum of its experts' outputs (B, T, h); keeps what the
    backward needs through keep(name, tensor). Its tail (picockpt/model/block_tail.py) is each expert's down projection
    and weighted add, right after that expert's product; with SKIP_TAIL it stops after the last tensor
    the backward needs (every expert's SwiGLU product) and returns None.
    E and f come from the weights (router rows, down_proj columns); k from cfg."""
    B, T, h = xn.shape
    E, stat = w.router.shape[0], cfg.stat_dtype
    x, index, weights = route(xn, w, cfg, keep)  # (N, h), (N, k), (N, k)
    del xn
    weights = weights.flatten()  # (N k,) one weight per (token, slot) pair
    out = tail(torch.zeros_like, x)  # (N, h)
    for e, positions, tokens in expert_groups(index, E):  # only the experts that got tokens
        y = expert_forward(lambda: x[tokens], w.experts_gate_up[e], w.experts_down[e], keep, e, tail)  # noqa: B023
        tail(lambda: out.index_add_(0, tokens, weigh(y, weights, positions, stat)))  # noqa: B023 (N, h) w * y back
        del y
    if getattr(w, "shared_gate", None) is not None:  # the shared expert: a SwiGLU MLP on every token
        shared = shared_expert_forward(x, w, keep, tail)  # (N, h), or None: its tail skipped
        tail(lambda: out.add_(shared))  # (N, h)
    return tail(lambda: out.view(B, T, h))  # (B, T, h)


def moe_block_backward(grad, normed, w, cfg, take):
    """grad() -> dm (B, T, h), the gradient of the block's output; returns dxn (B, T, h) and {role:
    gradient} of the router, the experts (and the shared expert). normed() gives xn, the block's input.
    Each expert's part is expert_backward's; the router's and the jitter's, block_input_backward's."""
    E, stat = w.router.shape[0], cfg.stat_dtype
    index = take("moe.expert_index")  # (N, k) the routing decision, always kept
    noise = take("moe.jitter") if cfg.router_jitter > 0 else None  # (B, T, h)
    dm = grad()  # (B, T, h)
    B, T, h = dm.shape
    dm = dm.reshape(B * T, h)  # (N, h)
    x, probs = routed_input(normed, noise, w, cfg, take)  # (N, h) the input the experts saw, (N, E)
    weights = combine_weights(probs, index).flatten()  # (N k,) the forward's weights, bitwise
    dx = torch.zeros_like(x)  # (N, h) summed over the experts of each token
    dweights = torch.zeros_like(weights)  # (N k,)
    d_gate_up = torch.zeros_like(w.experts_gate_up)  # (E, 2f, h) an expert without tokens gets zeros
    d_down = torch.zeros_like(w.experts_down)  # (E, h, f)
    for e, positions, tokens in expert_groups(index, E):  # the same groups as the forward: the stored routing
        dxe = expert_backward(lambda: dm[tokens], weights, positions, lambda: x[tokens],  # noqa: B023 (n_e, h)
                              w.experts_gate_up[e], w.experts_down[e], stat, take, e,
                              dweights=dweights, d_gate_up=d_gate_up[e], d_down=d_down[e])  # written in place
        dx.index_add_(0, tokens, dxe)  # (N, h) back to the tokens' rows
        del dxe
    dxn, grads = block_input_backward(dm, dx, dweights, probs, index, x, noise, w, take, (B, T, h))
    return dxn, {"experts_gate_up": d_gate_up, "experts_down": d_down, **grads}


# ---- the block's pieces: the router, one expert, the weighting, the shared expert --------------------
# Written once, used by the block above and by the expert-parallel block (picockpt/parallel/expert_parallel/ep_moe.py),
# which runs the same pieces with the tokens moved between ranks in between.

def route(xn, w, cfg, keep, index=None):
    """xn (B, T, h) -> x (N, h) the experts' input (xn times the jitter noise), index (N, k) the chosen
    experts, weights (N, k) their renormalised probabilities. Keeps moe.jitter, moe.router_probs and
    moe.expert_index. index: a routing decision kept from an earlier forward of the same input, used
    instead of choosing again (and not kept again); the weights come from it, the very same numbers."""
    B, T, h = xn.shape
    if cfg.router_jitter > 0:  # drawn from the default generator, as Hugging Face draws it
        noise = torch.empty_like(xn).uniform_(1.0 - cfg.router_jitter, 1.0 + cfg.router_jitter)  # (B, T, h)
        keep("moe.jitter", noise)
        xn = xn * noise  # (B, T, h) router and experts see the same noisy input
        del noise
    x = xn.reshape(B * T, h)  # (N, h) one row per token
    del xn
    probs, chosen, weights = run_router(x, w, cfg)  # (N, E), (N, k), (N, k)
    keep("moe.router_probs", probs)
    if index is None:
        index = chosen
        keep("moe.expert_index", index)
    else:  # the kept decision: the weights of its experts, from this forward's probabilities
        weights = combine_weights(probs, index)  # (N, k)
    return x, index, weights


def routed_input(normed, noise, w, cfg, take):
    """The backward's x (N, h), the experts' input again (the block's input times the kept jitter noise),
    and probs (N, E), the router's output: kept, or (router) the router run again on that x."""
    xn = normed()  # (B, T, h)
    x = (xn if noise is None else xn * noise).flatten(0, 1)  # (N, h) as route() made it
    del xn
    return x, take("moe.router_probs", rebuild=lambda: run_router(x, w, cfg)[0])  # (N, h), (N, E)


def run_router(x, w, cfg):
    """x (N, h), the experts' input -> probs (N, E), index (N, k), weights (N, k): the router's linear and softmax,
    one function for the forward and the rebuild of `router` (the same ops on the same input: the same numbers)."""
    return router_forward(linear_forward(x, w.router), cfg.experts_per_token, cfg.stat_dtype)


def expert_forward(inputs, gate_up_weight, down_weight, keep, e, tail):
    """One expert's SwiGLU MLP on the n_e rows routed to it: inputs() gives them, x (n_e, h) (gathered
    where it is used, and let go at once) -> y (n_e, h), unweighted. Keeps moe.gate_up[e] and
    moe.act[e]; its tail is the down projection: with SKIP_TAIL it stops after the product, returns None."""
    f = down_weight.shape[-1]
    gate_up = linear_forward(inputs(), gate_up_weight)  # (n_e, 2f) on its n_e tokens
    keep(f"moe.gate_up[{e}]", gate_up)
    act = swiglu_forward(gate_up[:, :f], gate_up[:, f:])  # (n_e, f)
    keep(f"moe.act[{e}]", act)
    del gate_up
    return tail(linear_forward, act, down_weight)  # (n_e, h)


def weigh(y, weights, positions, stat):
    """y (n, h) expert outputs times their weights, weights[positions] (n,), in the statistics dtype,
    back to y's dtype."""
    return (y.to(stat) * weights[positions, None]).to(y.dtype)  # (n, h)


def expert_backward(grad, weights, positions, inputs, gate_up_weight, down_weight, stat, take, e, *, dweights,
                    d_gate_up, d_down):
    """One expert's backward on its n_e rows: grad() gives m (n_e, h), the gradient of the block's output at those rows;
    weights[positions] (n_e,) are theirs; inputs() gives the rows x it saw (n_e, h). Writes d w into dweights[positions]
    and its weight gradients into d_gate_up (2f, h) and d_down (h, f) (the layer's, in place); returns dx (n_e, h).

    Forward, per row n (a token and one of its slots): y_n = act_n D^T, out += w_n y_n, with
    act = silu(g) * u and [g, u] = x_n [G; U]^T. With m_n = d out at the row's token:
      u_n     = m_n D                     (f,)   the gradient w y_n would pass down, without the weight
      d w_n   = m_n . y_n = u_n . act_n          no stored y: (m D) . act = m . (act D^T)
      d act_n = w_n u_n                          d D = sum_n (w_n m_n)^T act_n
      then SwiGLU's backward, and [G; U]'s linear backward on the rows x_n."""
    f = down_weight.shape[-1]
    gate_up = take(f"moe.gate_up[{e}]",  # (n_e, 2f); dropped (moe): its rows projected again
                   rebuild=lambda: linear_forward(inputs(), gate_up_weight))
    gate, up = gate_up[:, :f], gate_up[:, f:]  # (n_e, f) each, views
    act = take(f"moe.act[{e}]", rebuild=lambda: swiglu_forward(gate, up))  # (n_e, f)
    m = grad()  # (n_e, h) the output gradient of its rows
    we = weights[positions, None]  # (n_e, 1)
    u = m @ down_weight  # (n_e, f)
    dweights[positions] = (u.to(stat) * act.to(stat)).sum(dim=-1)  # (n_e,) d w = u . act
    d_down[...] = (m.to(stat) * we).to(m.dtype).T @ act  # (h, f) d D = (w m)^T act
    del m, act
    dact = (u.to(stat) * we).to(u.dtype)  # (n_e, f)
    del u
    dgate, dup = swiglu_backward(dact, gate, up)  # (n_e, f) each
    del dact, gate, up, gate_up
    dgate_up = torch.cat([dgate, dup], dim=1)  # (n_e, 2f)
    del dgate, dup
    dx, d_gate_up[...] = linear_backward(dgate_up, inputs(), gate_up_weight)  # (n_e, h), (2f, h)
    return dx


def shared_expert_forward(x, w, keep, tail):
    """The shared expert, a SwiGLU MLP on every token: x (N, h) -> (N, h), or None (its tail, the down
    projection, skipped: SKIP_TAIL)."""
    gate = linear_forward(x, w.shared_gate)  # (N, fs)
    up = linear_forward(x, w.shared_up)  # (N, fs)
    keep("moe.shared_gate", gate)
    keep("moe.shared_up", up)
    act = swiglu_forward(gate, up)  # (N, fs)
    keep("moe.shared_act", act)
    del gate, up
    return tail(linear_forward, act, w.shared_down)  # (N, h)


def shared_expert_backward(dm, x, w, take, dx):
    """dm (N, h) -> {role: gradient} of the shared expert, as the dense MLP's backward; adds its gradient
    of x to dx (N, h) in place (x feeds the routed experts and the shared one: their gradients add)."""
    grads = {}
    gate = take("moe.shared_gate", rebuild=lambda: linear_forward(x, w.shared_gate))  # (N, fs)
    up = take("moe.shared_up", rebuild=lambda: linear_forward(x, w.shared_up))  # (N, fs)
    act = take("moe.shared_act", rebuild=lambda: swiglu_forward(gate, up))  # (N, fs)
    dact, grads["shared_down"] = linear_backward(dm, act, w.shared_down)  # (N, fs), (h, fs)
    del act
    dgate, dup = swiglu_backward(dact, gate, up)  # (N, fs) each
    del dact, gate, up
    dx_gate, grads["shared_gate"] = linear_backward(dgate, x, w.shared_gate)  # (N, h), (fs, h)
    dx += dx_gate
    del dgate, dx_gate
    dx_up, grads["shared_up"] = linear_backward(dup, x, w.shared_up)  # (N, h), (fs, h)
    dx += dx_up
    del dup, dx_up
    return grads


def block_input_backward(dm, dx, dweights, probs, index, x, noise, w, take, shape):
    """The end of a block's backward, once its experts' part is in dx (N, h) and dweights (N k,): the shared
    expert's (its share added to dx), then the router's and the jitter's. Returns dxn (shape) and {role:
    gradient} of the router (and the shared expert)."""
    grads = {}
    if getattr(w, "shared_gate", None) is not None:  # the shared expert, as the dense MLP's backward
        grads = shared_expert_backward(dm, x, w, take, dx)  # {role: gradient}; its share added to dx
    dlogits = router_backward(dweights.view(index.shape), probs, index).to(x.dtype)  # (N, E)
    dx_router, d_router = linear_backward(dlogits, x, w.router)  # (N, h), (E, h)
    del dlogits
    dx += dx_router  # (N, h) x feeds the router and the experts: their gradients add
    del dx_router
    dxn = dx.view(shape) if noise is None else dx.view(shape) * noise  # (B, T, h) x = xn * noise
    return dxn, {"router": d_router, **grads}
