"""Which parameters an expert-parallel rank holds, and the gradients put back together.

    weight (HF name)                             rank r of W holds
    model.layers.{i}.mlp.experts.gate_up_proj    experts r*E/W .. (r+1)*E/W - 1: (E/W, 2f, h)
    model.layers.{i}.mlp.experts.down_proj       the same experts: (E/W, h, f)
    every other weight (router included)         all of it; its gradient from this rank's sequences,
                                                 summed over the ranks at the end of the step
"""
import torch

EXPERT_ROLES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # split along dim 0 (the expert)


def is_expert(name):
    return name.endswith(EXPERT_ROLES)


def shard_experts(params, rank, ep, device=None):
    """{name: this rank's tensor}: its E/ep experts of each expert weight, every other weight whole
    (each a copy of its own)."""
    shards = {}
    for name, tensor in params.items():
        shard = tensor.chunk(ep, 0)[rank] if is_expert(name) else tensor  # (E/ep, ...) a view, or whole
        shards[name] = shard.to(device).clone() if device is not None else shard.clone()
    return shards


def gather_expert_grads(per_rank, params):
    """Every rank's gradients -> full gradients under the params' names: the experts' put back
    together along dim 0, the replicated weights' (already summed over the ranks) from rank 0."""
    return {name: torch.cat([grads[name] for grads in per_rank], 0) if is_expert(name) else per_rank[0][name]
            for name in params}
