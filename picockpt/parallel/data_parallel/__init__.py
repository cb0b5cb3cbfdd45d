"""Data parallelism: replicas of a stage on their own share of the batch, their gradients summed.

    dp_model.py       data parallelism as a wrap of the stage (Replicated; ZeroShards is the other): the weights it
                      reads, where its gradients go; the stage knows neither buckets nor shards
    dp_comm.py        gradient buckets all-reduced over the replicas as soon as a layer's are final, overlapping
                      the recomputation and backward below (every layout's reduction; under ep the experts' apart)
    zero_shards.py    ZeRO stages 1/2/3 (Rajbhandari et al. 2020) in the same rank step, beside any other layout: a
                      rank's stage units, flat and padded (zero_params.py), sharded over its data-parallel group,
                      gathered around each use (keep_gathered; prefetch), reduced once final, its sharded AdamW;
                      read it first
    zero_inventory.py ZeRO's closed forms; zero_check.py what its values refuse
    dp_check.py       what dp and ZeRO refuse in a job, before any rank starts
    fsdp_peer.py      torch's FSDP2 (fully_shard) beside it, its all-gathers counted

The replicas are layout.py's dp dimension, run by rank.py; ZeRO takes the place of Replicated there
(parallel.loss_and_grads(..., Layout(dp=D, zero=S, tp=..., pp=...)); lesson 19). Training with it, a new batch
each step: picockpt/parallel/training.py's zero_train.
"""
