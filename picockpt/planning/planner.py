"""The memory-budget planner: of all the ways the engine can run one step, the one with the
least recompute whose stored bytes fit a budget. This is rotor's dynamic programme (Beaumont
et al. 2019, "Optimal checkpointing for heterogeneous chains") on picockpt's own layers;
binomial checkpointing (picockpt/planning/planner_uniform.py) is its case of equal steps.

The chain (Stage, model_chain) and the exact walk of a schedule over it (replay) are planner_chain.py's:
the stages' F_k, X_k, A_k^v, R_k^v and D_k below are defined there.

The recurrence. C(s, t, m) is the least recompute that runs the backward of stages t, t-1, .., s when x_s is stored (or
is the state in hand, about to be), nothing of s+1..t is stored, and stages s..t may hold at most m bytes at any moment,
x_s included. The engine's loop can only do one of two things with stage s:

    store it whole, variant v, and go on:      R_s^v + C(s+1, t, m - A_s^v)     (s = t: R_t^v)
        stage s holds A_s^v bytes until its own backward, the last of the sub-chain.
    keep only its input and run on to j (s < j <= t) storing nothing, then split:
        F_s + .. + F_{j-1}  +  C(j, t, m - X_s)  +  C(s, j-1, m) - D_{j-1}
        x_s stays stored while stages j..t are done in the m - X_s bytes left; then the
        backward of j-1 finds x_s as its nearest checkpoint and forwards s..j-1 again, in m bytes.
        That new sweep ends at j-1, whose output nobody needs any more: it stops before its
        tail, D_{j-1} FLOPs (a layer's down projection), as PyTorch's non-reentrant checkpoint
        stops at the last tensor a backward needs (Schedule.stop_early).

C(s, t, m) is the least of these options; the answer is C(0, L, budget). The second option, applied inside itself,
recomputes a layer more than once when memory is tight (multi-level). Each stage is forwarded whole exactly once, just
before its backward or earlier; every other forward of it is an advance, and the engine counts every forward after a
stage's first as recompute: the advances plus the rebuilds R, less the tails D skipped, are exactly the tracker's
"recompute" FLOPs.

The memory axis is a grid of slots. Sizes are whole multiples of their greatest common divisor, so when the budget is at
most `max_slots` of those units the grid is exact, to the byte. Otherwise slots are coarser and every size is rounded up
to whole slots; as rounding adds less than a slot per stage held at once, the grid gets L+1 slots beyond the budget, and
the plan kept is the one of the most grid room (found by bisection) whose exact bytes, replayed, fit: never over budget,
at worst a little dearer than the true optimum.

numpy works along the memory axis and over j at once: O(L^3) additions of arrays `slots` long; a sub-chain made of the
same stages as one already solved (picockpt's layers are all alike) takes that one's answer, which makes it O(L^2) for a
chain of equal layers. Whatever the grid, replay() walks the chosen schedule through the engine's loop with exact byte
counts: that walk gives peak_bytes and recompute_flops, which the Tracker then measures.

    plan = plan_model(cfg, batch=4, seq=128, budget_bytes=24 * 2**20)
    plan.schedule, plan.peak_bytes, plan.recompute_flops        # what the engine runs and measures

Priced by time: picockpt/planning/cost.py's plan_priced runs this recurrence on seconds instead of FLOPs.
"""
import functools
import math
from dataclasses import dataclass

import numpy as np

from .planner_chain import Stage, model_chain, replay  # noqa: F401 (re-exported: parallel/, lessons)
from ..recompute.schedule import Schedule


@dataclass(frozen=True)
class Plan:
    schedule: Schedule       # what the engine runs: modes of the first forward and of every sweep
    peak_bytes: int          # the activation store's exact peak (the Tracker's peak_logical)
    recompute_flops: int     # exact (the Tracker's flops["recompute"])
    budget: int              # bytes asked for
    slot_bytes: int          # the grid's unit; exact when it divides every size
    exact_grid: bool
    sweeps: tuple            # ((target, first layer, {layer: mode}), ...) in the order they run
    recompute_seconds: float = None  # planned on seconds (cost.plan_priced): the modelled recompute time


@functools.lru_cache(maxsize=256)
def plan_model(cfg, batch, seq, budget_bytes, unstored=frozenset(), max_slots=None):
    """The cheapest schedule for picockpt's model whose activation store stays within budget_bytes."""
    return plan_chain(model_chain(cfg, batch, seq, unstored), budget_bytes, max_slots)


# ---- the dynamic programme -----------------------------------------------------------------
def plan_chain(chain, budget, max_slots=None):
    """The least-recompute Plan for a chain of Stages (the last one is the head) within `budget` bytes."""
    slot, slots, exact = _grid(chain, budget, max_slots)
    extra = 0 if exact else len(chain)  # rounding up adds less than one slot per stage held at once
    _check_table_fits(len(chain), slots + extra)
    least = least_budget(chain)
    if budget < least:
        raise ValueError(f"budget={budget:,} bytes ({budget / 2**20:.2f} MiB) is below the least feasible "
                         f"budget for this model and batch, {least:,} bytes ({least / 2**20:.2f} MiB): "
                         f"give a budget of at least {math.ceil(least / 2**20 * 100) / 100}MiB")
    cost = _solve(chain, slot, slots + extra)
    whole = cost[len(chain) - 1, 0]  # (m,) C(0, L, m): the whole chain in m slots

    def plan_at(m):
        return _plan(chain, functools.partial(_best_option, chain, slot, cost), m, budget, slot, exact)

    # with up to `slots` of grid room the exact bytes fit for sure; beyond, bisect for the most that does
    lo, hi = max(slots, int(np.argmax(np.isfinite(whole)))), slots + extra
    best = plan_at(lo) if np.isfinite(whole[lo]) else None
    if best is None or best.peak_bytes > budget:  # a coarse grid, no room left near the least budget
        return _plan(chain, functools.partial(_least_option, chain, _least_table(chain)), None, budget, slot, exact)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plan = plan_at(mid)
        if plan.peak_bytes <= budget:
            lo, best = mid, plan
        else:
            hi = mid - 1
    return best


def _check_table_fits(n, slots):
    """ValueError, before any work, when _solve's table of n x n x (slots + 1) float64 costs would take
    more than half the RAM available (a chain of thousands of layers)."""
    from ..device import available_bytes
    need, (have, where) = n * n * (slots + 1) * 8, available_bytes("cpu")
    if need > have // 2:
        most = math.isqrt(have // 2 // ((slots + 1) * 8))
        raise ValueError(f"layers: a chain of {n} stages needs the planner's table of {n}^2 x {slots + 1} costs, "
                         f"{need / 2**30:.1f} GiB, more than half the {have / 2**30:.1f} GiB of {where}; plan at most "
                         f"about {most - 1} layers, or a uniform chain (--chain uniform --length {n - 1})")


def _grid(chain, budget, max_slots):
    """(bytes per slot, slots in the budget, exact?). Exact when the budget is at most `max_slots`
    units of the sizes' greatest common divisor; else `max_slots` coarser slots."""
    max_slots = max_slots or max(1000, 2 * 10**8 // len(chain) ** 3)  # about 10^8 additions in _solve
    useful = min(budget, sum(max(a for _, a, _ in stage.variants) for stage in chain))  # more never helps
    sizes = [stage.input_bytes for stage in chain] + [a for stage in chain for _, a, _ in stage.variants]
    unit = functools.reduce(math.gcd, sizes)
    slot = unit if useful // unit <= max_slots else -(-useful // max_slots)
    return slot, useful // slot, slot == unit


def _plan(chain, decide, m, budget, slot, exact):
    """Unroll the decisions from C(0, L, m) into a Plan; its bytes and FLOPs from the exact walk."""
    forward, sweeps = _unroll(chain, decide, m)
    L = len(chain) - 1
    schedule = Schedule(forward=tuple(forward[k] for k in range(L)), head=forward[L], stop_early=True,
                        sweep_modes={target: modes for target, _, modes in sweeps})
    peak, recompute = replay(chain, schedule)
    return Plan(schedule, peak, recompute, budget, slot, exact, tuple(sweeps))


def _sizes(stage, slot):
    """Sizes in slots, rounded up (a plan on the grid never exceeds the budget in bytes)."""
    return -(-stage.input_bytes // slot), [(mode, -(-a // slot), r) for mode, a, r in stage.variants]


def _solve(chain, slot, slots):
    """cost[t, s, m] = C(s, t, m) for every sub-chain s..t and m = 0..slots (inf: does not fit)."""
    n = len(chain)
    advanced = np.concatenate([[0.0], np.cumsum([stage.forward_flops for stage in chain])])  # (n+1,)
    tail = [stage.tail_flops for stage in chain]  # a new sweep from s ends at j-1 and skips its tail
    cost = np.empty((n, n, slots + 1))  # (t, s, m); only s <= t is ever written or read
    stage_names, chain_names = {}, {}  # a number for each distinct stage, and for each distinct sub-chain
    stage_name = [stage_names.setdefault(stage, len(stage_names)) for stage in chain]
    name, solved = {}, {}  # (t, s) -> the number of the sub-chain s..t; that number -> (t, s) solved first
    for s in range(n - 1, -1, -1):
        x, variants = _sizes(chain[s], slot)
        lower = np.full((n - s, slots + 1), np.inf)  # (t - s, m): C(s, t, m) + F_s + .. + F_t, rows t = s..
        for t in range(s, n):
            best = cost[t, s]  # (m,) a view: filled in place
            key = (stage_name[s], name.get((t, s + 1)))  # stage s, then the sub-chain s+1..t
            name[t, s] = chain_names.setdefault(key, len(chain_names))
            if name[t, s] in solved:  # the same stages as a sub-chain already solved: the same answer
                best[:] = cost[solved[name[t, s]]]
                lower[t - s] = best + (advanced[t + 1] - advanced[s] - tail[t])
                continue
            solved[name[t, s]] = (t, s)
            best.fill(np.inf)
            for _, a, r in variants:  # store s whole
                if a <= slots:
                    rest = 0.0 if s == t else cost[t, s + 1, : slots + 1 - a]  # (m - a,)
                    np.minimum(best[a:], r + rest, out=best[a:])
            if s < t and x <= slots:  # checkpoint s, run on to j = s+1..t
                upper = cost[t, s + 1: t + 1, : slots + 1 - x]  # (t - s, m - x) C(j, t, m - X_s)
                split = (upper + lower[: t - s, x:]).min(axis=0)  # (m - x,) best j for each m
                np.minimum(best[x:], split, out=best[x:])
            lower[t - s] = best + (advanced[t + 1] - advanced[s] - tail[t])  # (m,) for the splits of longer t
    return cost


def _best_option(chain, slot, cost, s, t, m):
    """The option C(s, t, m) took: ("all", mode, bytes held) or ("checkpoint", j, bytes held)."""
    x, variants = _sizes(chain[s], slot)
    options = [(r + (0.0 if s == t else cost[t, s + 1, m - a]), ("all", mode, a)) for mode, a, r in variants if a <= m]
    advanced = 0.0
    for j in range(s + 1, t + 1) if x <= m else ():
        advanced += chain[j - 1].forward_flops
        again = cost[j - 1, s, m] - chain[j - 1].tail_flops  # the new sweep stops before j-1's tail
        options.append((advanced + cost[t, j, m - x] + again, ("checkpoint", j, x)))
    return min(options, key=lambda option: option[0])[1]  # the first of equal costs


def _unroll(chain, decide, m):
    """Follow the decisions from C(0, L, m): the modes of the first forward and of every sweep."""
    forward, sweeps = {}, []

    def walk(s, t, m, modes):  # modes: the forward pass in progress, {layer: mode}
        kind, choice, held = decide(s, t, m)
        rest = None if m is None else m - held  # None: decisions that do not depend on the room left
        if kind == "all":
            modes[s] = choice
            if s < t:
                walk(s + 1, t, rest, modes)
            return
        modes.update({s: "input", **{k: "none" for k in range(s + 1, choice)}})
        walk(choice, t, rest, modes)
        again = {}  # the backward of choice - 1 sweeps from x_s again
        sweeps.append((choice - 1, s, again))
        walk(s, choice - 1, m, again)

    walk(0, len(chain) - 1, m, forward)
    return forward, sweeps


# ---- the least feasible budget: the same recurrence with (max, min) for (+, min) -----------------
def _least_table(chain):
    """least[t, s]: the least peak bytes any schedule of the sub-chain s..t reaches (x_s included)."""
    n = len(chain)
    least = np.zeros((n, n), dtype=np.int64)  # (t, s)
    for s in range(n - 1, -1, -1):
        stage = chain[s]
        for t in range(s, n):
            whole = min(a + (0 if s == t else least[t, s + 1]) for _, a, _ in stage.variants)
            split = np.maximum(stage.input_bytes + least[t, s + 1: t + 1], least[s:t, s]).min() if s < t else whole
            least[t, s] = min(whole, split)
    return least


def _least_option(chain, least, s, t, m):
    """The option of least peak (used when a coarse grid has no room left for the optimum)."""
    stage = chain[s]
    options = [(a + (0 if s == t else least[t, s + 1]), ("all", mode, a)) for mode, a, _ in stage.variants]
    options += [(max(stage.input_bytes + least[t, j], least[j - 1, s]), ("checkpoint", j, stage.input_bytes))
                for j in range(s + 1, t + 1)]
    return min(options, key=lambda option: option[0])[1]


def least_budget(chain):
    """The least budget (bytes) any schedule of the chain fits in."""
    return int(_least_table(chain)[len(chain) - 1, 0])


def least_plan(chain):
    """A Plan of the least peak (its recompute is not minimised), that peak its budget."""
    least = _least_table(chain)
    return _plan(chain, functools.partial(_least_option, chain, least), None, int(least[len(chain) - 1, 0]), 1, True)


def frontier(chain):
    """Every Pareto-optimal plan, from storing everything down to the least budget: a plan at budget b
    is the cheapest for every budget in [its peak, b], so the next budget to ask is its peak - 1."""
    budget, least = sum(max(a for _, a, _ in stage.variants) for stage in chain), least_budget(chain)
    plans = []
    while budget >= least:
        plan = plan_chain(chain, budget)
        if plans and plans[-1].recompute_flops == plan.recompute_flops:
            plans[-1] = plan  # as cheap, and smaller
        else:
            plans.append(plan)
        budget = plan.peak_bytes - 1
    return plans
