"""predict's pipeline row: every stage's stored peak under the chosen schedule, and the schedules side by side.

    python -m picockpt predict --model llama3-8b --seq 4096 --pp 4 --microbatches 8 --schedule zb-h1
    python -m picockpt predict --model llama3-8b --seq 4096 --pp 4 --microbatches 8 --schedule interleaved \
        --virtual-stages 2 --recompute full

Each stage's rank is pipeline_parallel/pp_forms.py's closed form, the one the tests hold every rank to: its
micro-batches' stores walked along its order (pp_plan.in_flight_peak), ZB-H1's B leaving what its W reads
(w_pending_bytes per layer) until the W. The bubble twice: with equal F, B, W times (cost.bubble_idle: (P-1)/(M+P-1),
(P-1)/(VM+P-1), (P-1)/(3M+P-1)), and paced by each stage's own matmul FLOPs per action on the clock that runs the
orders (pp_orders.run_orders: F the forward, B the input gradient and the recomputation before it, W the weight
gradients), which is where recomputation, the embedding and the head make the stages unequal.
"""
from dataclasses import replace

from ..planning.cost import bubble_idle
from ..parallel.pipeline_parallel.pp_forms import rank_forms
from ..parallel.pipeline_parallel.pp_orders import run_orders
from ..parallel.pipeline_parallel.pp_schedules import SCHEDULES, actions, check_interleaving, check_schedule
from .predict_zero import gib

POLICIES = ("none", "selective", "full")


def add_pipeline_arguments(parser):
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                        help="with --pp: the pipeline order (default 1f1b; interleaved takes --virtual-stages, "
                             "zb-h1 splits each backward into B and W)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="--schedule interleaved: chunks of layers per rank (default 1)")


def check_schedule_flags(args, cfg):
    """--schedule and --virtual-stages: a pipeline alone (beside --tp/--sp), each refusal naming its flag."""
    if args.schedule != "1f1b" or args.virtual_stages != 1:
        if args.pp == 1:
            raise ValueError(f"--schedule {args.schedule} without --pp: it orders a pipeline's micro-batches; add "
                             f"--pp P >= 2 (and --microbatches M)")
        if args.cp > 1 or args.zero is not None:
            raise ValueError(f"--schedule {args.schedule} beside --cp or --zero: predict prices schedules other than "
                             f"1f1b for a pipeline alone (with --tp/--sp); leave out --cp/--zero, or the schedule")
    check_schedule(args.schedule, args.virtual_stages)
    if args.schedule == "interleaved":
        check_interleaving(args.pp, args.microbatches or args.pp, args.virtual_stages, cfg.layers)
    if args.schedule == "zb-h1" and cfg.experts:
        raise ValueError("--schedule zb-h1 with --experts: a mixture of experts' weight gradients are not split "
                         "from its input gradient; use a dense model, or --schedule 1f1b")


def paced_bubble(forms, schedule, pp, M, V):
    """Each stage's idle share on the clock, every action as long as its matmul FLOPs (its chunk's)."""
    flops = [[chunk.action_flops() for chunk in rank.chunks] for rank in forms]
    orders = [actions(schedule, pp, M, s, V) for s in range(pp)]
    return run_orders(orders, pp, V, seconds=lambda s, a: flops[s][a.chunk][a.kind])["idle"]


def pipeline_row(cfg, batch, seq, policy, layout):
    """Every stage's rank of the layout's P-stage pipeline over M micro-batches of batch / M sequences: stored peak
    (bytes), micro-batches in flight, what its waiting W's hold (ZB-H1); the bubble; and every schedule's busiest
    stage under none, selective and full, side by side (interleaved at its virtual stages, or 2 where it fits)."""
    pp, M, schedule, virtual = layout.pp, layout.microbatches, layout.schedule, layout.virtual_stages
    forms = [rank_forms(cfg, batch, seq, policy, layout, s) for s in range(pp)]
    stages = [{"stage": s, "chunk_layers": [[c.layers[0], c.layers[-1]] for c in f.chunks],
               "in_flight": f.in_flight, "peak_bytes": f.peak_bytes,
               "w_pending_bytes": getattr(f, "w_layer_bytes", 0) * len(f.layers)} for s, f in enumerate(forms)]
    V2 = virtual if virtual > 1 else 2
    rivals = [("afab", 1), ("1f1b", 1)] + [("interleaved", V2)] * (M % pp == 0 and pp * V2 <= cfg.layers) + \
        [("zb-h1", 1)] * (not cfg.experts)  # a mixture of experts' W is not split from its B
    compare = []
    for name, V in rivals:
        rival = replace(layout, schedule=name, virtual_stages=V)
        peaks = {p: max(rank_forms(cfg, batch, seq, p, rival, s).peak_bytes for s in range(pp)) for p in POLICIES}
        paced = paced_bubble([rank_forms(cfg, batch, seq, policy, rival, s) for s in range(pp)], name, pp, M, V)
        compare.append({"schedule": name, "virtual_stages": V, "busiest_peak_bytes": peaks,
                        "bubble_equal": bubble_idle(pp, M, name, V), "bubble_paced": max(paced)})
    return {"pp": pp, "microbatches": M, "schedule": schedule, "virtual_stages": virtual, "policy": policy,
            "stages": stages, "bubble_equal": bubble_idle(pp, M, schedule, virtual),
            "bubble_paced": paced_bubble(forms, schedule, pp, M, virtual), "compare": compare}


def print_pipeline(row):
    p = row["pipeline"]
    chunks = f", V = {p['virtual_stages']} chunks a rank" if p["virtual_stages"] > 1 else ""
    print(f"pipeline of {p['pp']} stages, {p['microbatches']} micro-batches, {p['schedule']}{chunks}, policy "
          f"{p['policy']}, per stage's rank (parallel/pipeline_parallel/pp_forms.py: the activation store only):")
    for s, paced in zip(p["stages"], p["bubble_paced"]):
        layers = ", ".join(f"{a}..{b}" for a, b in s["chunk_layers"])
        waiting = f", of which its waiting W's up to {gib(s['w_pending_bytes'])} each" if s["w_pending_bytes"] else ""
        print(f"  stage {s['stage']} (layers {layers}): {gib(s['peak_bytes'])} stored, {s['in_flight']} in flight"
              f"{waiting}; idle {paced:.1%} paced by FLOPs")
    print(f"  bubble with equal F, B, W times: {p['bubble_equal']:.1%}")
    print("  schedules side by side (the busiest stage's stored peak; bubble equal / FLOP-paced, the worst stage):")
    for c in p["compare"]:
        name = c["schedule"] + (f" V={c['virtual_stages']}" if c["virtual_stages"] > 1 else "")
        peaks = ", ".join(f"{policy} {gib(n)}" for policy, n in c["busiest_peak_bytes"].items())
        print(f"    {name:<15} {peaks}; bubble {c['bubble_equal']:.1%} / {c['bubble_paced']:.1%}")
