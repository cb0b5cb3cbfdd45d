"""A pipeline stage's plan: the least-recompute schedule for one micro-batch when the stage holds w at once, its peak
(w - 1) * E + the micro-batch's own (pp_forms.py). A plan that fits a budget alone may not fit it w times over, and what
a first forward keeps costs w times what a recompute sweep keeps (sweeps run one micro-batch at a time). The
candidates: the single-process planner's Pareto front (picockpt/planning/planner.py), walked down from the budget."""
import math
from collections import namedtuple

from ...planning.planner import least_budget, least_plan, plan_chain, replay


class BudgetTooSmall(ValueError):
    """A budget below what a stage (or an interleaved rank's chunks) needs; .least: the fewest bytes found to fit, so
    a caller planning every stage can name the largest need over all of them at once."""

    def __init__(self, budget, least, needs, fewer):
        fits = math.ceil(least / 2**20 * 100) / 100  # MiB, rounded up
        super().__init__(f"budget={budget:,} bytes ({budget / 2**20:.2f} MiB) is below what {needs}: the least found "
                         f"is {least:,} bytes; use budget:{fits}MiB or more, or {fewer}")
        self.least = least


def variant_bytes(stage, mode):
    """What a layer (the head) of a chain stores run whole in `mode`."""
    return next(a for name, a, _ in stage.variants if name == mode)


def end_of_forward_bytes(chain, schedule):
    """E: the bytes a schedule's first forward leaves stored (checkpoints, layers kept whole, the head)."""
    return sum(stage.input_bytes if mode == "input" else variant_bytes(stage, mode) if mode.stored else 0
               for mode, stage in zip(schedule.forward, chain[:-1])) + variant_bytes(chain[-1], schedule.head)


def in_flight_peak(order, stored, peaks, left=None):
    """The most a stage's store holds over its actions in order (pp_schedules.Action: kind "F", "B" or "W",
    microbatch, chunk), each a function of (microbatch, chunk): a forward leaves stored(m, c); a backward peaks at
    peaks(m, c) above what the others hold and leaves left(m, c) (ZB-H1: what its W reads), which the W frees."""
    held, total, peak = {}, 0, 0  # total: sum(held.values()), kept as it changes (the walk linear in M)
    for kind, m, c in order:
        before = held.pop((m, c)) if kind != "F" else 0  # B: what its F left; W: what its B left
        if kind == "B":
            peak = max(peak, total - before + peaks(m, c))
        if kind != "W":
            held[m, c] = stored(m, c) if kind == "F" else left(m, c) if left else 0
        total += held.get((m, c), 0) - before
        peak = max(peak, total)
    return peak


def walk_peak(order, in_flight, held, peak, left=None):
    """A stage's peak with every micro-batch alike (E held, its own peak, per layer what its B leaves): its order
    walked (in_flight_peak), or without one (in_flight - 1) E + peak."""
    if not order:
        return (in_flight - 1) * held + peak
    w = sum(left or ())
    return in_flight_peak(order, lambda m, c: held, lambda m, c: peak, lambda m, c: w)


# plan_in_flight's answer: one micro-batch's schedule, the stage's peak ((in_flight - 1) E + microbatch_peak, its own
# peak by replay), E, its recompute FLOPs, and source: "planner" (a plan of the frontier) or a given schedule's name
InFlightPlan = namedtuple("InFlightPlan",
                          "schedule peak_bytes microbatch_peak end_of_forward recompute_flops in_flight budget source")


def plan_in_flight(chain, budget, in_flight, candidates=(), order=None, left=None):
    """The least-recompute schedule whose (in_flight - 1) * E + peak fits `budget`, from the frontier and `candidates`,
    ((name, Schedule), ...) such as the uniform policies (a frontier plan may keep more in its first forward).
    order, left: the stage's Actions and what each layer's B leaves for its W (ZB-H1): every plan priced by
    in_flight_peak, W's bytes a fixed cost that every plan keeps around."""
    peak, (schedule,), source, (held,), ((own, recompute),) = cheapest(
        [chain], budget, lambda held, own: walk_peak(order, in_flight, held[0], own[0][0], left),
        [(name, [schedule]) for name, schedule in candidates], left,
        f"this stage needs with {in_flight} micro-batch{'es' if in_flight > 1 else ''} in flight",
        "fewer micro-batches in flight")
    return InFlightPlan(schedule, peak, own, held, recompute, in_flight, budget, source)


def plan_chunks(chains, budget, order, candidates):
    """Interleaved under budget:SIZE: one schedule per chunk of a rank (chains[c]), the least recompute over all its
    chunks whose walk along the rank's order (in_flight_peak) fits `budget` (cheapest), every uniform policy all the
    chunks have (candidates[c]: uniform_schedules) tried on all alike. Returns [(Schedule, source)] per chunk."""
    shared = sorted(set.intersection(*(set(dict(named)) for named in candidates)))
    _, schedules, source, _, _ = cheapest(
        chains, budget, lambda held, own: in_flight_peak(order, lambda m, c: held[c], lambda m, c: own[c][0]),
        [(name, [dict(named)[name] for named in candidates]) for name in shared], None,
        f"this rank's {len(chains)} chunks need together", "fewer micro-batches")
    return [(schedule, source) for schedule in schedules]


def cheapest(chains, budget, peak_of, candidates, left, needs, fewer):
    """(peak, schedules, source, E per chain, (own peak, recompute) per chain) of the least recompute (summed over
    the chains) whose peak_of(E's, owns) fits `budget`: the candidates [(name, [Schedule per chain])], the
    planner's least plans, then its frontier at one room for every chain, walked down from the budget (recompute
    only grows, so the first plan that fits is its cheapest); BudgetTooSmall (needs, fewer) when none fits."""
    seen = []  # (peak, schedules, source, held, own, recompute) of every plan considered, in order

    def consider(schedules, source):
        held = [end_of_forward_bytes(chain, schedule) for chain, schedule in zip(chains, schedules)]
        own = [replay(chain, schedule, left) for chain, schedule in zip(chains, schedules)]
        seen.append((peak_of(held, own), schedules, source, held, own, sum(recompute for _, recompute in own)))
        return seen[-1][0]

    for name, schedules in candidates:
        consider(schedules, name)
    consider([least_plan(chain).schedule for chain in chains], "planner")
    room = min(budget, max(sum(max(a for _, a, _ in stage.variants) for stage in chain) for chain in chains))
    least = max(least_budget(chain) for chain in chains)
    while room >= least:
        frontier = [plan_chain(chain, room) for chain in chains]
        if consider([plan.schedule for plan in frontier], "planner") <= budget:
            break
        room = max(plan.peak_bytes for plan in frontier) - 1  # its own peak, W's bytes left out: always smaller
    fits = [one for one in seen if one[0] <= budget]
    if not fits:
        raise BudgetTooSmall(budget, min(one[0] for one in seen), needs, fewer)
    return min(fits, key=lambda one: (one[-1], one[0]))[:-1]  # the least recompute, then the least peak
