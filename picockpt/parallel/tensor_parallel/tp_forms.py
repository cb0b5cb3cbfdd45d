"""Closed forms per tensor-parallel rank of t, with or without sequence parallelism (sp) and Megatron's distributed
saved activations: its stored bytes (to the byte, as picockpt/planning/step_forms.py's), communication bytes and FLOPs.
A rank stores step_forms.py's tensors with the dims SPLIT names divided by t: without sp the norm inputs, norm
outputs and dropout masks stay whole on every rank (Korthikanti et al.'s 10sbh, replicated_and_split), with sp all
of it divides. The peak is step_forms.py's with this rank's A, F and Xc for X (X/t with distributed saved
activations). Communication per rank (comm.py's count), S = B*T*h*e the bytes of one whole activation, N = B*T:

    forward    embedding S; per layer 2S (two all-reduces) | 4S with sp (two all-gathers, two reduce-scatters);
               head: S with sp (all-gather), and the loss's 3 all-reduces of N statistics
    backward   per layer 2S | 6S + 2h master bytes with sp (LEAVE's all-gathers, norm outputs all-gathered again,
               ENTER's reduce-scatters, the norm weights' all-reduces); head S | 2S + h master bytes; embedding 0 | S
    recompute  the forward's collectives of every layer a sweep recomputes (a sweep that stops early skips its
               last layer's LEAVE: S less), plus one all-gather of S per sweep with distributed saved activations;
               rebuilds inside a layer's backward (selective, cheap, tiled attention, chunked logits) move nothing
"""
import math

from ...planning.step_forms import head_inventory, layer_flops, layer_inventory, segments_peak, step_flops, total
from ...planning.planner import Stage, plan_chain
from ...recompute.policy import OP_LEVEL, as_policy
from ...model.config import BYTES

# what t divides in each stored tensor: "tokens" (dim 1, under sequence parallelism only), "heads" (dim 1:
# H/t query, KV/t key/value heads), "columns" (the last dim: h/t of the context, f/t, V/t); the rest whole
SPLIT = (dict.fromkeys(("input", "attn_norm.rstd", "attn_norm.output", "attn.dropout_mask", "mlp_norm.input",
                       "mlp_norm.rstd", "mlp_norm.output", "mlp.dropout_mask", "final_norm.input", "final_norm.rstd",
                       "final_norm.output"), "tokens")
         | dict.fromkeys(("attn.q", "attn.k", "attn.v", "attn.probs", "attn.probs_mask", "attn.probs_dropped",
                          "attn.lse"), "heads")
         | dict.fromkeys(("attn.context", "mlp.gate", "mlp.up", "mlp.act", "lm_head.logits", "moe.shared_gate",
                          "moe.shared_up", "moe.shared_act"), "columns"))  # a router's tensors: whole (all tokens)


def split_inventory(inventory, t, sp):
    """picockpt/planning/step_forms.py's name -> (shape, dtype, bytes), as one of t ranks holds it (SPLIT above)."""
    out = {}
    for name, (shape, dtype, _) in inventory.items():
        dim = {"tokens": 1 if sp else None, "heads": 1, "columns": len(shape) - 1}.get(SPLIT.get(name))
        if dim is not None:
            shape = shape[:dim] + (shape[dim] // t,) + shape[dim + 1:]
        out[name] = (shape, dtype, math.prod(shape) * BYTES[dtype])
    return out


def rank_layer_inventory(cfg, batch, seq, t=1, sp=False, unstored=frozenset()):
    """What one fully stored layer keeps on one rank (its input included)."""
    return split_inventory(layer_inventory(cfg, batch, seq, unstored), t, sp)


def rank_head_inventory(cfg, batch, seq, t=1, sp=False, unstored=frozenset()):
    """What the head keeps on one rank: the final norm on its tokens, its logits' columns, the lse even unchunked."""
    head = split_inventory(head_inventory(cfg, batch, seq, unstored), t, sp)
    if "lm_head.lse" not in head and "lm_head.lse" not in unstored:  # vocab.py: a rebuild would cost two all-reduces
        stat = cfg.dtype_names[1]
        head["lm_head.lse"] = ((batch, seq), stat, batch * seq * BYTES[stat])
    return head


def rank_sizes(cfg, batch, seq, t=1, sp=False, distribute_saved=False, unstored=frozenset()):
    """(X, Xc, A, F): a layer input, a stored checkpoint, a layer stored whole, the head, in bytes per rank."""
    layer = rank_layer_inventory(cfg, batch, seq, t, sp, unstored)
    X, F = layer["input"][2], total(rank_head_inventory(cfg, batch, seq, t, sp, unstored))
    return X, (X // t if distribute_saved else X), total(layer), F


def rank_chain(cfg, batch, seq, t=1, sp=False, distribute_saved=False, unstored=frozenset()):
    """The planner's chain (picockpt/planning/planner.py: Stage) of one rank: its own bytes and FLOPs."""
    unstored, parts = frozenset(unstored), layer_flops(cfg, batch, seq)
    levels = [("all", unstored)] + [(f"all:{name}", names) for name, names in OP_LEVEL.items() if names > unstored]
    variants, head_variants = {}, {}
    for mode, names in levels:
        rebuild = parts["scores"] // t if "attn.probs" in names and cfg.attention == "eager" else 0
        variants.setdefault((total(rank_layer_inventory(cfg, batch, seq, t, sp, names)), rebuild), mode)
        head_variants.setdefault(total(rank_head_inventory(cfg, batch, seq, t, sp, names)), mode)
    X, Xc, _, _ = rank_sizes(cfg, batch, seq, t, sp, distribute_saved)
    inner = parts["scores"] // t if cfg.attention == "tiled" else 0
    layer = Stage(sum(parts.values()) // t, Xc, tuple((mode, a, r) for (a, r), mode in variants.items()),
                  tail_flops=2 * batch * seq * cfg.hidden * cfg.ffn // t, inner_flops=inner)
    head = Stage(0, rank_head_inventory(cfg, batch, seq, t, sp)["final_norm.input"][2],
                 tuple((mode, nbytes, 0) for nbytes, mode in head_variants.items()),
                 inner_flops=2 * batch * seq * cfg.hidden * cfg.vocab // t if cfg.loss_chunk else 0)
    return (layer,) * cfg.layers + (head,)


def rank_plan(policy, cfg, batch, seq, t=1, sp=False, distribute_saved=False):
    """The budget planner's Plan for one rank (budget:SIZE is this rank's budget)."""
    return plan_chain(rank_chain(cfg, batch, seq, t, sp, distribute_saved, policy.unstored), policy.budget)


def rank_peak_bytes(cfg, batch, seq, policy, t=1, sp=False, distribute_saved=False):
    """The exact peak of one rank's activation store over one step."""
    policy = as_policy(policy, cfg)
    if policy.budget is not None:
        return rank_plan(policy, cfg, batch, seq, t, sp, distribute_saved).peak_bytes
    X, Xc, A, F = rank_sizes(cfg, batch, seq, t, sp, distribute_saved, policy.unstored)
    if policy.segment is None:
        return cfg.layers * A + F
    return segments_peak([Xc] * cfg.layers, [A] * cfg.layers, F, policy.segment)


def rank_comm_bytes(cfg, batch, seq, policy, t=1, sp=False, distribute_saved=False, first=True, last=True,
                    schedule=None):
    """{phase: bytes} one rank's collectives move in one step (none at t = 1). A pipeline stage (pp_forms.py):
    cfg.layers its layers, first/last whether it holds the embedding/the head, schedule its own."""
    if t == 1:
        return {"forward": 0, "recompute": 0, "backward": 0}
    act, stat, master = (BYTES[name] for name in cfg.dtype_names)
    S, N, h, L = batch * seq * cfg.hidden * act, batch * seq, cfg.hidden, cfg.layers
    layer_forward = 4 * S if sp else 2 * S  # ENTER and LEAVE of both blocks (ENTER moves nothing without sp)
    layer_backward = 6 * S + 2 * h * master if sp else 2 * S
    loss = 3 * N * stat  # the row max, the sum of exponentials, the target's logit
    forward = (S if first else 0) + L * layer_forward + ((S if sp else 0) + loss if last else 0)
    backward = ((2 * S + h * master if sp else S) if last else 0) + L * layer_backward + (S if sp and first else 0)
    if schedule is None:  # the step's own (the same on every rank: their sizes are equal)
        policy = as_policy(policy, cfg)
        schedule = (rank_plan(policy, cfg, batch, seq, t, sp, distribute_saved).schedule if policy.budget is not None
                    else policy.schedule(cfg, batch, seq))
    # the engine's walk (picockpt/recompute/schedule.py); a sweep stopped early runs a LEAVE less, and with
    # distributed saved activations each sweep all-gathers its checkpoint
    recompute = sum((j - i + 1) * layer_forward - (S if schedule.stop_early else 0) + (S if distribute_saved else 0)
                    for i, j in schedule.sweeps(cfg.layers))
    return {"forward": forward, "recompute": recompute, "backward": backward}


def rank_flops(cfg, batch, seq, policy, t=1, sp=False, distribute_saved=False):
    """One rank's {phase: matmul FLOPs}: step_flops / t (H/t heads, f/t, V/t columns); budget: its plan's recompute."""
    policy = as_policy(policy, cfg)
    flops = {phase: count // t for phase, count in step_flops(cfg, batch, seq, "none").items()}
    flops["recompute"] = (rank_plan(policy, cfg, batch, seq, t, sp, distribute_saved).recompute_flops
                          if policy.budget is not None else step_flops(cfg, batch, seq, policy)["recompute"] // t)
    return flops


def replicated_and_split(cfg, batch, seq, t=1, sp=False, unstored=frozenset()):
    """(bytes of a stored layer each rank holds whole, bytes split by t): picockpt's 10sbh and 24sbh/t + 5as^2b/t."""
    inventory = rank_layer_inventory(cfg, batch, seq, t, sp, unstored)  # without sp only heads and columns divide
    whole = 0 if sp else sum(b for name, (_, _, b) in inventory.items() if SPLIT.get(name) in (None, "tokens"))
    return whole, total(inventory) - whole
