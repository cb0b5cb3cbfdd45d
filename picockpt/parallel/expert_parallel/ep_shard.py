"""Which parameters an expert-parallel rank holds, and the gradients put back together. Rank r of W holds experts
r*E/W .. (r+1)*E/W - 1 of model.layers.{i}.mlp.experts.gate_up_proj (E/W, 2f, h) and .down_proj (E/W, h, f), and
every other weight (router included) whole, its gradient from this rank's sequences, then summed over the ranks."""
import torch

EXPERT_ROLES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # split along dim 0 (the expert)


def is_expert(name):
    return name.endswith(EXPERT_ROLES)


def shard_experts(params, rank, ep):
    """{name: this rank's tensor}: its E/ep experts of each expert weight, every other weight whole (each a copy)."""
    return {name: (tensor.chunk(ep, 0)[rank] if is_expert(name) else tensor).clone()  # (E/ep, ...), or whole
            for name, tensor in params.items()}


def gather_expert_grads(per_rank, params):
    """Every rank's gradients -> full ones: the experts' put together along dim 0, the others' (summed) rank 0's."""
    return {name: torch.cat([grads[name] for grads in per_rank], 0) if is_expert(name) else per_rank[0][name]
            for name in params}
