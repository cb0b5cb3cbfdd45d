"""The planner's chain (picockpt/planning/planner.py): picockpt's model as a chain of Stages, built from
the closed forms of layer_forms.py, and replay(), the exact walk of a schedule over the chain's byte counts:
a plan's peak bytes and recompute FLOPs, which the Tracker then measures.

The chain. Stages 0..L-1 are the decoder layers; stage L is the model head (final norm and
logits, F bytes), which the engine always stores whole at the end of the first forward (plain,
or "all:cheap" without the final norm's output). Stage k has

    forward_flops   F_k   one forward of it: what an advance through it costs
    input_bytes     X_k   its input, a checkpoint
    variants        (mode, A_k^v, R_k^v): the ways of storing it whole, input included. "all" keeps everything (R = 0);
                    "all:selective" / "all:cheap" drop what the backward can rebuild, and the rebuild of the attention
                    probabilities costs one q k^T, R = 2*B*H*T^2*hd FLOPs, counted as recompute (under tiled or fused
                    attention there are no probabilities to drop: selective changes nothing and costs nothing); with
                    experts also "all:moe" and the like, R = the experts' gate/up projections. A mixture-of-experts
                    layer's bytes and FLOPs do not depend on its routing (picockpt/planning/step_forms.py), so the chain
                    needs no per-expert token counts.
    inner_flops     what its backward recomputes inside an op whatever the schedule: tiled attention's
                    q k^T, a chunked head's logits. A constant of every plan, added by replay().

Not in the chain: the 16-bit weight copies of mixed precision. A budget counts the activation store; the
copies sit beside it (fit.step_bytes's state, params.copy_bytes: every weight's, or under the policy's
+recast the embedding's, final norm's and head's and one layer's). budget:SIZE+recast plans the store as
without it. Trading the copies against recomputed activations (a total for both, each choice priced: casts'
bytes against recomputed FLOPs) is planner_copies.py's, on top of planner.py (plan --with-copies).
"""
from dataclasses import dataclass

from .layer_forms import (head_inventory, inner_recompute_flops, layer_flops, layer_inventory, rebuild_flops,
                           tail_flops, total)
from ..recompute.schedule import OP_LEVEL


@dataclass(frozen=True)
class Stage:
    forward_flops: int
    input_bytes: int
    variants: tuple          # ((mode, bytes stored whole incl. the input, rebuild FLOPs), ...)
    tail_flops: int = 0      # what a sweep ending at this stage skips (its output is not needed)
    inner_flops: int = 0     # recomputed inside its backward whatever the schedule (tiled attention, chunked logits)


def model_chain(cfg, batch, seq, unstored=frozenset()):
    """Stages 0..L-1 (the layers) and L (the head), from the closed forms of step_forms.py. A layer
    may drop more than `unstored` (the policy's op level), never less."""
    unstored = frozenset(unstored)
    stored = layer_inventory(cfg, batch, seq)
    levels = [("all", unstored)] + [(f"all:{name}", names) for name, names in OP_LEVEL.items() if names > unstored]
    variants = {}  # (bytes, rebuild FLOPs) -> the first mode that gives them
    for mode, names in levels:  # rebuilds: the q k^T of dropped probabilities (eager), experts' projections
        rebuild = rebuild_flops(cfg, batch, seq, names)
        variants.setdefault((total(layer_inventory(cfg, batch, seq, names)), rebuild), mode)
    down = tail_flops(cfg, batch, seq)  # the down projection(s): a sweep's last layer skips them
    inner_layer, inner_head = inner_recompute_flops(cfg, batch, seq)
    layer = Stage(sum(layer_flops(cfg, batch, seq).values()), stored["input"][2],
                  tuple((mode, a, r) for (a, r), mode in variants.items()), tail_flops=down, inner_flops=inner_layer)
    head_variants = {}  # bytes -> mode: only the op levels that change what the head keeps
    for mode, names in levels:
        head_variants.setdefault(total(head_inventory(cfg, batch, seq, names)), mode)
    head = Stage(0, head_inventory(cfg, batch, seq)["final_norm.input"][2],
                 tuple((mode, nbytes, 0) for nbytes, mode in head_variants.items()),  # rebuilds are elementwise
                 inner_flops=inner_head)
    return (layer,) * cfg.layers + (head,)


# ---- the exact walk ------------------------------------------------------------------------------
def replay(chain, schedule, left=None):
    """(peak bytes of the store, recompute FLOPs) of running `schedule`, by the engine's own loop
    (picockpt/recompute/engine.py) over byte counts: every put adds, every layer's backward pops it all (and, with
    left[i], leaves that many bytes behind: a zero-bubble pipeline's deferred weight gradients, parallel/)."""
    L = len(chain) - 1
    inputs, whole = set(), {}  # layers whose input is stored; layers stored whole -> (bytes, rebuild)
    live = peak = recompute = 0

    def run_layers(first, last, mode_of, counted):
        nonlocal live, peak, recompute
        for k in range(first, last + 1):
            mode, stage = mode_of(k), chain[k]
            if mode.keeps_input and k not in inputs:
                inputs.add(k)
                live += stage.input_bytes
            if mode.stored:
                assert k not in whole, f"layer {k} would be stored whole twice"
                _, a, r = next(v for v in stage.variants if v[0] == mode)
                whole[k] = (a, r)
                live += a - stage.input_bytes
            peak = max(peak, live)
            stops = counted and schedule.stop_early and k == last  # a sweep's last layer skips its tail
            recompute += (stage.forward_flops - (stage.tail_flops if stops else 0)) if counted else 0

    run_layers(0, L - 1, lambda k: schedule.forward[k], counted=False)
    head, rebuilt = next((a, r) for mode, a, r in chain[L].variants if mode == schedule.head)
    peak = max(peak, live + head)  # the head, popped again before layer L-1
    recompute += rebuilt + chain[L].inner_flops  # rebuilt: 0 in FLOPs (elementwise); seconds in a priced chain
    first_of = {last: first for first, last in schedule.sweeps(L)}  # the engine's walk (picockpt/recompute/schedule.py)
    for i in reversed(range(L)):
        if i in first_of:  # recomputed from the nearest checkpoint, first_of[i]
            run_layers(first_of[i], i, lambda k: schedule.sweep(k, i), counted=True)
        a, r = whole.pop(i)
        inputs.discard(i)
        live -= a - (left[i] if left else 0)
        peak = max(peak, live)
        recompute += r + chain[i].inner_flops
    assert live == sum(left or ()) and not inputs, "the schedule leaves tensors stored"
    return peak, recompute
