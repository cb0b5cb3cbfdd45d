"""The top-k router of a mixture of experts (Mixtral's), and the grouping of tokens by expert.

    probs   = softmax(logits)              (N, E)  in the statistics dtype (fp32 at least), as Hugging Face
    top, i  = topk(probs, k)               (N, k)  each token's k most probable experts
    w       = top / sum_j top_j            (N, k)  renormalised: the weights of the k expert outputs

The routing decision i is piecewise constant in the logits: no gradient flows through it, only
through the k probabilities it picks. A backward that has the stored probs and i recomputes w
bitwise (gather, sum, divide), and recomputation never chooses experts again.
"""
import torch


def router_forward(logits, k, stat_dtype):
    """logits (N, E) -> probs (N, E), index (N, k) int64, weights (N, k), as MixtralTopKRouter."""
    probs = torch.softmax(logits.to(stat_dtype), dim=-1)  # (N, E)
    top, index = probs.topk(k, dim=-1)  # (N, k) each
    return probs, index, top / top.sum(dim=-1, keepdim=True)  # (N, E), (N, k), (N, k)


def combine_weights(probs, index):
    """The forward's weights again, from the kept probs and index: the very same numbers."""
    top = probs.gather(1, index)  # (N, k) the values topk returned
    return top / top.sum(dim=-1, keepdim=True)  # (N, k)


def router_backward(dweights, probs, index):
    """dweights (N, k) -> dlogits (N, E), in the statistics dtype.

    Forward: p = softmax(l); t_j = p[i_j] (the top k); w_j = t_j / s with s = sum_m t_m.
      dt_j = sum_m dw_m dw_m/dt_j = dw_j / s - sum_m dw_m t_m / s^2 = (dw_j - sum_m dw_m w_m) / s
      dp   = dt scattered to the columns i_j; the other E - k columns get nothing
      dl   = p * (dp - sum_e dp_e p_e)                  (the softmax backward)
    """
    top = probs.gather(1, index)  # (N, k)
    s = top.sum(dim=-1, keepdim=True)  # (N, 1)
    weights = top / s  # (N, k)
    dtop = (dweights - (dweights * weights).sum(dim=-1, keepdim=True)) / s  # (N, k)
    dprobs = torch.zeros_like(probs).scatter_(1, index, dtop)  # (N, E)
    return probs * (dprobs - (dprobs * probs).sum(dim=-1, keepdim=True))  # (N, E)


def expert_groups(index, experts):
    """The tokens of each expert that has any: (e, positions (n_e,), tokens (n_e,)) in expert order.
    positions index the N*k (token, slot) pairs of index.flatten(); tokens = positions // k. Within an
    expert the tokens come in increasing order, each once (a token's k experts differ). The counts
    n_e are data-dependent and read on the host (one synchronisation on a GPU)."""
    k = index.shape[1]
    flat = index.flatten()  # (N k,)
    order = flat.argsort(stable=True)  # (N k,) the pairs sorted by expert: the dispatch
    counts = torch.bincount(flat, minlength=experts).tolist()  # E ints, summing to N k
    for e, positions in enumerate(order.split(counts)):  # (n_e,) each
        if len(positions):
            yield e, positions, positions // k


def expert_counts(index, experts):
    """Tokens routed to each expert: a list of E ints (sum N k)."""
    return torch.bincount(index.flatten(), minlength=experts).tolist()
