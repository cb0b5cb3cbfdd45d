"""Pipeline parallelism: layers split into stages, micro-batches flowing through them under AFAB, 1F1B, interleaved
1F1B or ZB-H1, each the engine's own loop on each stage (pp_runner.py runs them in order, for rank.py). Read
pp_schedules.py first, then pp_runner.py, pp_stage.py, pp_comm.py.

    pp_schedules.py  stages' layers; the four orders (ZB-H1's W, interleaving's chunks); micro-batches in flight
    pp_runner.py     a rank's actions run in the schedule's order: F, B, ZB-H1's W; interleaving's steps grouped
    pp_comm.py       sends and receives between stages, as forward/backward pairs, paired as NCCL needs
    pp_stage.py      one stage and one micro-batch of it for the engine's loop; the loss's share
    pp_inventory.py  per-stage closed forms: stored bytes with micro-batches in flight, p2p bytes, FLOPs
    pp_plan.py       a budget planned per stage (interleaved: per rank's chunks), the order walked for its peak
    pp_orders.py     any order on one clock (the modelled bubble); what a waiting W holds
    pp_check.py      what pp refuses, before any rank starts (the schedule beside other layouts, its grouping)
    pipelining_peer.py  torch.distributed.pipelining's interleaved and zero-bubble schedules, the peer
"""
