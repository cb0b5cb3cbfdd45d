"""Which parameters an expert-parallel rank holds, and the gradients put back together. Rank r of W holds experts
r*E/W .. (r+1)*E/W - 1 of model.layers.{i}.mlp.experts.gate_up_proj (E/W, 2f, h) and .down_proj (E/W, h, f), and
every other weight (router included) whole, its gradient from this rank's sequences, then summed over the ranks."""
import torch

from ...policy import parse_policy

EXPERT_ROLES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # split along dim 0 (the expert)


def is_expert(name):
    return name.endswith(EXPERT_ROLES)


def shard_experts(params, rank, ep, device=None):
    """{name: this rank's tensor}: its E/ep experts of each expert weight, every other weight whole (each a copy)."""
    views = {name: tensor.chunk(ep, 0)[rank] if is_expert(name) else tensor  # (E/ep, ...) a view, or whole
             for name, tensor in params.items()}
    return {name: (view.to(device) if device is not None else view).clone() for name, view in views.items()}


def gather_expert_grads(per_rank, params):
    """Every rank's gradients -> full ones: the experts' put together along dim 0, the others' (summed) rank 0's."""
    return {name: torch.cat([grads[name] for grads in per_rank], 0) if is_expert(name) else per_rank[0][name]
            for name in params}


def check_expert_parallel(cfg, ep, batch, policy, split=False):
    """ValueError naming the parameter, the value and what would work, for every split that cannot be. batch: one
    micro-batch of one replica's sequences (its ep ranks split them); split: dp x microbatches > 1."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r}: use a whole number of expert-parallel ranks, 1 or more")
    E = cfg.experts
    if not E:
        raise ValueError(f"ep={ep} with Config.experts=0: expert parallelism splits a mixture of experts over the "
                         f"ranks, and this model's MLP is dense; set experts to a multiple of {ep}")
    fits = [n for n in range(1, E + 1) if E % n == 0 and batch % n == 0]
    if E % ep:
        raise ValueError(f"ep={ep} does not divide experts={E}: each rank holds E/ep whole experts; use ep in {fits}")
    if batch % ep:
        per = " (per replica and micro-batch)" if split else ""
        raise ValueError(f"batch={batch}{per} is not divisible by ep={ep}: each rank computes batch/ep whole "
                         f"sequences; use a batch that is a multiple of {ep}, or ep in {fits}")
    if parse_policy(policy, cfg).budget is not None:
        raise ValueError(f"policy {policy!r} with ep={ep}: a budget is planned per rank, but a rank's bytes "
                         f"depend on the tokens routed to its experts, and every rank must recompute the same layers "
                         f"at the same time (their all-to-alls meet); use none, full or every:C, with op-level options")
    if cfg.attention == "tiled" and cfg.dropout > 0:
        raise ValueError(f"attention='tiled' with dropout={cfg.dropout} and ep={ep}: each tile's mask comes from a "
                         f"generator seeded by the tile's index at the shape of a rank's batch, so no rank's masks "
                         f"equal the single process's; use attention='eager', dropout=0, or ep=1")
