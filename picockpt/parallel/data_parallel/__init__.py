"""Data parallelism: replicas of a stage on their own share of the batch, their gradients summed (layout.py's dp
dimension, run by rank.py). Read dp_model.py first (the stage's wrap: plain replicas over dp_comm.py's buckets, or
ZeRO 1/2/3's shards, zero_shards.py), then zero_shards.py; fsdp_peer.py runs torch's FSDP2 beside it. Training
with ZeRO, a new batch each step: picockpt/parallel/training.py's zero_train.
"""
