"""Pipeline parallelism: layers split into stages, micro-batches flowing through them under AFAB or 1F1B, each the
engine's own loop on each stage (rank.py runs them in order). Read pp_schedules.py first, then pp_stage.py, pp_comm.py.

    pp_schedules.py  stages' layers; AFAB and 1F1B orders; micro-batches in flight; the bubble
    pp_comm.py       sends and receives between stages, as forward/backward pairs, paired as NCCL needs
    pp_stage.py      one stage and one micro-batch of it for the engine's loop; the loss's share
    pp_inventory.py  per-stage closed forms: stored bytes with micro-batches in flight, p2p bytes, FLOPs
    pp_plan.py       a budget planned per stage, for its micro-batches in flight
"""
