"""plan --cost: the planner priced by FLOPs (its default), by a roofline on named hardware, or by measured op times.

    python -m picockpt plan --budget 20MiB --cost roofline --hardware h100
    python -m picockpt plan --budget 20MiB --cost measured --device cpu     # times every op here first (seconds)
    python -m picockpt plan --budget 20MiB --cost measured --offload        # the three actions at those prices

Under roofline or measured the plan is decided on seconds (picockpt/planning/cost.py's plan_priced); the FLOP plan is
priced by the same seconds beside it, so the output says whether, and by how much, the two prices disagree.
"""
from ..planning.cost import HARDWARE_NAMES, hardware, plan_priced, price_chain, roofline_op_seconds
from ..device import resolve_device
from ..planning.planner import model_chain, plan_model, replay
from .common import fmt_flops

COSTS = ("flops", "roofline", "measured")


def add_cost_arguments(parser):
    parser.add_argument("--cost", choices=COSTS, default="flops",
                        help="what the planner minimises: flops (recomputed matmul FLOPs, the default), roofline "
                             "(modelled seconds: each op's FLOPs over the matmul rate or its bytes over the memory "
                             "bandwidth, whichever is longer, on --hardware), measured (each op timed on --device; "
                             "times move with the machine's load, so a measured plan can change between runs)")
    parser.add_argument("--hardware", choices=HARDWARE_NAMES, default=None,
                        help="--cost roofline: datasheet rates of h100, h200 or a100 (bf16), or cpu-measured (this "
                             "CPU's matmul rate and copy bandwidth, timed first; the default)")


def check_cost_flags(args):
    """Flags of one price given with another: an error naming them."""
    if args.cost == "flops":
        if args.hardware is not None:
            raise ValueError(f"--hardware {args.hardware}: only --cost roofline reads it; add --cost roofline, or "
                             f"leave --hardware out")
        return
    if args.chain == "uniform" or args.benchmark:
        raise ValueError(f"--cost {args.cost}: --chain uniform and --benchmark count steps, not op times; use it "
                         f"with --chain model and a --budget")
    if args.compute_rate is not None:
        raise ValueError(f"--compute-rate with --cost {args.cost}: compute is priced by the {args.cost} op times, "
                         f"not at one FLOP rate; leave --compute-rate out, or use --cost flops")
    if args.cost == "measured" and args.hardware is not None:
        raise ValueError(f"--hardware {args.hardware} with --cost measured: a measured profile times the ops on "
                         f"--device; use --cost roofline --hardware {args.hardware}, or leave --hardware out")


def op_seconds(cfg, args):
    """({op: seconds} of the chosen price, where they came from in one line, {op: (fastest, slowest)} or None)."""
    if args.cost == "roofline":
        hw = hardware(args.hardware or "cpu-measured", cfg.dtype)
        return roofline_op_seconds(cfg, args.batch, args.seq, hw), f"roofline on {hw.name} ({hw.source})", None
    from ..planning.op_times import measure_op_seconds
    device = resolve_device(args.device)
    if not args.json:
        print(f"timing each op of one layer and the head on {device}, 7 interleaved rounds ...", flush=True)
    profile = measure_op_seconds(cfg, args.batch, args.seq, device)
    return (profile.seconds, f"measured on {device}: each op's median of {profile.repeats} interleaved rounds (times "
            f"move with the machine's load, so a measured plan can change between runs)", profile.spread)


def priced_plan(cfg, args, budget, unstored):
    """(the plan decided on seconds, the JSON keys it adds): the FLOP plan priced by the same seconds beside it."""
    seconds, source, spread = op_seconds(cfg, args)
    chain = model_chain(cfg, args.batch, args.seq, unstored)
    priced = price_chain(chain, cfg, args.batch, args.seq, seconds, unstored)
    plan = plan_priced(chain, priced, budget)
    by_flops = plan_model(cfg, args.batch, args.seq, budget, unstored)
    flops_seconds = replay(priced, by_flops.schedule)[1]
    extra = {"cost": args.cost, "priced_by": source, "op_seconds": seconds, "op_seconds_spread": spread,
             "recompute_seconds": plan.recompute_seconds,
             "flops_plan": {"recompute_flops": by_flops.recompute_flops, "recompute_seconds": flops_seconds,
                            "peak_bytes": by_flops.peak_bytes, "same_schedule": by_flops.schedule == plan.schedule}}
    return plan, extra


def cost_lines(extra):
    """The text lines plan prints for a priced plan."""
    other, ms = extra["flops_plan"], 1e3
    verdict = ("the same schedule" if other["same_schedule"] else
               f"a different schedule, {other['recompute_seconds'] / extra['recompute_seconds'] - 1:+.1%} modelled "
               f"recompute time" if extra["recompute_seconds"] else "a different schedule")
    return [("priced by", extra["cost"], extra["priced_by"]),
            ("modelled recompute time", f"{extra['recompute_seconds'] * ms:.3f} ms", "what this plan minimised"),
            ("the FLOP plan", fmt_flops(other["recompute_flops"]),
             f"{other['recompute_seconds'] * ms:.3f} ms at these prices: {verdict}")]
