"""What plan's two-action and three-action modes share: the --budget flag and the policy, the JSON row's keys
and the sweeps in it, one tracked step."""
from ..planning.fit import check_fits
from ..planning.step_forms import step_flops
from ..planning.planner import least_budget, model_chain
from ..recompute.policy import OP_LEVEL, as_policy, parse_policy, parse_size
from ..device import resolve_device
from .common import fmt_bytes


def budget_from_args(args):
    """--budget in bytes; a size parse_size refuses is named by its flag."""
    try:
        return parse_size(args.budget)
    except ValueError as error:
        raise ValueError(f"--budget={args.budget!r}: {error}") from None


def budget_policy(args, cfg, suffix=""):
    """(bytes, the op level's drops, the policy's text, the policy) of --budget and --op-level, and `suffix`."""
    budget = budget_from_args(args)
    text = f"budget:{args.budget}" + ("" if args.op_level == "none" else f"+{args.op_level}") + suffix
    return budget, OP_LEVEL.get(args.op_level, frozenset()), text, parse_policy(text, cfg)


def plan_row(cfg, args, text, budget, unstored, plan, grid, seconds, after):
    """The JSON keys both plans print; `after`, {shared key: {key: value}}, puts a mode's own keys after one."""
    row = {"policy": text, "budget_bytes": budget, "peak_bytes": plan.peak_bytes,
           "recompute_flops": plan.recompute_flops,
           "forward_flops": step_flops(cfg, args.batch, args.seq, "none")["forward"],
           "least_budget_bytes": least_budget(model_chain(cfg, args.batch, args.seq, unstored)),
           "slot_bytes": grid.slot_bytes, "exact_grid": grid.exact_grid, "planning_seconds": seconds,
           "forward": list(plan.schedule.forward), "sweeps": [  # every recompute sweep, in the order they run
               {"target": last, "first": first, "modes": [plan.schedule.sweep(k, last) for k in range(first, last + 1)]}
               for first, last in plan.schedule.sweeps(cfg.layers)]}
    return {name: value for key in row for name, value in ((key, row[key]), *after.get(key, {}).items())}


def measured_line(name, measured, planned, fmt=fmt_bytes):
    return name, fmt(measured), "equal" if measured == planned else "DIFFERS"


def measure(cfg, args, policy, schedule=None):
    """One tracked step of the plan: the policy's (a Policy, or the text a plan chose), or (schedule) the one
    planned at the flags' rates."""
    import torch

    from ..recompute.engine import Model, Step, loss_and_grads
    from ..measurement.measure import make_batch
    from ..model.params import init_params
    from ..measurement.tracker import Tracker
    policy = as_policy(policy, cfg)
    device = resolve_device(args.device)
    check_fits(cfg, device, args.batch, args.seq, policy,
               advice="use a smaller --batch or --seq, or a smaller --budget", optimizer=False)
    params = init_params(cfg, seed=args.seed, device=device)
    input_ids, targets = make_batch(cfg, args.batch, args.seq, device, args.seed)
    torch.manual_seed(args.seed)
    with Tracker(device) as tracker, torch.no_grad():
        if schedule is None:
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
        else:
            step = Step(Model(params, cfg, input_ids, targets), schedule, policy.unstored, tracker)
            step.forward()
            step.backward()
    return {"measured_peak_bytes": tracker.peak_logical, "measured_recompute_flops": tracker.flops["recompute"],
            "measured_peak_live_bytes": tracker.peak_physical, "measured_host_peak_bytes": tracker.peak_host}
