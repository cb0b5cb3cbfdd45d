"""What plan's two-action and three-action modes share: the --budget flag, the sweeps in JSON, one tracked step."""
from ..planning.fit import check_fits
from ..recompute.policy import parse_size
from ..device import resolve_device


def budget_from_args(args):
    """--budget in bytes; a size parse_size refuses is named by its flag."""
    try:
        return parse_size(args.budget)
    except ValueError as error:
        raise ValueError(f"--budget={args.budget!r}: {error}") from None


def sweeps_json(schedule, layers):
    """Every recompute sweep, in the order they run: its target, first layer and each layer's mode."""
    return [{"target": last, "first": first, "modes": [schedule.sweep(k, last) for k in range(first, last + 1)]}
            for first, last in schedule.sweeps(layers)]


def measure(cfg, args, policy, schedule=None):
    """One tracked step of the plan: the policy's, or (schedule) the one planned at the flags' rates."""
    import torch

    from ..recompute.engine import Model, Step, loss_and_grads
    from ..measurement.measure import make_batch
    from ..model.params import init_params
    from ..measurement.tracker import Tracker
    device = resolve_device(args.device)
    check_fits(cfg, device, args.batch, args.seq, policy,
               advice="use a smaller --batch or --seq, or a smaller --budget")
    params = init_params(cfg, seed=args.seed, device=device)
    input_ids, targets = make_batch(cfg, args.batch, args.seq, device, args.seed)
    torch.manual_seed(args.seed)
    with Tracker(device) as tracker, torch.no_grad():
        if schedule is None:
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
        else:
            step = Step(Model(params, cfg, input_ids, targets), schedule, policy.drop, tracker)
            step.forward()
            step.backward()
    return {"measured_peak_bytes": tracker.peak_logical, "measured_recompute_flops": tracker.flops["recompute"],
            "measured_peak_live_bytes": tracker.peak_physical, "measured_host_peak_bytes": tracker.peak_host}
