"""Three actions per layer: keep, recompute or offload, chosen at a modelled time (host_walk.py walks each
candidate: its exact device and host bytes, its copies and compute on two streams).

The planner (plan_offload) searches a family of schedules rather than solving for the optimum: every plan of the
two-action planner's frontier (picockpt/planning/planner.py, from storing everything down to the least budget) and, for
each, the same plan with the first n layers' (n = 1..L) first-forward tensors offloaded, all of them, only the
checkpoints (inputs), or only the MLP's gate and up projections. It keeps the fastest whose device peak, walked exactly,
fits the budget. The two-action plan at the budget is in the family (n = 0), so the three-action plan is never slower by
the model; Capuchin (Peng et al. 2020) and POET (Patil et al. 2022) decide per tensor with a profile or an integer
programme, which this does not attempt. With `seconds` (op name -> seconds: picockpt/planning/cost.py's roofline or a
measured profile) the walk's clock reads the chain priced in seconds instead of FLOPs over `rate`; the plan still
reports its exact FLOPs.
"""
import functools
import itertools
from dataclasses import dataclass, replace

from .cost import price_chain, priced_costs
from .host_walk import DEFAULT_COMPUTE_RATE, DEFAULT_HOST_BANDWIDTH, Walk, check_rates, model_costs, walk
from .planner import frontier, least_plan, model_chain, plan_chain, replay
from ..recompute.schedule import Schedule

KINDS = {"all": frozenset({"*"}), "inputs": frozenset({"input"}), "gate+up": frozenset({"mlp.gate", "mlp.up"})}


@dataclass(frozen=True)
class OffloadPlan:
    schedule: Schedule       # what the engine runs (Schedule.host: what the first forward offloads)
    walk: Walk               # its exact device and host bytes and its modelled time
    two_action: object       # the two-action planner's Plan at the same budget (None: it has none that fits)
    two_action_walk: Walk    # that plan's modelled time (no copies)
    budget: int
    bandwidth: float
    rate: float
    base: object = None      # the two-action Plan whose schedule this one offloads from (its memory grid)
    clock: tuple = None      # (chain, rate) the walk's clock read: FLOPs at `rate`, or seconds at 1

    @property
    def peak_bytes(self):
        return self.walk.device_peak

    @property
    def recompute_flops(self):
        return self.walk.recompute_flops


def with_host(schedule, names, n):
    """`schedule` with the first n layers that store something in the first forward offloading `names`."""
    chosen = set([k for k, mode in enumerate(schedule.forward) if mode.keeps_input][:n])
    host = tuple(names if k in chosen else frozenset() for k in range(len(schedule.forward)))
    return Schedule(schedule.forward, schedule.sweep_modes, schedule.head, schedule.stop_early, host=host)


@functools.lru_cache(maxsize=64)
def plan_offload(cfg, batch, seq, budget, unstored=frozenset(), bandwidth=DEFAULT_HOST_BANDWIDTH,
                 rate=DEFAULT_COMPUTE_RATE, names=None, seconds=None):
    """The fastest schedule (by host_walk.py's model) of the family above whose device peak fits
    `budget` bytes. names: offload only these (a policy's offload:NAMES); None or {"*"}: the planner's kinds.
    seconds: ((op name, seconds), ...) to price compute by (None: FLOPs at `rate`)."""
    check_rates(bandwidth, rate)
    flop_chain, flop_costs = model_chain(cfg, batch, seq, unstored), model_costs(cfg, batch, seq, unstored)
    chain, costs, rate = (flop_chain, flop_costs, rate) if seconds is None else (
        price_chain(flop_chain, cfg, batch, seq, dict(seconds), unstored), priced_costs(cfg, batch, seq, dict(seconds),
                                                                                     unstored), 1.0)
    kinds = list(KINDS.values()) if names is None or "*" in names else [frozenset(names)]
    if cfg.experts:
        kinds = [kind for kind in kinds if not kind & {"mlp.gate", "mlp.up"}]
    plans = _two_action_plans(chain)
    try:
        two = plan_chain(chain, budget)
    except ValueError:  # below the two-action planner's least budget: offloading may still fit
        two = None
    two_walk = walk(chain, two.schedule, costs, bandwidth, rate) if two is not None else None
    best = (two_walk.seconds, two_walk, two.schedule, two) if two is not None else None
    base = (len(chain) - 1) * (costs.layer_forward + costs.layer_backward) + costs.head_forward + costs.head_backward
    for plan in sorted(plans, key=lambda plan: plan.recompute_flops):
        if best is not None and (base + plan.recompute_flops) / rate >= best[0]:
            break  # its compute alone takes longer than the best so far: so do all that follow
        for kind, n in itertools.product(kinds, range(1, len(chain))):
            schedule = with_host(plan.schedule, kind, n)
            if not any(schedule.host):
                continue
            result = walk(chain, schedule, costs, bandwidth, rate)
            if result.device_peak <= budget and (best is None or result.seconds < best[0]):
                best = (result.seconds, result, schedule, plan)
    if best is None:
        least = min((walk(chain, with_host(plan.schedule, KINDS["all"], len(chain)), costs, bandwidth, rate)
                     for plan in plans), key=lambda result: result.device_peak)
        raise ValueError(f"budget={budget:,} bytes ({budget / 2**20:.2f} MiB) is below the least device peak of any "
                         f"plan with offloading, {least.device_peak:,} bytes ({least.device_peak / 2**20:.2f} MiB): "
                         f"give a budget of at least that (it is set {peak_words(least)}; {WHY[least.peak_at[0]]})")
    _, result, schedule, base = best
    if seconds is not None:  # the exact FLOPs beside the modelled seconds
        result = replace(result, recompute_flops=replay(flop_chain, schedule)[1])
        two_walk = two_walk and replace(two_walk, recompute_flops=replay(flop_chain, two.schedule)[1])
        two = two and replace(two, recompute_flops=replay(flop_chain, two.schedule)[1],
                              recompute_seconds=two.recompute_flops)
    return OffloadPlan(schedule, result, two, two_walk, budget, bandwidth, rate, base, (chain, rate))


WHY = {  # why offloading does not lower a peak set in this part of the step (host_walk.Walk.peak_at's phase)
    "forward": "the tensors put so far are on the device until their copies to the host are queued, and the plan "
               "offloads a layer's tensors only where the copy makes the step faster, not to lower a peak that fits",
    "head": "the logits and loss are made and read inside the head, between the last layer's forward and its "
            "backward, and never stored, so there is nothing of them to offload; and the last layer's offloaded "
            "tensors come back while the head's backward runs (its backward is next), so the head holds them "
            "either way",
    "recompute": "a recomputed layer's tensors are made on the device and read there by the backward that follows, "
                 "and offloading moves only the first forward's tensors, which are back on the device (prefetched "
                 "one layer ahead) before the backward that reads them",
    "backward": "a layer's backward reads its tensors on the device, so an offloaded one is back (prefetched one "
                "layer ahead, or fetched) before it starts: offloading empties the device between a layer's forward "
                "and its backward, not during it"}


def peak_words(result):
    """Where a walk's device peak is set and what the device holds then, in words."""
    phase, k, target = result.peak_at
    where = {"forward": f"in the first forward, at layer {k}'s puts", "head": "at the head (the logits and loss)",
             "recompute": f"while layer {k} is recomputed for " + ("its" if k == target else f"layer {target}'s")
                          + " backward",
             "backward": f"in layer {k}'s backward, as tensors come back from the host"}[phase]
    return where + ", holding " + " and ".join(f"{what} ({n:,} B)" for what, n in result.peak_held)


def peak_reason(plan):
    """Why the three-action plan's device peak is no lower than the two-action plan's (None: it is lower)."""
    two = plan.two_action_walk
    if two is None or plan.peak_bytes != two.device_peak:
        return None
    offloads = any(layer["host"] for layer in plan.walk.layers)
    return (f"device peak {plan.peak_bytes:,} B, the two-action plan's too: it is set {peak_words(plan.walk)}; "
            + ("" if offloads else "nothing is offloaded, since the two-action plan fits the budget and no copy "
                                   "would make the step faster by the model; ")
            + WHY[plan.walk.peak_at[0]])


@functools.lru_cache(maxsize=16)
def _two_action_plans(chain):
    """The two-action frontier, from storing everything down to the least budget, and the least plan."""
    return tuple(frontier(chain)) + (least_plan(chain),)


def actions(plan):
    """Per layer: (action, why), in words, from the plan's schedule and its walk."""
    schedule, info, (chain, rate) = plan.schedule, plan.walk.layers, plan.clock
    L = len(chain) - 1
    host = schedule.host or (frozenset(),) * L
    recomputed = {k for first, last in schedule.sweeps(L) for k in range(first, last + 1)}
    rows = []
    for k in range(L):
        mode, stage = schedule.forward[k], chain[k]
        if info[k]["host"]:
            what = "all it stores" if "*" in host[k] else ", ".join(sorted(host[k]))
            forward = stage.forward_flops / rate
            action = f"offload ({what})" + (" + recompute" if k in recomputed else "")
            why = (f"{info[k]['host']:,} B over the link: {info[k]['copy'] * 1e6:.1f} us of copies (out in the "
                   f"forward, back in the backward), queued on the side stream while the other layers compute "
                   f"({forward * 1e6:.1f} us a layer's forward, twice that its backward); exposed "
                   f"{info[k]['wait'] * 1e6:.1f} us")
        elif k in recomputed:
            action = "recompute" + (" (its input kept)" if mode.keeps_input else "")
            moved = stage.input_bytes if not mode.keeps_input else max(a for _, a, _ in stage.variants)
            why = (f"{stage.forward_flops / rate * 1e6:.1f} us to forward it again; keeping it on the device does "
                   f"not fit the budget, and moving {moved:,} B would take {moved / plan.bandwidth * 1e6:.1f} us "
                   f"over the link")
        else:
            action = f"keep ({mode})"
            why = "fits on the device within the budget: no copy, no recompute"
        rows.append((action, why))
    return rows
