# %% [markdown]
# # Lesson 28: profiling the backward to place checkpoints
#
# The budget planner of lesson 12 chooses, for a memory budget, which layers to store whole, which to keep
# only the input of, and which tensors to drop and rebuild, so that the recomputation costs the least. Its
# price is FLOPs: matmul FLOPs, as `FlopCounterMode` counts them. That price is exact and the same on every
# machine, and it is blind in one place: a rebuild with no matmul in it (a norm's output, SwiGLU's product:
# the `cheap` op level of lesson 07) costs 0 FLOPs, yet it reads its inputs and writes its output, and an
# elementwise op's time is its bytes over the memory bandwidth (lesson 26).
#
# The planner's recurrence (rotor's dynamic programme, `picockpt/planning/planner.py`) only adds and compares costs,
# so it minimises seconds as readily as FLOPs: `picockpt/planning/cost.py`'s `price_chain` puts a price in seconds on
# every stage of the chain, and `plan_priced` runs the same recurrence on them. This lesson prices the same
# chain three ways and compares the plans:
#
# | price | what an op costs | where it comes from |
# |---|---|---|
# | **FLOPs** | its matmul FLOPs (an elementwise op: 0) | `planner.plan_chain` |
# | **roofline** | each kernel's FLOPs over the matmul rate or its bytes over the memory bandwidth, whichever is longer (Williams, Waterman and Patterson 2009, "Roofline: an insightful visual performance model for multicore architectures") | `cost.roofline_op_seconds` on this machine's rates, measured (`cost.measured_rates`: the best 1024³ matmul and 64 MiB copy) |
# | **measured** | each op of one layer's forward (and the head's) timed alone on tensors of the step's shapes: the median of interleaved rounds | `op_times.measure_op_seconds` |
#
# torch.compile makes the same choice inside a compiled graph: under a memory budget
# (`torch._functorch.config.activation_memory_budget`) its min-cut partitioner solves a knapsack for what to
# recompute, priced by `activation_memory_budget_runtime_estimator`, which is `"flops"` by default (each
# operator's `FlopCounterMode` count, at least 1, so an elementwise op is all but free) or `"profile"`, which
# benchmarks each operator on the GPU (PyTorch's `torch/_functorch/config.py`, and `estimate_runtime` in
# `torch/_functorch/partitioners.py`).
#
# What a backward recomputes is forward ops run again (a layer from its checkpoint, a dropped tensor from what
# is kept), so a profile of the forward's ops prices the backward's recomputation. The lesson profiles one
# layer's ops, sweeps budgets from the least feasible to storing everything with the
# three prices, then takes the budget where the measured price is modelled to save the most recompute time
# over the FLOP plan, and runs both plans' whole training steps, interleaved, to see whether the saving shows.
#
# **The shape** is chosen where a FLOP price is blindest, so that the two plans can differ by more than a
# shared machine's noise: a narrow residual stream and a wide SwiGLU (h = 32, f = 1024, one head of 32; Llama's
# f is about 3.5 h) with fused attention, which never stores the probabilities (lesson 13). There the
# elementwise rebuilds `cheap` adds (both norm outputs, SwiGLU's product over f = 1024 columns) are a large
# part of a layer's time and 0 of its FLOPs. At the `small` preset's shape (h = 128, f = 448) the matmuls
# outweigh the elementwise ops, and the two prices disagree about less (the exercises price that shape).
# The command line does the same for one budget: `python -m picockpt plan --budget 20MiB --cost measured`,
# or `--cost roofline --hardware h100`.
#
# **Run it** as a script, `python lessons/28_profiling_to_place_checkpoints.py` (the CPU run, well under a
# minute; `--fast` for seconds, `--large --device cuda` for a bigger shape on a GPU), or step through this
# notebook, where the same flags come from the environment variable `PICOCKPT_LESSON_ARGS` (unset: the CPU
# run).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from _check import check
from _lesson import (FAST_TIMING, choose, clock_words, compute_clock, device_name, interleaved_seconds, large,
                     lesson_args, paired_ratios, shape_line, small, timed_claim, wrote)
from picockpt import Config, init_params, loss_and_grads
from picockpt.planning.cost import (FORWARD_EXCLUDES, HARDWARE, head_ops, layer_ops, measured_rates, plan_priced,
                           price_chain, rebuild_seconds, roofline_op_seconds)
from picockpt.recompute.engine import Model, Step
from picockpt.planning.step_forms import step_flops
from picockpt.measurement.measure import make_batch
from picockpt.planning.op_times import measure_op_seconds
from picockpt.planning.planner import least_budget, model_chain, plan_chain, replay
from picockpt.teaching.plotting import mib, save_figure
from picockpt.measurement.tracker import Tracker

PRICES = ("FLOPs", "roofline", "measured")  # what each plan minimised
LABEL = {"FLOPs": "FLOP", "roofline": "roofline", "measured": "measured"}  # "the FLOP plan"
COLORS = {"FLOPs": "#4C72B0", "roofline": "#DD8452", "measured": "#C44E52"}
STEPS_PER_SAMPLE = 2  # steps in one timed sample: a moment another program takes weighs half as much
NARROW = dict(attention="fused", hidden=32, heads=1, kv_heads=1, ffn=1024)  # elementwise rebuilds a large share
REBUILDS = {"all": "nothing dropped", "all:selective": "the attention probabilities",
            "all:cheap": "both norm outputs and the SwiGLU product (and the probabilities where attention keeps them)"}

# %% [markdown]
# ## One layer's ops: FLOPs, bytes, roofline, measured
#
# The ops are `cost.layer_ops`' list, kernel by kernel as `picockpt/model/layer.py` runs them; `probs` is not a
# forward op but what rebuilding dropped attention probabilities runs (the scores and their softmax), and
# `final_norm`, `logits`, `loss` are the head's. The shares compare each forward op with the whole layer's
# forward: of its FLOPs, of its roofline time and of its measured time (every op timed alone, so the sum is
# not exactly one layer's forward as the step runs it, but each op's part of it).

# %%
def shape(mode):
    """(Config, batch, seq, profile rounds, budgets swept, timed step repeats) of each run mode."""
    return choose(mode, fast=(small(layers=4, **NARROW), 2, 32, 1, 40, 1), cpu=(small(**NARROW), 8, 256, 9, 40, 9),
                  large=(large(attention="fused", hidden=256, heads=2, kv_heads=2, ffn=8192), 4, 1024, 9, 40, 5))


def forward_ops(cfg, batch, seq):
    """The ops of one layer's forward (not the rebuild-only `probs`), in order."""
    return [op for op in layer_ops(cfg, batch, seq) if op.name not in FORWARD_EXCLUDES]


def shares(values, names):
    """{name: value / the sum over `names`}."""
    whole = sum(values[name] for name in names)
    return {name: values[name] / whole for name in names}


# %%
args = lesson_args()
cfg, batch, seq, rounds, n_budgets, repeats = shape(args.mode)
device, fast = args.device, args.mode == "fast"
print(f"lesson 28, profiling to place checkpoints: {shape_line(cfg, batch, seq, device)}")
hw = measured_rates(device, cfg.dtype)
print(f"roofline rates ({hw.source}): matmul {hw.matmul / 1e9:,.1f} GFLOP/s, memory {hw.memory / 1e9:,.1f} GB/s, "
      f"ridge point {hw.matmul / hw.memory:.1f} FLOPs per byte (an op of fewer FLOPs per byte moved waits on memory)")
roofline = roofline_op_seconds(cfg, batch, seq, hw)
profile = measure_op_seconds(cfg, batch, seq, device, rounds)
measured = profile.seconds
ops = {op.name: op for op in layer_ops(cfg, batch, seq) + head_ops(cfg, batch, seq)}
layer_names = [op.name for op in forward_ops(cfg, batch, seq)]
share = {"FLOPs": shares({n: ops[n].flops for n in layer_names}, layer_names),
         "roofline": shares(roofline, layer_names), "measured": shares(measured, layer_names)}
print(f"\neach op, measured alone: median [min..max] of {profile.repeats} interleaved rounds; shares of one layer's "
      f"forward")
print(f"{'op':<14}{'MFLOP':>9}{'MB moved':>10}{'FLOP/B':>8}{'roofline us':>13}{'measured us':>28}"
      f"{'FLOPs':>8}{'roofline':>10}{'measured':>10}")
for name, op in ops.items():
    low, high = profile.spread[name]
    row = (f"{name:<14}{op.flops / 1e6:>9.1f}{op.bytes / 1e6:>10.2f}{op.flops / op.bytes:>8.1f}"
           f"{roofline[name] * 1e6:>13.1f}{f'{measured[name] * 1e6:.1f} [{low * 1e6:.1f}..{high * 1e6:.1f}]':>28}")
    print(row + ("".join(f"{share[p][name]:>{w}.1%}" for p, w in zip(PRICES, (8, 10, 10))) if name in layer_names
                 else f"{'(a rebuild)' if name == 'probs' else '(the head)':>28}"))
elementwise = [n for n in layer_names if ops[n].flops == 0]
print(f"the elementwise ops ({', '.join(elementwise)}): 0 FLOPs, "
      f"{sum(ops[n].bytes for n in elementwise) / sum(ops[n].bytes for n in layer_names):.0%} of the layer's bytes, "
      f"{sum(share['roofline'][n] for n in elementwise):.1%} of its roofline time and "
      f"{sum(share['measured'][n] for n in elementwise):.1%} of its measured time"
      + (f" ({FAST_TIMING})" if fast else ""))

# %% [markdown]
# What the chain's variants cost to rebuild, by each price: a layer stored whole keeps everything (`all`),
# or drops what its backward can rebuild. `all:cheap` rebuilds its norm outputs and SwiGLU's product with no
# matmul, so to the FLOP price it costs what `all:selective` costs (one $q k^\top$ for the probabilities, under
# eager attention) or, under fused attention, where nothing is left for `selective` to drop, nothing at all:
# to that price it is never dearer and always smaller. The two prices in seconds add what the norms and
# SwiGLU's product cost to rebuild.

# %%
chain = model_chain(cfg, batch, seq)
priced = {"roofline": price_chain(chain, cfg, batch, seq, roofline),
          "measured": price_chain(chain, cfg, batch, seq, measured)}
print(f"{'variant':<15}{'stored MiB':>11}{'rebuild MFLOP':>15}{'roofline us':>13}{'measured us':>13}  rebuilds")
for (mode, nbytes, flops), (_, _, roof_s), (_, _, meas_s) in zip(chain[0].variants, priced["roofline"][0].variants,
                                                                 priced["measured"][0].variants):
    print(f"{mode:<15}{mib(nbytes):>11.3f}{flops / 1e6:>15.1f}{roof_s * 1e6:>13.1f}{meas_s * 1e6:>13.1f}  "
          f"{REBUILDS.get(mode, mode)}")
cheap_extra = rebuild_seconds(measured, {"attn_norm.output", "mlp_norm.output", "mlp.act"})
print(f"what cheap adds to a layer's rebuilds (the norm outputs, SwiGLU's product): 0 FLOPs, "
      f"{cheap_extra * 1e6:.1f} us measured ({cheap_extra / priced['measured'][0].forward_flops:.1%} of the layer's "
      f"measured forward)")

# %% [markdown]
# ## The figure: where a layer's time goes, against where its FLOPs are
#
# Each op's share of the layer's FLOPs beside its share of roofline and of measured time. The elementwise ops
# have no FLOP bar at all.

# %%
fig, ax = plt.subplots(figsize=(11, 4.8))
width, xs = 0.27, np.arange(len(layer_names))
for i, price in enumerate(PRICES):
    ax.bar(xs + (i - 1) * width, [100 * share[price][n] for n in layer_names], width, color=COLORS[price],
           label={"FLOPs": "share of the layer's FLOPs", "roofline": f"share of its roofline time ({hw.name})",
                  "measured": f"share of its measured time ({profile.repeats} rounds, median)"}[price])
ax.set_xticks(xs, layer_names, rotation=30, ha="right")
ax.set_ylabel("% of one layer's forward")
ax.legend(fontsize=8)
ax.grid(axis="y", alpha=0.3)
ax.set_title(f"One layer's ops: FLOPs against time. {shape_line(cfg, batch, seq, device)}"
             + (f"\n({FAST_TIMING})" if fast else ""), fontsize=9)
fig.tight_layout()
path = save_figure(fig, "28_profiling_to_place_checkpoints")
wrote(path)

# %% [markdown]
# ## A sweep of budgets: where the three prices place checkpoints differently
#
# Budgets from the least any schedule fits in (`least_budget`) to storing every layer whole, spaced evenly on
# a log scale (the decisions crowd where memory is tight). At each, three plans of the same budget: the FLOP
# plan (`plan_chain`), and the plans priced by the roofline and by the measured profile (`plan_priced`). Each
# is then replayed under the measured prices (`replay(priced["measured"], plan.schedule)`): the recompute time
# the measured model predicts for it. The FLOP plan has the
# fewest recompute FLOPs at every budget and the measured plan the least modelled seconds: each is optimal
# for its own price, which the lesson checks.

# %%
def budgets(chain, n):
    """n budgets (bytes), log-spaced from least_budget(chain) to storing every stage whole."""
    everything = sum(max(a for _, a, _ in stage.variants) for stage in chain)  # no schedule needs more
    return sorted({int(b) for b in np.geomspace(least_budget(chain), everything, n)})


def sweep(chain, priced, budget_list):
    """One row a budget: {budget, plans: {price: Plan}, seconds: {price: modelled recompute seconds under the
    measured prices}}. priced: {"roofline": chain, "measured": chain} (cost.price_chain)."""
    rows = []
    for budget in budget_list:
        plans = {"FLOPs": plan_chain(chain, budget),
                 **{price: plan_priced(chain, priced[price], budget) for price in ("roofline", "measured")}}
        seconds = {price: replay(priced["measured"], plan.schedule)[1] for price, plan in plans.items()}
        rows.append({"budget": budget, "plans": plans, "seconds": seconds})
    return rows


def differ(row, a, b):
    return row["plans"][a].schedule != row["plans"][b].schedule


def saving(row):
    """What the measured plan is modelled to save over the FLOP plan (seconds, at the measured prices)."""
    return row["seconds"]["FLOPs"] - row["seconds"]["measured"]


def pick(rows):
    """The row of the largest modelled saving (the first of equal ones); None where no plan of the measured
    prices saves anything over the FLOP plan (beyond a float sum's rounding)."""
    best = max(rows, key=saving)
    return best if differ(best, "FLOPs", "measured") and saving(best) > 1e-9 * best["seconds"]["FLOPs"] else None


def optimal(rows):
    """Each plan fits its budget, the FLOP plan has the fewest recompute FLOPs and the measured plan the least
    modelled seconds (a relative 1e-9 for float sums), at every row."""
    return all(max(p.peak_bytes for p in row["plans"].values()) <= row["budget"]
               and row["plans"]["FLOPs"].recompute_flops == min(p.recompute_flops for p in row["plans"].values())
               and row["seconds"]["measured"] <= min(row["seconds"].values()) * (1 + 1e-9) for row in rows)


# %%
rows = sweep(chain, priced, budgets(chain, n_budgets))
assert optimal(rows), "a plan is over its budget or not optimal for its own price"
differs = {pair: sum(differ(row, *pair) for row in rows)
           for pair in (("FLOPs", "measured"), ("FLOPs", "roofline"), ("roofline", "measured"))}
print(f"{len(rows)} budgets: each plan's recompute in GFLOP (exact), and in ms as the measured prices model it")
print(f"{'':>10}{'recompute GFLOP':^42}{'modelled recompute ms':^42}")
print(f"{'budget MiB':>10}" + "".join(f"{LABEL[p]:>14}" for p in PRICES) * 2 + "  differs")
for row in rows:
    plans, ms = row["plans"], row["seconds"]
    marks = [f"{a[0]}{b[0]}".upper() for a, b in differs if differ(row, a, b)]
    print(f"{mib(row['budget']):>10.2f}" + "".join(f"{plans[p].recompute_flops / 1e9:>14.3f}" for p in PRICES)
          + "".join(f"{ms[p] * 1e3:>14.3f}" for p in PRICES) + "  " + " ".join(marks))
print("differs: FM the FLOP and measured plans, FR the FLOP and roofline plans, RM the roofline and measured plans")
print("; ".join(f"the {LABEL[a]} and {LABEL[b]} plans differ at {n} of {len(rows)} budgets"
                for (a, b), n in differs.items()))
print(f"every plan fits its budget, the FLOP plan has the fewest recompute FLOPs and the measured plan the least "
      f"modelled time at every budget: {optimal(rows)}; the grid is exact (to the byte) at every budget: "
      f"{all(p.exact_grid for row in rows for p in row['plans'].values())}")
chosen = pick(rows)
if chosen is None:
    print("the measured prices choose the FLOP plan's schedule at every budget of this shape: nothing to compare")
else:
    flop_plan, time_plan = chosen["plans"]["FLOPs"], chosen["plans"]["measured"]
    print(f"the largest modelled saving: at {mib(chosen['budget']):.2f} MiB the measured plan recomputes "
          f"{time_plan.recompute_flops / 1e9:.3f} GFLOP against the FLOP plan's {flop_plan.recompute_flops / 1e9:.3f}, "
          f"and is modelled at {chosen['seconds']['measured'] * 1e3:.2f} ms of recomputation against "
          f"{chosen['seconds']['FLOPs'] * 1e3:.2f} ms ({-saving(chosen) / chosen['seconds']['FLOPs']:+.1%})")
    for name, plan in (("FLOP plan", flop_plan), ("measured plan", time_plan)):
        print(f"  {name:<14} first forward {[str(m) for m in plan.schedule.forward]}, head {plan.schedule.head}")

# %% [markdown]
# The figure: the recompute time of each plan as the measured prices model it (top), then, budget by budget,
# how much longer the FLOP plan and the roofline plan are modelled to take than the measured plan (middle),
# and how many more FLOPs the measured plan recomputes than each of them (bottom). Where a lower curve leaves
# 0 the plans differ, and each is optimal for its own price: the measured plan recomputes at least the FLOP
# plan's FLOPs in at most its modelled time.

# %%
fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True,
                                          gridspec_kw={"height_ratios": [1.4, 1, 1]})
x = mib([row["budget"] for row in rows])
for price in PRICES:
    top.plot(x, [row["seconds"][price] * 1e3 for row in rows], "o-" if price == "measured" else "s--", ms=3.5,
             color=COLORS[price], label=f"the {LABEL[price]} plan", alpha=0.85)
for price in ("FLOPs", "roofline"):
    middle.plot(x, [(row["seconds"][price] - row["seconds"]["measured"]) * 1e3 for row in rows], "o-", ms=3.5,
                color=COLORS[price], label=f"the {LABEL[price]} plan's modelled recompute less the measured plan's")
    bottom.plot(x, [(row["plans"]["measured"].recompute_flops - row["plans"][price].recompute_flops) / 1e9
                    for row in rows], "o-", ms=3.5, color=COLORS[price],
                label=f"the measured plan's recompute less the {LABEL[price]} plan's")
if chosen is not None:
    for ax in (top, middle, bottom):
        ax.axvline(mib(chosen["budget"]), color="0.5", lw=0.8, ls=":")
    middle.annotate("timed below", (mib(chosen["budget"]), saving(chosen) * 1e3), xytext=(8, -4),
                    textcoords="offset points", fontsize=8, va="top")
top.set_xscale("log")
top.set_yscale("log")
top.set_ylabel("modelled recompute, ms\n(measured prices)")
middle.set_ylabel("modelled ms more\nthan the measured plan")
bottom.set_ylabel("GFLOP the measured\nplan recomputes more")
bottom.set_xlabel("activation budget, MiB (log scale)")
for ax in (top, middle, bottom):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
for ax in (middle, bottom):
    ax.axhline(0, color="0.3", lw=0.6)
top.set_title(f"Three prices, {len(rows)} budgets: the FLOP and measured plans differ at "
              f"{differs[('FLOPs', 'measured')]}, the FLOP and roofline plans at {differs[('FLOPs', 'roofline')]}\n"
              f"{shape_line(cfg, batch, seq, device)}" + (f" ({FAST_TIMING})" if fast else ""), fontsize=9)
fig.tight_layout()
sweep_path = save_figure(fig, "28_budget_sweep")
wrote(sweep_path)

# %% [markdown]
# ## The two plans' whole steps, timed
#
# At the budget of the largest modelled saving, both plans run a whole training step (forward and backward)
# through the engine (`Step`, under each plan's schedule), first once each under a tracker, to check what
# must hold whatever the timing says: the loss and every gradient bitwise equal to those of policy `none`
# (recomputation replays the same kernels on the same inputs), the stored peak equal to the planner's
# prediction and within the budget, the recompute FLOPs equal to the plan's. Then both are timed in
# interleaved repeats, each sample two steps long (on the CPU with one thread, this thread's CPU time:
# `compute_clock`), and the ratio measured plan / FLOP plan is taken within each repeat. If the repeats
# straddle 1 the lesson says the timing was inconclusive on this machine, and draws nothing from it.
#
# By FLOPs the measured plan does at least the FLOP plan's work, more wherever it recomputes more (the FLOP
# plan has the fewest recompute FLOPs), so a FLOP count predicts it no faster. The claim that it runs faster (a ratio
# below 1) therefore has no exact work figure on its side; it stands only where every repeat agrees.

# %%
def run_schedule(params, cfg, input_ids, targets, schedule, tracker=None):
    """(loss, grads) of one step under a planner Schedule, as loss_and_grads runs a policy's."""
    with torch.no_grad():
        step = Step(Model(params, cfg, input_ids, targets), schedule, frozenset(), tracker, False)
        loss = step.forward()
        return loss, step.backward()


def bitwise(result, reference):
    """The same loss and the same gradients, bit for bit."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    return torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys() and \
        all(torch.equal(grads[name], ref_grads[name]) for name in grads)


# %%
params = init_params(cfg, seed=args.seed, device=device)
input_ids, targets = make_batch(cfg, batch, seq, device, args.seed)
claim, facts = None, {}
if chosen is not None:
    reference = loss_and_grads(params, cfg, input_ids, targets, "none")
    plans = {"FLOP plan": flop_plan, "measured plan": time_plan}
    for name, plan in plans.items():
        with Tracker(device) as tracker:
            result = run_schedule(params, cfg, input_ids, targets, plan.schedule, tracker)
        facts[name] = {"bitwise": bitwise(result, reference), "stored": tracker.peak_logical,
                       "flops": tracker.flops["recompute"]}
        print(f"{name:<14} loss and gradients bitwise equal to none's: {facts[name]['bitwise']}; stored peak "
              f"{tracker.peak_logical:,} bytes (planned {plan.peak_bytes:,}, budget {chosen['budget']:,}); "
              f"recompute {tracker.flops['recompute'] / 1e9:.3f} GFLOP (planned {plan.recompute_flops / 1e9:.3f})")
    assert all(f["bitwise"] for f in facts.values()), "a plan changed the numbers"
    assert all(facts[n]["stored"] == p.peak_bytes <= chosen["budget"] for n, p in plans.items())
    assert all(facts[n]["flops"] == p.recompute_flops for n, p in plans.items())
    steps = {name: (lambda plan=plan: [run_schedule(params, cfg, input_ids, targets, plan.schedule)
                                       for _ in range(STEPS_PER_SAMPLE)]) for name, plan in plans.items()}
    clock = compute_clock(device)
    timing = interleaved_seconds(steps, device, repeats, clock=clock)
    ratio = paired_ratios(timing["measured plan"], timing["FLOP plan"])
    none_flops = sum(step_flops(cfg, batch, seq, "none").values())
    work = (none_flops + time_plan.recompute_flops) / (none_flops + flop_plan.recompute_flops)
    for name in plans:
        print(f"{name:<14} {STEPS_PER_SAMPLE} steps {timing[name].text('{:.1f}', scale=1e3)} ms")
    print(f"(median [min..max] of {repeats} interleaved samples of {STEPS_PER_SAMPLE} steps each, "
          f"{clock_words(clock)}, on {device_name(device)}); by FLOPs the measured plan's step is {work:.4f} of the "
          f"FLOP plan's, by the measured prices its recompute "
          f"{chosen['seconds']['measured'] / chosen['seconds']['FLOPs']:.3f} of it, {saving(chosen) * 1e3:.2f} ms "
          f"less: "
          f"{saving(chosen) * STEPS_PER_SAMPLE / timing['FLOP plan'].median:.1%} of the FLOP plan's step (modelled)"
          + (f" ({FAST_TIMING})" if fast else ""))
    claim = timed_claim(args.mode, ratio, "measured plan / FLOP plan, step time", "<1", work=None)
    print(claim.text)
    if claim.conclusive:
        extra = time_plan.recompute_flops - flop_plan.recompute_flops
        modelled = saving(chosen) * STEPS_PER_SAMPLE / timing["FLOP plan"].median  # the saving, a share of a step
        print(f"the plan priced by measured op times ran faster in every repeat ({ratio.median:.3f} of the FLOP "
              f"plan's step, median) while recomputing "
              + (f"{extra / 1e9:.3f} GFLOP more" if extra else "the same FLOPs")
              + ": at this budget the FLOP price placed the checkpoints where the time is not least")
        if ratio.low > 1 - modelled:
            print(f"  every repeat saved less than the {modelled:.1%} of a step the op profile modelled (at most "
                  f"{1 - ratio.low:.1%}): its prices, each op timed alone, overstate the difference between these "
                  f"plans")
        elif ratio.high < 1 - modelled:
            print(f"  every repeat saved more than the {modelled:.1%} of a step the op profile modelled (at least "
                  f"{1 - ratio.high:.1%}): its prices understate the difference between these plans")

# %% [markdown]
# ## Exercises
#
# All three on the `small` model with eager attention at batch 4 × 256 tokens, fp32, priced on
# `HARDWARE["h100"]`: the H100 SXM's datasheet rates (989.5 TFLOP/s dense bf16, 3.35 TB/s of HBM3), a
# fixed roofline the same on every machine. A yardstick, not an H100 running this step: the bytes are fp32
# and the rate is bf16's. An H100 runs fp32 matmuls at 67 TFLOP/s (its datasheet's FP32; PyTorch's default
# matmul precision, "highest", uses no TF32), where the ridge point is about 20 FLOPs a byte, not 295.
#
# **1.** The ridge point of a roofline is the matmul rate over the memory bandwidth: an op of fewer FLOPs
# per byte moved waits on memory. How many FLOPs per byte does `gate_up` (both MLP input projections) do at
# this shape? Is it priced by its FLOPs or by its bytes on the H100? (Compare with the ridge point this
# machine's rates gave above.)

# %%
answer = 45.4  # FLOPs per byte moved

# %%
exercise = Config.from_preset("small", attention="eager")
h100 = HARDWARE["h100"]
exercise_ops = {op.name: op for op in layer_ops(exercise, 4, 256)}
gate_up, ridge = exercise_ops["gate_up"], h100.matmul / h100.memory
below = [name for name, op in exercise_ops.items() if op.flops / op.bytes < ridge]
check("FLOPs per byte of gate_up (small, eager, 4 x 256, fp32)", answer, gate_up.flops / gate_up.bytes,
      why=f"{gate_up.flops:,} FLOPs over {gate_up.bytes:,} bytes (read x and both weights, write both outputs); the "
          f"H100's ridge point is {ridge:.0f} FLOPs per byte, so there it is priced by its bytes, as "
          f"{len(below)} of layer_ops' {len(exercise_ops)} (probs included) are (h = {exercise.hidden} is narrow); "
          f"this "
          f"machine's ridge point is {hw.matmul / hw.memory:.1f}, where gate_up is priced by its "
          f"{'FLOPs' if gate_up.flops / gate_up.bytes > hw.matmul / hw.memory else 'bytes'}")

# %% [markdown]
# **2.** Price the layer with `roofline_op_seconds(exercise, 4, 256, HARDWARE["h100"])` instead of this
# machine's rates. What share of one layer's forward time is `attention` then (its FLOP share is 22.9%, as the
# check prints)? Which
# ops' shares grow from this machine's roofline to the H100's, and why?

# %%
answer = 0.594  # attention's share of the layer's forward, roofline on h100

# %%
exercise_names = [op.name for op in forward_ops(exercise, 4, 256)]
h100_seconds = roofline_op_seconds(exercise, 4, 256, h100)
h100_share = shares(h100_seconds, exercise_names)
here_share = shares(roofline_op_seconds(exercise, 4, 256, hw), exercise_names)  # this machine's rates
grew = [name for name in exercise_names if h100_share[name] > here_share[name]]
check("attention's share of a layer's roofline time on h100 (small, eager, 4 x 256)", answer, h100_share["attention"],
      why=f"attention's FLOP share "
          f"{exercise_ops['attention'].flops / sum(exercise_ops[n].flops for n in exercise_names):.1%}; eager attention "
          f"moves the T x T scores through memory several times "
          f"({exercise_ops['attention'].bytes / 1e6:.1f} MB) for "
          f"{exercise_ops['attention'].flops / exercise_ops['attention'].bytes:.1f} FLOPs a byte; the H100's "
          f"matmul rate is {h100.matmul / h100.memory:.0f} times its bandwidth against this machine's "
          f"{hw.matmul / hw.memory:.1f}: there bytes set the price of more of the layer, and from this machine's "
          f"roofline to the H100's the shares of {', '.join(grew)} grow, those of "
          f"{', '.join(n for n in exercise_names if n not in grew)} shrink: gate_up {here_share['gate_up']:.1%} here, "
          f"{h100_share['gate_up']:.1%} there; swiglu {here_share['swiglu']:.1%} here, "
          f"{h100_share['swiglu']:.1%} there")

# %% [markdown]
# **3.** Plan with those H100 roofline prices over the lesson's 40 log-spaced budgets of that shape
# (`budgets(chain, 40)`, `plan_priced` against `plan_chain`). At how many of them does the H100 plan place
# its checkpoints differently from the FLOP plan?

# %%
answer = 27  # budgets of 40

# %%
exercise_chain = model_chain(exercise, 4, 256)
h100_chain = price_chain(exercise_chain, exercise, 4, 256, h100_seconds)
h100_differs = sum(plan_priced(exercise_chain, h100_chain, b).schedule != plan_chain(exercise_chain, b).schedule
                   for b in budgets(exercise_chain, 40))
check("budgets of 40 where the h100 roofline plan differs from the FLOP plan (small, eager, 4 x 256)", answer,
      h100_differs, rel=0,
      why=f"on the H100 {len(below)} of layer_ops' {len(exercise_ops)} are priced by their bytes, so a rebuild "
          f"or a layer run again costs its bytes, not its FLOPs, and the elementwise rebuilds a FLOP count leaves "
          f"out (both norms, SwiGLU's product) are priced beside the matmuls it counts; the lesson's own sweep on "
          f"this machine: {differs[('FLOPs', 'roofline')]} of {len(rows)} for its roofline, "
          f"{differs[('FLOPs', 'measured')]} for its measured profile")

# %%
RESULT = {"figures": [str(path), str(sweep_path)], "summary": {
    "budgets": len(rows),
    "FLOP vs measured plans differ at": differs[("FLOPs", "measured")],
    "FLOP vs roofline plans differ at": differs[("FLOPs", "roofline")],
    "each plan = the least of its price": optimal(rows),
    "timed budget MiB": None if chosen is None else round(mib(chosen["budget"]), 2),
    "measured / FLOP plan step time": "plans never differ" if claim is None else claim.short,
    "loss and grads = none's (bitwise)": all(f["bitwise"] for f in facts.values()),
    "stored peak = planned": all(facts[n]["stored"] == chosen["plans"][k].peak_bytes
                                 for n, k in (("FLOP plan", "FLOPs"), ("measured plan", "measured")) if n in facts)}}
