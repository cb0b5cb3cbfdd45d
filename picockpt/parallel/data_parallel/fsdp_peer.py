"""The peer: torch's own FSDP2 (torch.distributed.fsdp.fully_shard) on the autograd reference model
(picockpt/measurement/reference.py), each decoder layer recomputed in the backward, its all-gathers counted.

    results = run_ranks(fsdp2_rank_steps, 2, params, cfg, input_ids, targets, [(None, True), (True, False)])
    results[r][v] == {"forward": {"calls": n, "bytes": b, "unit_forwards": u, "recomputes": c,
                                  "recomputes_found_gathered": g},
                      "backward": {...}, "loss": ..., "grads": {...}}
                     # variant v = (reshard_after_forward, checkpointed[, nesting]): one fresh model each

Each decoder layer is its own FSDP unit and the root unit holds the rest. reshard_after_forward: True, False, or None
(torch's default: True for the layers, False for the root). nesting (checkpointed only) says which wrapper is outside:

    "fsdp(ac(layer))"  torchtitan's (torchtitan/models/llama3/parallelize.py: checkpoint_wrapper around each block,
                       then fully_shard on the wrapper): the recompute runs only the block inside the unit, so
                       FSDP's forward hooks do not fire during the recompute. The backward's one gather comes from
                       the pre-backward hook FSDP put on the unit's outputs (torch 2.13, _fsdp_state.py:
                       _register_pre_backward_hook), which autograd runs before the first unpack of a saved tensor
                       starts the recompute, so the recompute finds the weights gathered.
    "ac(fsdp(layer))"  torch.utils.checkpoint around an FSDP unit: the recompute runs the unit's forward, FSDP's
                       hooks included, after the same pre-backward hook has gathered it; FSDPParamGroup.post_forward's
                       `if not is_bw()` (_fsdp_param_group.py) keeps such a recompute from resharding.

Either way, with the layers resharded after their forward, recompute and backward share one gather of a unit: picockpt's
keep_gathered=True. unit_forwards (the layers' FSDP units' forward calls), recomputes (the decoder layers' runs in the
backward) and recomputes_found_gathered (those that found their weights plain tensors, not sharded DTensors) show which
mechanism ran. Counting: the step wraps the one torch.distributed function FSDP2 gathers with (FSDP_GATHER), booking the
output's bytes as comm.py counts an all-gather, under "forward" before loss.backward() and "backward" after. FSDP2
shards each parameter along dim 0 (padded), not flat per unit: the bytes equal picockpt's when no dim needs padding.
"""
from functools import partial

import torch
import torch.distributed as dist

from ...measurement.reference import ReferenceLlama, run_plain
from ..comm import all_gather

# the function FSDP2 gathers with: torch 2.13's all_gather_single, all_gather_into_tensor before it (2.11's
# _fsdp_collectives.py), looked up on the module at each call, so wrapping the module's attribute counts it
FSDP_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
NESTINGS = ("fsdp(ac(layer))", "ac(fsdp(layer))")  # the first is torchtitan's, and the default
WRAPPED = "_checkpoint_wrapped_module."  # the name checkpoint_wrapper puts before its block's parameters


def fsdp2_rank_steps(comm, params, cfg, input_ids, targets, variants):
    return [fsdp2_rank_step(comm, params, cfg, input_ids, targets, *variant) for variant in variants]


def fsdp2_model(comm, params, cfg, reshard_after_forward, checkpointed, nesting):
    """(model, its decoder layers, whether the checkpoint wraps the FSDP unit): the reference model, every layer and
    the model an FSDP2 unit (fully_shard) over all ranks; checkpointed, each layer recomputed in `nesting` (above)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if nesting not in NESTINGS:
        raise ValueError(f"nesting={nesting!r} is unknown: use {NESTINGS[0]!r} (torchtitan's) or {NESTINGS[1]!r}")
    model = ReferenceLlama(cfg, params)
    blocks = list(model.model.layers)  # the decoder layers themselves, whatever wraps them
    outer = checkpointed and nesting == "ac(fsdp(layer))"  # the checkpoint around the FSDP unit, in run_layers
    if checkpointed and not outer:  # torchtitan: the block in a checkpoint_wrapper, the wrapper made the unit
        for index, block in enumerate(blocks):
            model.model.layers[index] = checkpoint_wrapper(block)  # recomputes block, not the wrapper, in backward
    mesh = init_device_mesh(comm.device.type, (comm.world_size,))
    for unit in model.model.layers:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model, blocks, outer


def fsdp2_rank_step(comm, params, cfg, input_ids, targets, reshard_after_forward=None, checkpointed=True,
                    nesting=NESTINGS[0]):
    from torch.distributed.tensor import DTensor
    from torch.utils.checkpoint import checkpoint

    model, blocks, outer = fsdp2_model(comm, params, cfg, reshard_after_forward, checkpointed, nesting)
    B, r, W = input_ids.shape[0], comm.rank, comm.world_size
    mine = slice(r * B // W, (r + 1) * B // W)  # this rank's rows (equal shares: no ignored targets)

    counts = {phase: dict.fromkeys(("calls", "bytes", "unit_forwards", "recomputes", "recomputes_found_gathered"), 0)
              for phase in ("forward", "backward")}
    phase = ["forward"]

    def unit_forward(module, args):  # a layer's FSDP unit starts its forward (this hook runs before FSDP's)
        counts[phase[0]]["unit_forwards"] += 1

    def block_forward(module, args):  # the decoder layer itself starts its forward (before FSDP's hook, if a unit)
        if phase[0] == "backward":  # a recompute
            counts["backward"]["recomputes"] += 1
            counts["backward"]["recomputes_found_gathered"] += not any(isinstance(p, DTensor)
                                                                       for p in module.parameters())

    for unit, block in zip(model.model.layers, blocks):  # prepend=True: ahead of the hooks fully_shard put there
        unit.register_forward_pre_hook(unit_forward, prepend=True)
        block.register_forward_pre_hook(block_forward, prepend=True)

    def run_layers(layers, x):  # (b, T, h); under torchtitan's nesting each unit checkpoints inside
        return run_plain([partial(checkpoint, layer, use_reentrant=False) for layer in layers] if outer else layers, x)

    original = getattr(dist, FSDP_GATHER)

    def counted(output, *args, **kwargs):
        counts[phase[0]]["calls"] += 1
        counts[phase[0]]["bytes"] += output.nbytes
        return original(output, *args, **kwargs)

    setattr(dist, FSDP_GATHER, counted)
    try:
        loss = model(input_ids[mine], targets[mine], run_layers=run_layers)  # this rank's mean (FSDP2 averages grads)
        phase[0] = "backward"
        loss.backward()
    finally:
        setattr(dist, FSDP_GATHER, original)
    grads = {name.replace(WRAPPED, ""): whole(p.grad, comm) for name, p in model.named_parameters()}
    if cfg.tie_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return {**counts, "loss": loss.detach(), "grads": grads}


def whole(shard, comm):
    """A gradient FSDP2 sharded along dim 0, gathered whole by picockpt's all-gather (comm.py), which every backend
    runs: DTensor.full_tensor()'s functional all-gather is a coalesced one that gloo lacks in torch 2.11. FSDP2 shards
    as torch.chunk does, so every shard has ceil(n / W) rows but the tail's: each padded to that, the padding cut."""
    local, n = shard.to_local(), shard.shape[0]
    padding = local.new_zeros((-(-n // comm.world_size) - local.shape[0],) + local.shape[1:])  # (ceil - own rows, ...)
    return all_gather(torch.cat([local, padding]), comm, 0)[:n]  # (n, ...)
