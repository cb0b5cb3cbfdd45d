"""plan --with-copies: --budget bounds the activation store and the 16-bit weight copies together; the planner
plans the store beside kept copies and beside recast ones, prices each (recompute FLOPs at --compute-rate, the
casts' bytes at --memory-bandwidth) and prints the policy of the cheaper (picockpt/planning/planner_copies.py)."""
import json

from ..planning.host_walk import DEFAULT_COMPUTE_RATE
from ..planning.planner_copies import DEFAULT_BANDWIDTH, plan_copies
from ..recompute.policy import OP_LEVEL
from .common import config_from_args, fmt_bytes, fmt_flops
from .plan_parts import budget_from_args, measure


def add_copies_arguments(parser):
    parser.add_argument("--with-copies", action="store_true",
                        help="--chain model, --dtype bf16/fp16: --budget bounds the activation store and the 16-bit "
                             "weight copies together; the planner keeps the copies or recasts them at each layer's "
                             "use (policy +recast), whichever its prices make cheaper")
    parser.add_argument("--memory-bandwidth", type=float, metavar="B",
                        help=f"--with-copies: bytes/s a cast streams at (default {DEFAULT_BANDWIDTH:.3g}: an H200's "
                             f"HBM, NVIDIA's datasheet)")


def check_copies_flags(args):
    """--memory-bandwidth belongs to --with-copies; --with-copies prices in FLOPs and keeps the copies on device."""
    if args.memory_bandwidth is not None and not args.with_copies:
        raise ValueError("--memory-bandwidth: only --with-copies reads it; add --with-copies, or leave it out")
    if not args.with_copies:
        return
    given = [flag for flag, present in (("--offload", args.offload), ("--host-bandwidth", args.host_bandwidth),
                                        ("--cost", args.cost != "flops"), ("--chain uniform", args.chain == "uniform"),
                                        ("--benchmark", args.benchmark)) if present]
    if given:
        raise ValueError(f"--with-copies with {', '.join(given)}: it plans the two-action store at --compute-rate "
                         f"beside the copies' casts at --memory-bandwidth; leave {', '.join(given)} out")


def run_copies(args):
    cfg = config_from_args(args)
    if cfg.torch_dtype == cfg.param_dtype:
        raise ValueError(f"--with-copies with --dtype {cfg.dtype}: the step computes with the master weights, so "
                         f"there are no 16-bit copies to keep or recast; add --dtype bf16 (or fp16)")
    budget = budget_from_args(args)
    rate = DEFAULT_COMPUTE_RATE if args.compute_rate is None else args.compute_rate
    bandwidth = DEFAULT_BANDWIDTH if args.memory_bandwidth is None else args.memory_bandwidth
    for flag, value in (("--compute-rate", rate), ("--memory-bandwidth", bandwidth)):
        if not 0 < value < float("inf"):
            raise ValueError(f"{flag}={value:g}: give a positive number (FLOP/s, bytes/s), e.g. --compute-rate "
                             f"989e12 --memory-bandwidth 4.8e12")
    op_text = "" if args.op_level == "none" else f"+{args.op_level}"
    try:
        chosen, both = plan_copies(cfg, args.batch, args.seq, budget, OP_LEVEL.get(args.op_level, frozenset()),
                                   op_text, rate, bandwidth)
    except ValueError as error:
        raise ValueError(f"--budget {args.budget} --with-copies: {error}") from None
    rows = [{"copies": "recast" if o.recast else "kept", "copy_bytes": o.copy_bytes, "store_budget": o.store_budget,
             "fits": o.plan is not None, "policy": o.policy, "casts": o.casts, "cast_bytes": o.cast_bytes,
             "peak_bytes": o.plan.peak_bytes if o.plan else None,
             "recompute_flops": o.plan.recompute_flops if o.plan else None,
             "modelled_seconds": o.seconds if o.plan else None} for o in both]
    result = {"budget_bytes": budget, "compute_rate": rate, "memory_bandwidth": bandwidth, "options": rows,
              "chosen": chosen.policy}
    if args.measure:
        result.update(measure(cfg, args, chosen.policy))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"plan for {fmt_bytes(budget)} of activations and 16-bit weight copies together: L={cfg.layers} "
          f"h={cfg.hidden} {cfg.dtype}, batch {args.batch} x {args.seq} tokens; priced at {rate / 1e12:.4g} TFLOP/s "
          f"and {bandwidth / 1e12:.3g} TB/s (modelled, not measured)")
    print(f"  {'copies':<8}{'copies hold':>13}{'store room':>13}{'store peak':>13}{'recompute':>17}{'casts':>7}"
          f"{'cast bytes':>13}{'modelled':>12}")
    for o in both:
        fits = o.plan is not None
        print(f"  {'recast' if o.recast else 'kept':<8}{fmt_bytes(o.copy_bytes):>13}"
              f"{fmt_bytes(max(o.store_budget, 0)):>13}"
              f"{fmt_bytes(o.plan.peak_bytes) if fits else 'no fit':>13}"
              f"{fmt_flops(o.plan.recompute_flops) if fits else '-':>17}{o.casts:>7}{fmt_bytes(o.cast_bytes):>13}"
              f"{f'{o.seconds * 1e3:.4g} ms' if fits else '-':>12}")
    print(f"  chosen: --policy {chosen.policy}  (the modelled time counts only what differs: recomputed FLOPs and "
          f"the casts' bytes)")
    if args.measure:
        equal = result["measured_peak_bytes"] == chosen.plan.peak_bytes
        print(f"  measured peak of the store {fmt_bytes(result['measured_peak_bytes'])}: "
              f"{'equal' if equal else 'DIFFERS'} to the plan's")
