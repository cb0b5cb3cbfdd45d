"""Pipeline parallelism: layers split into stages, micro-batches flowing through them under AFAB, 1F1B, interleaved
1F1B or ZB-H1, each the engine's own loop on each stage (pp_runner.py runs them in order, for rank.py). Read
pp_schedules.py first, then pp_runner.py, pp_stage.py, pp_comm.py; pp_forms.py and pp_plan.py hold the closed
forms and per-stage budgets, pipelining_peer.py torch.distributed.pipelining's schedules beside them.
"""
