"""The peer: torch's own FSDP2 (torch.distributed.fsdp.fully_shard) on the autograd reference model
(picockpt/reference.py), with torch.utils.checkpoint around each layer, its all-gathers counted.

    results = run_ranks(fsdp2_rank_steps, 2, params, cfg, input_ids, targets, [(None, True), (True, False)])
    results[r][v] == {"forward": {"calls": n, "bytes": b}, "backward": {...}, "loss": ..., "grads": {...}}
                     # variant v = (reshard_after_forward, checkpointed): one fresh model each

The wrapping is torchtitan's (torchtitan/models/llama3/infra/parallelize.py: apply_ac wraps each block in a
checkpoint before apply_fsdp calls fully_shard on it): each decoder layer is its own FSDP unit, with the
checkpoint inside it, and the root unit holds the rest (embedding, final norm, LM head).
reshard_after_forward: True (every unit freed after its forward, gathered again for its backward), False
(kept from forward to backward), or None (torch's default: True for the layers, False for the root).

Counting: FSDP2 gathers each unit with one torch.distributed.all_gather_single call (torch 2.13's
_fsdp_collectives.py: DefaultAllGather); the step here wraps that function while it runs, booking the
output's bytes (as picockpt/parallel/comm.py counts an all-gather) under "forward" before loss.backward()
and "backward" after. Its shards are per parameter along dim 0 (padded), not flat per unit: the bytes
equal picockpt's when no dim needs padding.
What FSDP2 does under recomputation (torch 2.13, _fsdp_param_group.py): a checkpointed layer's
recomputation runs inside the backward's pre-backward all-gather, and post_forward does not reshard
during a backward (`if not is_bw()`), so recompute and backward share one gather: picockpt's
keep_gathered=True.
"""
import torch
import torch.distributed as dist

from ...reference import ReferenceLlama


def fsdp2_rank_steps(comm, params, cfg, input_ids, targets, variants):
    return [fsdp2_rank_step(comm, params, cfg, input_ids, targets, *variant) for variant in variants]


def fsdp2_rank_step(comm, params, cfg, input_ids, targets, reshard_after_forward=None, checkpointed=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    model = ReferenceLlama(cfg, params)
    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    B, r, W = input_ids.shape[0], comm.rank, comm.world_size
    mine = slice(r * B // W, (r + 1) * B // W)  # this rank's rows (equal shares: no ignored targets)

    def run_layers(layers, x):
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)  # (b, T, h)
        return x

    counts, phase = {"forward": {"calls": 0, "bytes": 0}, "backward": {"calls": 0, "bytes": 0}}, ["forward"]
    original = dist.all_gather_single

    def counted(output, *args, **kwargs):
        counts[phase[0]]["calls"] += 1
        counts[phase[0]]["bytes"] += output.nbytes
        return original(output, *args, **kwargs)

    dist.all_gather_single = counted
    try:
        loss = model(input_ids[mine], targets[mine], run_layers=run_layers)  # this rank's mean (FSDP2 averages grads)
        phase[0] = "backward"
        loss.backward()
    finally:
        dist.all_gather_single = original
    grads = {name: grad.full_tensor() for name, grad in model.grads().items()}  # every rank's shards, whole
    return {**counts, "loss": loss.detach(), "grads": grads}
