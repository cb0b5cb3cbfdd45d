"""Pipeline parallelism: the layers split into stages, micro-batches flowing through them under AFAB or
1F1B, each micro-batch of each stage the engine's own loop.

Read first: pp_schedules.py (the orders of forwards and backwards as data), then pp_stage.py (a stage's
micro-batch as the engine's loop sees it), pp_comm.py (paired sends); parallel/rank.py runs a stage's
micro-batches in the schedule's order.

    pp_schedules.py  stages' layers; AFAB and 1F1B orders; micro-batches in flight; the bubble
    pp_comm.py       sends and receives between stages, as forward/backward pairs, paired as NCCL needs
    pp_stage.py      one stage and one micro-batch of it for the engine's loop; the loss's share
    pp_inventory.py  per-stage closed forms: stored bytes with micro-batches in flight, p2p bytes, FLOPs
    pp_plan.py       a budget planned per stage, for its micro-batches in flight
"""
