"""python -m picockpt plan: the recomputation schedule of least cost for a memory budget.

    python -m picockpt plan --budget 24MiB                          # picockpt's model (shape flags apply)
    python -m picockpt plan --budget 24MiB --measure                # ... and run it once, tracked
    python -m picockpt plan --chain uniform --length 10 --slots 3   # binomial checkpointing (revolve)
    python -m picockpt plan --benchmark                             # planning time, 128 layers
    python -m picockpt plan --budget 24MiB --host-bandwidth 63e9 --compute-rate 989e12   # keep, recompute
                                                                    # or offload, per layer (planner_offload.py)
    python -m picockpt plan --budget 24MiB --cost measured          # minimise measured seconds (plan_cost.py)
"""
import json
import random
import statistics
import time

from ..planning.planner import Stage, least_budget, model_chain, plan_chain, plan_model
from ..planning.host_walk import DEFAULT_COMPUTE_RATE, DEFAULT_HOST_BANDWIDTH, check_rates
from ..planning.planner_offload import actions, peak_reason, plan_offload
from ..planning.planner_uniform import binomial_forward_steps, plan_uniform
from .common import SHAPE_FLAGS, add_run_args, add_shape_args, config_from_args, fmt_bytes, fmt_flops, report, spans
from .plan_copies import add_copies_arguments, check_copies_flags, run_copies
from .plan_cost import add_cost_arguments, check_cost_flags, cost_lines, op_seconds, priced_plan
from .plan_parts import budget_policy, measure, measured_line, plan_row


def add_arguments(parser):
    parser.add_argument("--chain", choices=("model", "uniform"), default="model",
                        help="model: picockpt's layers at the shape below (default); uniform: l equal steps "
                             "counted in slots, as in Griewank & Walther's revolve")
    parser.add_argument("--budget", help="--chain model: bytes the activation store may hold, e.g. 24MiB, 1.5GiB, "
                                         "3000000 (an error with --chain uniform or --benchmark, which ignore it)")
    parser.add_argument("--op-level", choices=("none", "selective", "cheap"), default="none",
                        help="the least every stored layer drops (the planner may drop more per layer)")
    parser.add_argument("--length", type=int, help="uniform chain: number of steps l (l^2 x s up to 4e8: about a "
                                                   "second of planning; beyond, the error gives the closed form)")
    parser.add_argument("--slots", type=int, help="uniform chain: stored states s (x0 takes one)")
    parser.add_argument("--measure", action="store_true", help="--chain model: run one tracked step with the plan "
                                                                "(refused, with the numbers, if it would not fit)")
    parser.add_argument("--benchmark", action="store_true", help="time the planner on 128-layer chains")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--offload", action="store_true",
                        help="--chain model: three actions per layer (keep, recompute, offload to host memory), "
                             "at the modelled time of --host-bandwidth and --compute-rate (either implies it; "
                             "--compute-rate not beside --with-copies)")
    parser.add_argument("--host-bandwidth", type=float, metavar="B",
                        help=f"bytes/s of the device-host link, per direction (default {DEFAULT_HOST_BANDWIDTH:.3g}: "
                             f"PCIe Gen5 x16, theoretical)")
    parser.add_argument("--compute-rate", type=float, metavar="R",
                        help=f"FLOP/s of the device, for --offload and --with-copies (default "
                             f"{DEFAULT_COMPUTE_RATE:.3g}: an H200's dense BF16 Tensor Core rate, NVIDIA's datasheet)")
    add_cost_arguments(parser)
    add_copies_arguments(parser)
    add_shape_args(parser)
    add_run_args(parser)


def run(args):
    _check_flags(args)
    check_cost_flags(args)
    check_copies_flags(args)
    if args.chain == "uniform":
        return run_uniform(args)
    if args.benchmark:
        return run_benchmark(args)
    if args.budget is None:
        raise ValueError("--budget is required with --chain model: give a size such as --budget 24MiB")
    if args.with_copies:
        return run_copies(args)
    if args.offload or args.host_bandwidth is not None or args.compute_rate is not None:
        return run_offload(args)
    cfg = config_from_args(args)
    budget, unstored, text, policy = budget_policy(args, cfg)
    start = time.perf_counter()
    plan, extra = (plan_model(cfg, args.batch, args.seq, budget, unstored), {}) if args.cost == "flops" else \
        priced_plan(cfg, args, budget, unstored)
    seconds = time.perf_counter() - start
    row = plan_row(cfg, args, text, budget, unstored, plan, plan, seconds, after={"sweeps": extra})
    if args.measure:
        row.update(measure(cfg, args, policy))
    least, forward = row["least_budget_bytes"], row["forward_flops"]
    lines = [("budget", fmt_bytes(budget), f"{budget:,} bytes"),
             ("predicted peak of the store", fmt_bytes(plan.peak_bytes), f"{plan.peak_bytes:,} bytes"),
             ("recompute", fmt_flops(plan.recompute_flops), f"{plan.recompute_flops / forward:.1%} of the forward"),
             ("least feasible budget", fmt_bytes(least), f"{least:,} bytes"),
             ("memory grid", f"{plan.slot_bytes:,} B/slot", "exact" if plan.exact_grid else
              "sizes rounded up to whole slots: within budget, perhaps not the very cheapest"),
             ("planning time", f"{seconds * 1e3:.1f} ms", "one run, not a benchmark (plan --benchmark)")]
    lines += cost_lines(extra) if extra else []
    if args.measure:
        lines += [measured_line("measured peak of the store", row["measured_peak_bytes"], plan.peak_bytes),
                  measured_line("measured recompute", row["measured_recompute_flops"], plan.recompute_flops, fmt_flops),
                  ("measured peak live bytes", fmt_bytes(row["measured_peak_live_bytes"]), "store + working memory")]
    header = (f"plan for {text}: L={cfg.layers} h={cfg.hidden} H={cfg.heads} KV={cfg.kv_heads} f={cfg.ffn} "
              f"V={cfg.vocab} {cfg.dtype}, batch {args.batch} x {args.seq} tokens")
    if not report(args, row, header, lines, (30, 16)):
        print("\n" + "\n".join(schedule_table(plan)))


def _check_flags(args):
    """Each mode reads only some flags: one given where it would be ignored is an error, not a surprise."""
    if args.chain == "uniform":
        mode, ignored = "--chain uniform (counted in slots, not bytes)", {
            "--budget": args.budget is not None, "--measure": args.measure, "--benchmark": args.benchmark,
            "--op-level": args.op_level != "none", "--offload": args.offload,
            "--host-bandwidth": args.host_bandwidth is not None, "--compute-rate": args.compute_rate is not None}
        ignored.update({"--" + name.replace("_", "-"): getattr(args, name, None) is not None for name in SHAPE_FLAGS})
    elif args.benchmark:
        mode, ignored = "--benchmark (its budgets are set per chain)", {
            "--budget": args.budget is not None, "--measure": args.measure, "--op-level": args.op_level != "none",
            "--length": args.length is not None, "--slots": args.slots is not None, "--offload": args.offload,
            "--host-bandwidth": args.host_bandwidth is not None, "--compute-rate": args.compute_rate is not None}
    else:
        mode, ignored = "--chain model (sized by the shape flags and --budget)", {
            "--length": args.length is not None, "--slots": args.slots is not None}
    if not args.measure:  # only --measure runs a step (and --cost measured times ops): elsewhere they mean nothing
        ignored.update({"--device": args.device != "auto" and args.cost != "measured", "--seed": args.seed != 0})
    given = [flag for flag, present in ignored.items() if present]
    if given:
        raise ValueError(f"{', '.join(given)}: not used by {mode}; leave {'it' if len(given) == 1 else 'them'} out "
                         f"(--length/--slots belong to --chain uniform, --budget/--measure/--op-level and the "
                         f"shape flags to --chain model, --device to --measure or --cost measured, --seed to --measure)")


def run_offload(args):
    """--offload: the three-action plan, each layer's action and why, beside the two-action plan."""
    cfg = config_from_args(args)
    bandwidth = DEFAULT_HOST_BANDWIDTH if args.host_bandwidth is None else args.host_bandwidth
    rate = DEFAULT_COMPUTE_RATE if args.compute_rate is None else args.compute_rate
    for flag, value in (("--host-bandwidth", bandwidth), ("--compute-rate", rate)):
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{flag}={value:g}: give a positive number (bytes/s for the link, FLOP/s for the device), "
                             f"e.g. --host-bandwidth 63e9 --compute-rate 989e12")
    check_rates(bandwidth, rate)
    budget, unstored, text, policy = budget_policy(args, cfg, "+offload")
    prices, priced_by, _ = op_seconds(cfg, args) if args.cost != "flops" else (None, None, None)
    start = time.perf_counter()
    plan = plan_offload(cfg, args.batch, args.seq, budget, unstored, bandwidth, rate,
                        seconds=None if prices is None else tuple(sorted(prices.items())))
    seconds = time.perf_counter() - start
    rows = actions(plan)
    two, reason = plan.two_action_walk, peak_reason(plan)
    result = plan_row(cfg, args, text, budget, unstored, plan, plan.base, seconds, after={
        "budget_bytes": {"host_bandwidth": bandwidth, "compute_rate": rate if prices is None else None,
                         "cost": args.cost, "priced_by": priced_by},
        "peak_bytes": {"host_peak_bytes": plan.walk.host_peak,
                       "copy_bytes": {"to_host": plan.walk.to_host, "to_device": plan.walk.to_device}},
        "planning_seconds": {
            "peak_reason": reason, "modelled_seconds": plan.walk.seconds, "modelled_compute_seconds":
            plan.walk.compute_seconds, "modelled_exposed_copy_seconds": plan.walk.exposed_seconds,
            "two_action": None if two is None else {"peak_bytes": two.device_peak, "modelled_seconds": two.seconds,
                                                    "recompute_flops": two.recompute_flops},
            "layers": [{"layer": k, "action": action, "why": why,
                        "host_bytes": plan.walk.layers[k]["host"]} for k, (action, why) in enumerate(rows)]},
        "sweeps": {"host": [sorted(names) for names in plan.schedule.host or ()]}})
    if args.measure:
        result.update(measure(cfg, args, policy, plan.schedule))
    lines = [("budget", fmt_bytes(budget), f"{budget:,} bytes"),
             ("device peak of the store", fmt_bytes(plan.peak_bytes), f"{plan.peak_bytes:,} bytes"),
             ("host peak", fmt_bytes(plan.walk.host_peak), f"{plan.walk.host_peak:,} bytes"),
             ("copied to the host / back", fmt_bytes(plan.walk.to_host), f"/ {fmt_bytes(plan.walk.to_device)}"),
             ("recompute", fmt_flops(plan.recompute_flops), ""),
             ("modelled step time", f"{plan.walk.seconds * 1e3:.4g} ms",
              f"compute {plan.walk.compute_seconds * 1e3:.4g} ms + exposed copies "
              f"{plan.walk.exposed_seconds * 1e3:.4g} ms"),
             ("two-action plan (keep/recompute)", "-" if two is None else f"{two.seconds * 1e3:.4g} ms",
              "no plan fits" if two is None else f"device peak {fmt_bytes(two.device_peak)}")]
    if args.measure:
        lines += [measured_line("measured device peak", result["measured_peak_bytes"], plan.peak_bytes),
                  measured_line("measured host peak", result["measured_host_peak_bytes"], plan.walk.host_peak)]
    header = (f"plan for {text}: keep, recompute or offload, at {bandwidth / 1e9:.3g} GB/s to the host and "
              + (f"{rate / 1e12:.4g} TFLOP/s" if prices is None else f"compute priced by {priced_by}") +
              f" (times modelled, not measured); L={cfg.layers} h={cfg.hidden} {cfg.dtype}, "
              f"batch {args.batch} x {args.seq} tokens")
    if report(args, result, header, lines, (34, 14)):
        return
    if reason is not None:
        print(f"\nwhy offloading does not lower the peak: {reason}")
    print()
    for k, (action, why) in enumerate(rows):
        print(f"  layer {k:<3}{action:<38}  {why}")  # the longest action: "offload (mlp.gate, mlp.up) + recompute"


def schedule_table(plan):
    """One line per forward pass, in the order they run: which layers keep what."""
    rows = [f"{'first forward':<32}{spans(dict(enumerate(plan.schedule.forward)))}, head {plan.schedule.head}"]
    for target, first, modes in plan.sweeps:
        rows.append(f"{f'before the backward of {target}:':<32}{spans(modes)}")
    rows.append("(all: input and activations, minus the policy's op level; all:selective / all:cheap: "
                "minus that level's drops; input: a checkpoint; none: nothing. Each recompute sweep stops "
                "before its last layer's down projection, whose output is not needed.)")
    return rows


def run_uniform(args):
    if args.length is None or args.slots is None:
        raise ValueError("--chain uniform needs --length L (steps) and --slots S (stored states), "
                         "e.g. --length 10 --slots 3")
    plan = plan_uniform(args.length, args.slots)
    formula, t = binomial_forward_steps(args.length, args.slots)
    if args.json:
        print(json.dumps({"chain": "uniform", "length": plan.length, "slots": plan.slots,
                          "forward_steps": plan.forward_steps, "binomial_formula": formula, "t": t,
                          "actions": plan.lines(), "schedule": list(plan.actions)}, indent=1))
        return
    l, s = args.length, args.slots
    print(f"uniform chain of {l} steps, {s} slot{'s' if s > 1 else ''} (x0 occupies one): "
          f"{plan.forward_steps} forward steps, besides the one recording forward of each step")
    print(f"binomial optimum t*l - C(s+t, t-1) with t = {t} (least t with C(s+t, s) >= l): {formula}")
    for number, line in enumerate(plan.lines(), 1):
        print(f"{number:>5}. {line}")


def run_benchmark(args):
    cfg = config_from_args(args)
    results = benchmark(cfg, args.batch, args.seq, args.seed, repeats=3)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"planning time, 128 layers (h={cfg.hidden}, batch {args.batch} x {args.seq}), budget 1/5 of the "
          f"way from the least to storing everything; median of 3 runs [fastest..slowest]:")
    for name, r in results.items():
        slot = fmt_bytes(r['budget_bytes'] / r['slots'])
        low, high = r["seconds_min_max"]
        print(f"  {name:<30}{r['seconds']:>8.3f} s [{low:.3f}..{high:.3f}]   {r['slots']} slots of {slot}, "
              f"plan peak {fmt_bytes(r['peak_bytes'])}, recompute {fmt_flops(r['recompute_flops'])}")


def benchmark(cfg, batch, seq, seed=0, layers=128, slots=1000, repeats=1):
    """Planning time for `layers` layers on a grid of `slots` slots: picockpt's layers (all alike, so
    equal sub-chains share one answer) and a chain of as many different layers (no sharing); the
    median of `repeats` runs and their spread."""
    chain = model_chain(cfg.replace(layers=layers), batch, seq)
    rng = random.Random(seed)
    different = tuple(Stage(int(s.forward_flops * rng.uniform(0.5, 1.5)), s.input_bytes,
                            tuple((m, int(a * rng.uniform(0.7, 1.3)), r) for m, a, r in s.variants))
                      for s in chain[:-1]) + chain[-1:]
    results = {}
    for name, stages in ((f"{layers} equal layers (picockpt's)", chain), (f"{layers} different layers", different)):
        least, most = least_budget(stages), sum(max(a for _, a, _ in s.variants) for s in stages)
        budget = least + (most - least) // 5
        times = []
        for _ in range(repeats):  # the same plan each time; a shared machine's timing varies
            start = time.perf_counter()
            plan = plan_chain(stages, budget, max_slots=slots)
            times.append(time.perf_counter() - start)
        results[name] = {"seconds": statistics.median(times), "seconds_min_max": [min(times), max(times)],
                         "budget_bytes": budget, "slots": budget // plan.slot_bytes,
                         "peak_bytes": plan.peak_bytes, "recompute_flops": plan.recompute_flops}
    return results
