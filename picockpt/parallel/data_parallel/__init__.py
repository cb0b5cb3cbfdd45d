"""Data parallelism: replicas of a stage on their own share of the batch, their gradients summed.

    dp_comm.py   gradient buckets, all-reduced over the replicas as soon as a layer's are final,
                 overlapping the recomputation and backward below (the one reduction every layout uses;
                 under expert parallelism the experts' over their own replicas)

The replicas are the dp dimension of parallel/layout.py's grid; parallel/rank.py runs them.
"""
