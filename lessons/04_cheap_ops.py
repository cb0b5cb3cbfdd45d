"""Lesson 04: recomputing the cheap ops (norms, the SwiGLU product), as llm.c does.

Some stored tensors are one elementwise line away from tensors that are stored anyway:

    attn_norm.output = w * (input * rstd)           from the kept input and rstd
    mlp_norm.output  = w * (mlp_norm.input * rstd)  from the kept residual stream and rstd
    mlp.act          = silu(gate) * up              from the kept gate and up projections

llm.c trains GPT-2 with `-r 1` by default (rebuild the GELU output in the backward instead of
storing it) and `-r 2` (also the LayerNorm outputs). picockpt's `cheap` is the same idea for a
Llama layer, on top of `selective`: it drops those tensors and the backward rebuilds each with the
line above. The rebuild has no matmul in it, so the recompute FLOPs that FlopCounterMode counts
(matmuls) do not move from `selective` to `cheap`; what it costs is a few elementwise passes.

This script prints one layer's stored tensors by name under none / selective / cheap (closed
form, checked against what the engine stored), then measures the whole step's peak stored and
live bytes, the recompute FLOPs and the time (interleaved repeats) under none, selective, cheap,
full and full+cheap. What to look at in the figure: the bars that vanish from `selective` to
`cheap` (the norm outputs and the SwiGLU product: 2·B·T·h + B·T·f elements per layer), and how
far the time moves: each time is the median [min..max] of interleaved repeats, and the script
says whether the repeats agree that cheap is slower than selective (at --fast it says nothing:
those steps take milliseconds).

    python lessons/04_cheap_ops.py            # the CPU run (small preset), well under a minute
    python lessons/04_cheap_ops.py --fast     # seconds: what the tests run
    python lessons/04_cheap_ops.py --large --device cuda   # a bigger shape for a GPU
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere, no install

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lessons._lesson import (FAST_TIMING, choose, device_name, interleaved_seconds, large, paired_ratios, parse_args,
                             shape_line, small, timing_verdict)
from picockpt import init_params, loss_and_grads
from picockpt.inventory import layer_inventory, predicted_peak_bytes
from picockpt.measure import make_batch, measured_inventory
from picockpt.plotting import label_bars, mib, policy_color, save_figure
from picockpt.policy import OP_LEVEL
from picockpt.tracker import Tracker

OP_LEVELS = ("none", "selective", "cheap")
POLICIES = ("none", "selective", "cheap", "full", "full+cheap")
GROUPS = {  # how the stored names are coloured: what kind of op made them
    "layer input and residual stream": (("input", "mlp_norm.input"), "#2F4858"),
    "matmul outputs (q, k, v, context, gate, up)": (("attn.q", "attn.k", "attn.v", "attn.context", "mlp.gate",
                                                     "mlp.up"), "#8C8C8C"),
    "attention probabilities (T×T)": (("attn.probs", "attn.probs_mask", "attn.probs_dropped"),
                                      policy_color("selective")),
    "norm outputs": (("attn_norm.output", "mlp_norm.output"), "#DD8452"),
    "SwiGLU product": (("mlp.act",), "#C44E52"),
    "norm statistics (rstd) and dropout masks": (("attn_norm.rstd", "mlp_norm.rstd", "attn.dropout_mask",
                                                  "mlp.dropout_mask"), "#CCB974"),
}


def shape(mode):
    """(Config, batch, seq, timed repeats) of each run mode."""
    return choose(mode, fast=(small(layers=2), 2, 32, 1), cpu=(small(), 4, 128, 7), large=(large(), 4, 1024, 5))


def measure(cfg, batch, seq, policies, device="cpu", seed=0, repeats=5):
    """policy -> {stored, live (peak bytes), recompute_flops, timing (a Spread of seconds)} of one
    forward + backward."""
    params = init_params(cfg, seed=seed, device=device)
    input_ids, targets = make_batch(cfg, batch, seq, device, seed)
    rows = {}
    for policy in policies:
        with Tracker(device) as tracker:
            loss_and_grads(params, cfg, input_ids, targets, policy, tracker=tracker)
        rows[policy] = {"stored": tracker.peak_logical, "live": tracker.peak_physical,
                        "recompute_flops": tracker.flops["recompute"]}
    steps = {p: (lambda p=p: loss_and_grads(params, cfg, input_ids, targets, p)) for p in policies}
    for policy, timing in interleaved_seconds(steps, device, repeats).items():
        rows[policy]["timing"] = timing
    return rows


def main(argv=None):
    args = parse_args(__doc__, argv)
    cfg, batch, seq, repeats = shape(args.mode)
    fast = args.mode == "fast"
    print(f"lesson 04, cheap ops: {shape_line(cfg, batch, seq, args.device)}")

    closed_form = {level: {name: nbytes for name, (_, _, nbytes) in
                           layer_inventory(cfg, batch, seq, OP_LEVEL.get(level, frozenset())).items()}
                   for level in OP_LEVELS}  # name -> bytes of one stored layer
    engine = {level: {name: nbytes for (layer, name), nbytes in
                      measured_inventory(cfg, batch, seq, level, args.device, args.seed).items() if layer == 0}
              for level in OP_LEVELS}  # what the engine put in the store for layer 0
    inventory_matches = closed_form == engine
    print(f"\none layer's stored tensors (bytes; closed form, {'equal to' if inventory_matches else 'DIFFERENT FROM'} "
          f"what the engine stored):")
    print(f"{'name':<20}" + "".join(f"{level:>12}" for level in OP_LEVELS))
    for name in closed_form["none"]:
        print(f"{name:<20}" + "".join(f"{closed_form[level][name]:>12,}" if name in closed_form[level]
                                      else f"{'-':>12}" for level in OP_LEVELS))
    per_layer = {level: sum(closed_form[level].values()) for level in OP_LEVELS}
    print(f"{'total':<20}" + "".join(f"{per_layer[level]:>12,}" for level in OP_LEVELS))
    print(f"cheap keeps {per_layer['cheap'] / per_layer['selective']:.1%} of selective's bytes per layer and "
          f"{per_layer['cheap'] / per_layer['none']:.1%} of none's")

    rows = measure(cfg, batch, seq, POLICIES, args.device, args.seed, repeats)
    predicted = {p: predicted_peak_bytes(cfg, batch, seq, p) for p in POLICIES}
    ratio = {p: paired_ratios(rows[p]["timing"], rows["none"]["timing"]) for p in POLICIES}  # time / none's
    print(f"\n{'policy':<12}{'stored MiB':>11}{'formula':>9}{'live MiB':>10}{'recompute GFLOP':>17}"
          f"{'ms':>22}{'time / none':>22}")
    for p, row in rows.items():
        print(f"{p:<12}{mib(row['stored']):>11.3f}{'equal' if row['stored'] == predicted[p] else 'DIFF':>9}"
              f"{mib(row['live']):>10.3f}{row['recompute_flops'] / 1e9:>17.4f}"
              f"{row['timing'].text('{:.1f}', scale=1e3):>22}{ratio[p].text('{:.3f}'):>22}")
    print(f"(times: median [min..max] of {repeats} interleaved forward + backward steps, time / none taken within "
          f"each repeat; recompute FLOPs: matmuls only, so cheap's elementwise rebuilds add none)")
    cheap_vs_selective = paired_ratios(rows["cheap"]["timing"], rows["selective"]["timing"])
    print(timing_verdict(args.mode, cheap_vs_selective, "cheap against selective, time"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.3]})
    for x, level in enumerate(OP_LEVELS):
        bottom = 0.0
        for group, (members, color) in GROUPS.items():
            size = mib(sum(closed_form[level].get(name, 0) for name in members))
            left.bar(x, size, bottom=bottom, color=color, label=group if x == 0 else None, width=0.6)
            bottom += size
        left.annotate(f"{mib(per_layer[level]):.2f} MiB", (x, bottom), ha="center", va="bottom", fontsize=9)
    left.set_xticks(range(len(OP_LEVELS)), OP_LEVELS)
    left.set_ylabel("MiB stored per layer")
    left.set_title("one layer's stored tensors, by what made them")
    left.set_ylim(0, mib(per_layer["none"]) * 1.5)  # room for the legend above the bars
    left.legend(fontsize=7, loc="upper right")

    width = 0.38
    xs = range(len(POLICIES))
    stored = right.bar([x - width / 2 for x in xs], mib([rows[p]["stored"] for p in POLICIES]), width,
                       color=[policy_color(p) for p in POLICIES], label="peak stored")
    live = right.bar([x + width / 2 for x in xs], mib([rows[p]["live"] for p in POLICIES]), width,
                     color=[policy_color(p) for p in POLICIES], alpha=0.45, label="peak live")
    label_bars(right, stored, [f"{mib(rows[p]['stored']):.1f}" for p in POLICIES])
    label_bars(right, live, ["time: --fast" if fast else f"{ratio[p].median:.2f}× time\n"
                             f"[{ratio[p].low:.2f}..{ratio[p].high:.2f}]" for p in POLICIES], fontsize=7)
    right.set_xticks(list(xs), POLICIES)
    right.set_ylim(0, mib(max(rows[p]["live"] for p in POLICIES)) * 1.22)  # room for the two-line time labels
    right.set_ylabel("MiB over one forward + backward")
    right.set_title("the whole step: peak stored (solid) and live (light),\ntime vs none: median [min..max] of "
                    f"{repeats} interleaved repeats")
    fig.suptitle(f"Cheap ops rebuilt elementwise (llm.c -r 2 style): L={cfg.layers}, h={cfg.hidden}, f={cfg.ffn}, "
                 f"batch {batch} x {seq}, {cfg.dtype}, on {device_name(args.device)}"
                 + (f" ({FAST_TIMING})" if fast else ""))
    fig.tight_layout()
    path = save_figure(fig, "04_cheap_ops")
    print(f"wrote {path}")
    return {"figures": [str(path)],
            "summary": {"MiB/layer none/selective/cheap": "/".join(f"{mib(per_layer[l]):.2f}" for l in OP_LEVELS),
                        "time cheap/selective": FAST_TIMING if fast else cheap_vs_selective.text("{:.3f}"),
                        "stored = formula": all(rows[p]["stored"] == predicted[p] for p in POLICIES),
                        "inventory = engine": inventory_matches}}


if __name__ == "__main__":
    main()
