"""A pipeline stage's plan: the least-recompute schedule for one micro-batch when the stage holds w at once, its
peak (w - 1) * E + the micro-batch's own (pp_inventory.py). A plan that fits a budget alone may not fit it w times
over, and what a first forward keeps costs w times what a recompute sweep keeps (sweeps run one micro-batch at a
time). The candidates: the single-process planner's Pareto front (picockpt/planner.py), walked down from the budget.
"""
import math
from dataclasses import dataclass

from ...planner import least_budget, least_plan, plan_chain, replay
from ...schedule import Schedule


def end_of_forward_bytes(chain, schedule):
    """E: the bytes a schedule's first forward leaves stored (checkpoints, layers kept whole, the head)."""
    held = 0
    for mode, stage in zip(schedule.forward, chain[:-1]):  # the layers, then the head
        if mode == "input":
            held += stage.input_bytes
        elif mode.stored:
            held += next(a for name, a, _ in stage.variants if name == mode)
    return held + next(a for name, a, _ in chain[-1].variants if name == schedule.head)


@dataclass(frozen=True)
class InFlightPlan:
    schedule: Schedule       # one micro-batch's schedule
    peak_bytes: int          # the stage's peak: (in_flight - 1) * end_of_forward + microbatch_peak
    microbatch_peak: int     # one micro-batch's own peak (replay)
    end_of_forward: int      # E
    recompute_flops: int     # per micro-batch
    in_flight: int
    budget: int
    source: str              # "planner" (a plan of the frontier) or the name of a given schedule


def plan_in_flight(chain, budget, in_flight, candidates=(), max_slots=None):
    """The least-recompute schedule whose (in_flight - 1) * E + peak fits `budget`, from the frontier and `candidates`,
    ((name, Schedule), ...) such as the uniform policies (a frontier plan may keep more in its first forward)."""
    seen = []  # every plan considered, in order

    def consider(schedule, source):
        peak, recompute = replay(chain, schedule)
        held = end_of_forward_bytes(chain, schedule)
        seen.append(InFlightPlan(schedule, (in_flight - 1) * held + peak, peak, held, recompute, in_flight, budget,
                                 source))
        return seen[-1]

    for name, schedule in candidates:
        consider(schedule, name)
    least = least_budget(chain)
    consider(least_plan(chain).schedule, "planner")
    room = min(budget, sum(max(a for _, a, _ in stage.variants) for stage in chain))
    while room >= least:  # down the frontier: recompute only grows, so the first plan that fits is its cheapest
        plan = consider(plan_chain(chain, room, max_slots).schedule, "planner")
        if plan.peak_bytes <= budget:
            break
        room = plan.microbatch_peak - 1
    options = [plan for plan in seen if plan.peak_bytes <= budget]
    if not options:
        least_seen = min(plan.peak_bytes for plan in seen)
        raise ValueError(f"budget={budget:,} bytes ({budget / 2**20:.2f} MiB) is below what this stage needs with "
                         f"{in_flight} micro-batch{'es' if in_flight > 1 else ''} in flight: the least found is "
                         f"{least_seen:,} bytes; use budget:{math.ceil(least_seen / 2**20 * 100) / 100}MiB or more, "
                         f"or fewer micro-batches in flight")
    return min(options, key=lambda plan: (plan.recompute_flops, plan.peak_bytes))
