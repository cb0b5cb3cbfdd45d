"""Closed forms: the bytes picockpt stores and the FLOPs it computes, from the shape alone.

These are the formulas the tests and notebooks hold the engine to, exactly, for every attention
kind (eager / tiled / fused, picockpt/model/attention.py) and loss chunking (picockpt/model/head.py):

    layer_inventory(cfg, B, T, unstored)    name -> (shape, dtype, bytes) of one stored layer
    predicted_peak_bytes(cfg, B, T, p)  the activation store's peak during one step (on the device)
    predicted_host_bytes(cfg, B, T, p)  the host tier's peak under an offloading policy (0 otherwise)
    step_flops(cfg, B, T, p)            matmul FLOPs of forward / recompute / backward

Mixture-of-experts layers: see picockpt/planning/layer_forms.py (the totals do not depend on the routing).

With X the bytes of one layer input (B*T*h*e), A the bytes of one fully stored layer (input included), F the model-level
bytes (final norm and logits), and segments of C layers (n = ceil(L/C) of them, the k-th holding n_k layers):

    store everything      peak = L*A + F                         (end of the forward)
    every:C (full: C=1)   peak = max( n*X + F,                   (end of the forward: checkpoints + F)
                                      max_k (k*X + n_k*A) )      (segment k just recomputed, below it
                                                                  the k checkpoints of segments 0..k-1)
  with the checkpoints or the layers on the host (offload; picockpt/planning/host_walk.py walks the step):
    every:C+offload       device peak = max(F + X, C*A, A + X)  host peak = n*X
    full+offload          device peak = max(F + X, A + X)       host peak = L*X
    none+offload          device peak = max(F + A, 2*A)         host peak = L*A
                          (layer i's backward runs while layer i-1's tensors come back: two layers
                          on the device at once; the head's while layer L-1's do)
"""
from .layer_forms import (  # noqa: F401 (the forms of one layer and the head, re-exported)
    dropped, balanced_counts, check_counts, layer_inventory, counts_from_puts, expert_bytes, head_inventory, total,
    chain_sizes, attention_matmul_flops, layer_flops, tail_flops, rebuild_flops, inner_recompute_flops, segments_peak)
from .host_walk import model_costs, walk
from .planner import model_chain, plan_model
from ..recompute.policy import as_policy


def predicted_peak_bytes(cfg, batch, seq, policy, routing=None):
    """The exact peak of the activation store over one step under `policy`. routing: with experts, the
    step's per-expert token counts of every layer (L lists of E ints, picockpt.model.routing.step_routing), used
    for each layer's bytes; None assumes balanced routing, which gives the very same number, since a
    layer's total does not depend on its routing (see the top of this file)."""
    policy = as_policy(policy, cfg)
    if policy.offload is not None:
        return offload_walk(cfg, batch, seq, policy).device_peak
    if routing is not None and (not cfg.experts or len(routing) != cfg.layers):
        raise ValueError(f"routing has {len(routing)} entries: give one list of per-expert token counts per layer "
                         f"(L={cfg.layers}), for a model with experts (Config.experts={cfg.experts})")
    if policy.budget is not None:  # the planner's chain: balanced routing, the same totals
        return plan_model(cfg, batch, seq, policy.budget, policy.unstored).peak_bytes
    X, A, F = chain_sizes(cfg, batch, seq, policy.unstored)  # A: one fully stored layer, input included (balanced)
    L = cfg.layers
    A = [A] * L if routing is None else [total(layer_inventory(cfg, batch, seq, policy.unstored, n)) for n in routing]
    if policy.segment is None:
        return sum(A) + F
    return segments_peak([X] * L, A, F, policy.segment)


def predicted_host_bytes(cfg, batch, seq, policy):
    """The host tier's exact peak over one step under `policy` (0 when it offloads nothing)."""
    policy = as_policy(policy, cfg)
    return 0 if policy.offload is None else offload_walk(cfg, batch, seq, policy).host_peak


def offload_walk(cfg, batch, seq, policy):
    """The engine's step under an offloading policy, walked on byte counts and a modelled clock at the default link and
    rate (a Walk: device and host peaks, bytes copied each way, modelled seconds; picockpt/planning/host_walk.py)."""
    policy = as_policy(policy, cfg)
    chain = model_chain(cfg, batch, seq, policy.unstored)
    return walk(chain, policy.schedule(cfg, batch, seq), model_costs(cfg, batch, seq, policy.unstored))


def step_flops(cfg, batch, seq, policy="none"):
    """forward, recompute, backward matmul FLOPs of one step (what FlopCounterMode counts).
    Backward is 2x forward for every matmul y = a b (it needs da = dy b^T and db = a^T dy), but for
    fused attention: its kernel's backward counts 5 T x T matmuls against the forward's 2, the fifth
    being the q k^T it recomputes inside (FlopCounterMode cannot see it apart, so it stays "backward");
    tiled attention's recomputed q k^T is counted as "recompute" (inner_recompute_flops)."""
    policy = as_policy(policy, cfg)
    parts = layer_flops(cfg, batch, seq)
    layer = sum(parts.values())
    head = 2 * batch * seq * cfg.hidden * cfg.vocab
    forward = cfg.layers * layer + head
    backward = 2 * forward + (cfg.layers * parts["scores"] if cfg.attention == "fused" else 0)
    inner_layer, inner_head = inner_recompute_flops(cfg, batch, seq)
    if policy.budget is not None and policy.offload is not None:  # the three-action plan's
        recompute = offload_walk(cfg, batch, seq, policy).recompute_flops
    elif policy.budget is not None:
        recompute = plan_model(cfg, batch, seq, policy.budget, policy.unstored).recompute_flops
    else:
        rebuild = rebuild_flops(cfg, batch, seq, policy.unstored)
        recomputed_layers = 0 if policy.segment is None else cfg.layers  # every layer once
        recompute = recomputed_layers * layer + cfg.layers * (rebuild + inner_layer) + inner_head
    return {"forward": forward, "recompute": recompute, "backward": backward}
