"""Closed forms, planners and cost: what a policy will store and spend, before it runs.

    layer_forms.py, step_forms.py   bytes by name and FLOPs, a layer's and a step's, exact to the tracker
    published.py                     the published formulas, for comparison
    planner_chain.py, planner.py, planner_uniform.py, planner_offload.py, host_walk.py, planner_copies.py
                                    plans under a budget (the chain of stages and its exact walk first)
    fit.py, hardware.py, cost.py, op_times.py, collectives.py   whether it fits, and time from FLOPs and bytes
    layout_memory.py, layout_time.py, layout_search.py, frameworks.py   a parallel layout's bytes and time, ranked
"""
