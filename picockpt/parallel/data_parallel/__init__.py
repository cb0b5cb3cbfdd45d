"""Data parallelism: replicas of a stage on their own share of the batch, their gradients summed.

    dp_comm.py   gradient buckets all-reduced over the replicas as soon as a layer's are final, overlapping the
                 recomputation and backward below (every layout's one reduction; under ep, the experts' over theirs)
    zero_params.py, zero_model.py, zero_optim.py, zero_step.py, zero_inventory.py
                 ZeRO stages 1/2/3 (Rajbhandari et al. 2020): flat padded shards, parameters gathered around
                 each use (keep_gathered: a recomputed layer's gather kept for its backward; prefetch), the
                 sharded AdamW, and the closed forms; read zero_model.py first
    zero_train.py training with ZeRO: a new batch each step, one launch (zero_train; `train --dp --zero`)
    fsdp_peer.py torch's FSDP2 (fully_shard) beside it, its all-gathers counted

The replicas are layout.py's dp dimension, run by rank.py. ZeRO has its own rank step for now, over dp ranks alone, not
composed with other layouts (zero_step.zero_rank_step, via parallel.loss_and_grads(..., dp=D, zero=S); lesson 19).

    losses, params, reports = zero_train(params, cfg, batches, "full", dp=2, zero=3)
"""
from .zero_train import zero_train

__all__ = ["zero_train"]
